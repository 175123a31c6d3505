"""Running a comparison's children: one after another in this process, or ``compare.workers`` at a time in spawned
worker processes, each child a ``gearlab train`` of its own; stop requests (Ctrl-C, SIGTERM) are relayed to the
workers, which finish their iteration and start nothing new."""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from gearlab.config import load_config
from gearlab.stopping import STOP_SIGNALS, StopSignals


@dataclass
class Child:
    assigner: str
    seed: int
    overrides: list[str]

    @property
    def label(self) -> str:
        return f"{self.assigner}-s{self.seed}"


class _Relay:
    """What the comparison does on each stop request it catches: say so once, and pass the signal on to its worker
    processes (they are in process groups of their own, so a terminal's Ctrl-C reaches them only this way) and set
    the pool's stop flag, which a worker reads before it starts a queued child."""

    def __init__(self) -> None:
        self.event: Any = None  # the running pool's multiprocessing Event, else None

    def __call__(self, signum: int, first: bool) -> None:
        if self.event is not None:
            self.event.set()
        for p in multiprocessing.active_children():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signum)
        if first:  # os.write: a print from a signal handler can collide with one the main thread is in
            os.write(1, f"[compare] stop requested ({signal.Signals(signum).name}): running children stop at their "
                        "next iteration boundary and none starts after them; Ctrl-C again aborts them now\n".encode())


def run_child(overrides: list[str], log: str | None = None) -> tuple[str, str, float]:
    """Train one child in this process: ("ok" | "stopped" | "failed" | "not_started", error text, seconds). "stopped":
    at an iteration boundary (a signal, trainer.deadline) or aborted by a second Ctrl-C, resumable either way;
    "not_started": a worker process (_run_pool) was asked to stop before this child began. With ``log``, the
    child's console output (both file descriptors, so also library output) goes to that file instead."""
    import traceback

    from gearlab.trainer.train import train

    if _WORKER_STOP is not None and (_WORKER_STOP.requested or (_WORKER_EVENT is not None and _WORKER_EVENT.is_set())):
        return "not_started", "", 0.0
    t0 = time.time()
    saved: tuple[int, int] | None = None
    if log is not None:
        Path(log).parent.mkdir(parents=True, exist_ok=True)
        sys.stdout.flush()
        sys.stderr.flush()
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        saved = os.dup(1), os.dup(2)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    try:
        cfg = load_config(overrides)
        if 0 < cfg.trainer.deadline <= time.time():  # queued past compare.max_minutes: left for the next call
            return "stopped", "", 0.0
        res = train(cfg)
        outcome, err = ("stopped" if res.stopped_early else "ok"), ""
        if outcome == "ok" and cfg.credit_eval.after_training and not res.already_finished:
            from gearlab.commands.credit_eval import after_training

            try:  # the run itself finished: a failed scoring is reported, not a failed child
                after_training(cfg, res)
            except Exception as e:
                print(f"[credit-eval] {cfg.assigner.name}-s{cfg.trainer.seed}: failed: {type(e).__name__}: {e}",
                      flush=True)
    except KeyboardInterrupt:  # Ctrl-C twice: aborted mid-iteration; its last checkpoint resumes it
        outcome, err = "stopped", ""
    except (Exception, SystemExit) as e:  # a crashed child is recorded and the comparison goes on
        outcome, err = "failed", "".join(traceback.format_exception(e))[-4000:]
    finally:
        if saved is not None:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
    return outcome, err, time.time() - t0


# a worker process's own stop scope and the pool's stop flag (set in each worker by _worker_init; None elsewhere)
_WORKER_STOP: StopSignals | None = None
_WORKER_EVENT: Any = None


def worker_gpus(workers: int, gpus: list[int] | None, visible: str | None, count: int) -> list[str] | None:
    """The CUDA device each of ``workers`` pool workers is given (its CUDA_VISIBLE_DEVICES), round-robin, or None
    to leave the environment alone. ``gpus``: compare.gpus (None = every visible device; [] = no pinning);
    ``visible``: the comparison's own CUDA_VISIBLE_DEVICES; ``count``: the CUDA devices it sees. One device or
    one worker: None (nothing to spread)."""
    if gpus is None:
        ids = [v.strip() for v in visible.split(",") if v.strip()] if visible else [str(i) for i in range(count)]
    else:
        ids = [str(g) for g in gpus]
    if workers <= 1 or not ids or (gpus is None and len(ids) == 1):
        return None
    return [ids[i % len(ids)] for i in range(workers)]


def _worker_init(threads: int, stop_event: Any, gpu_slots: Any = None) -> None:
    """A pool worker's set-up. It starts with SIGINT and SIGTERM ignored (_run_pool), so no signal can kill it during
    its seconds of imports and break the pool; it then leaves the terminal's process group (a Ctrl-C there reaches the
    comparison only, which relays every request once: a second copy would read as "Ctrl-C again") and catches both.
    ``gpu_slots``: a queue of CUDA device ids, one taken per worker before torch can touch CUDA."""
    global _WORKER_STOP, _WORKER_EVENT
    if gpu_slots is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu_slots.get(timeout=60)
    import torch

    torch.set_num_threads(threads)
    os.setpgrp()
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_DFL)
    # an idle worker only notes a request (a child it then picks up does not start); a running child's own scope
    # (gearlab.trainer.train) stops it at the boundary, or aborts it on the second Ctrl-C
    _WORKER_STOP = StopSignals(abort_on_repeat=False).__enter__()
    _WORKER_EVENT = stop_event


def _settle(f: Any, c: Child, finish: Callable[..., None]) -> str:
    """Report one finished (or cancelled) future of the pool to ``finish``; returns its outcome."""
    if f.cancelled():  # queued when the comparison stopped: not run, so neither finished nor failed
        outcome, err, secs = "not_started", "", 0.0
    else:
        try:
            outcome, err, secs = f.result()
        except Exception as e:  # the worker process itself died (e.g. killed): the pool is broken
            outcome, err, secs = "failed", f"{type(e).__name__}: {e}", 0.0
    finish(c, outcome, secs, err)
    return outcome


def _run_pool(todo: list[Child], workers: int, threads: int, logs: Path, finish: Callable[..., None],
              stop: StopSignals | None = None, relay: _Relay | None = None, gpus: list[str] | None = None) -> None:
    """Run the children on ``workers`` long-lived processes (started once, so the ~10 s of imports are paid once
    per worker, not once per child); each child's output goes to ``<output_dir>/<comparison>/<label>/train.log``.
    ``gpus``: worker i's CUDA_VISIBLE_DEVICES (:func:`worker_gpus`), None to leave it as it is.
    On a stop request (Ctrl-C, SIGTERM: ``stop``, relayed to the workers by ``relay``) the running children stop at
    an iteration boundary and no queued one starts (reported "not_started"); a second Ctrl-C aborts the running ones
    and raises KeyboardInterrupt here once every outcome is reported. A child stopped by its trainer.deadline
    cancels the queued ones too."""
    from concurrent.futures import ProcessPoolExecutor, as_completed

    stop, relay = stop or StopSignals(), relay or _Relay()
    if stop.requested:
        return
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}  # read at import by the workers
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    ctx = multiprocessing.get_context("spawn")
    relay.event = ctx.Event()
    slots = None
    if gpus:
        slots = ctx.Queue()
        for g in gpus:
            slots.put(g)
    pool = None
    try:
        # the workers are spawned by the submits: they inherit SIGINT and SIGTERM ignored (see _worker_init). A
        # request in these few milliseconds is lost here too; that is the price of workers a signal cannot break.
        main = threading.current_thread() is threading.main_thread()  # (only there may handlers be set)
        ignored = {s: signal.signal(s, signal.SIG_IGN) for s in STOP_SIGNALS} if main else {}
        try:
            pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_init,
                                       initargs=(threads, relay.event, slots))
            futures = {pool.submit(run_child,
                                   [*c.overrides, "trainer.progress_bar=false", f"trainer.threads={threads}"],
                                   str(logs / c.label / "train.log")): c for c in todo}
        finally:
            for s, h in ignored.items():
                signal.signal(s, h if h is not None else signal.SIG_DFL)
        if stop.requested:  # came before the workers existed: relay it now (the flag reaches those still starting)
            relay(stop.signum, False)
        pending = dict(futures)
        try:
            for f in as_completed(futures):
                outcome = _settle(f, pending.pop(f), finish)
                if stop.requested or outcome == "stopped":
                    for g in pending:
                        g.cancel()
        except KeyboardInterrupt:  # a second Ctrl-C, relayed to the workers: their children abort now
            pool.shutdown(wait=True, cancel_futures=True)
            for f, c in pending.items():
                _settle(f, c, finish)
            raise
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        relay.event = None
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
