"""Stop requests by signal: Ctrl-C (SIGINT) and SIGTERM (what ``timeout``, Slurm and ``docker stop`` send) alike.

The first of either asks for a clean stop: a training run finishes its iteration, writes its checkpoint and returns
(gearlab.trainer.train); a comparison starts no new child (gearlab.commands.compare). The command then exits with
128 + the signal number (130 for SIGINT, 143 for SIGTERM), as a shell reports a process the signal ended. A second
Ctrl-C aborts at once (the last checkpoint stays); a second SIGTERM changes nothing, since a supervisor may send it
to several processes of one job.

Scopes nest: a :class:`StopSignals` entered while another is installed (a training run inside a comparison, or in
one of its worker processes) passes every request on to the enclosing one, so the comparison knows of it too.
"""
from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any, Callable

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_SCOPES: list["StopSignals"] = []  # the scopes installed in the main thread, innermost last


def pending_stop() -> int:
    """The signal of the stop request the innermost installed scope holds (0: none, or no scope). Long work that runs
    before a training loop exists to honour the request (a warm start inside ``gearlab train`` or ``compare``) polls
    it and raises :class:`Stopped`."""
    return _SCOPES[-1].signum if _SCOPES else 0


class Stopped(Exception):
    """A stop request ended work that keeps nothing partial (``what``); the command exits with 128 + ``signum``."""

    def __init__(self, signum: int, what: str) -> None:
        self.signum, self.what = signum, what
        super().__init__(f"stopped ({signal.Signals(signum).name}) during {what}")


class StopSignals:
    """Context manager that catches SIGINT and SIGTERM in the main thread and records the first as ``signum``.

    ``on_request(signum, first)`` runs on every signal caught (``first``: no request was recorded before).
    ``abort_on_repeat``: a second SIGINT raises KeyboardInterrupt (after ``on_request``). A signal the process was
    told to ignore (``nohup``, ``cmd &``) stays ignored. Outside the main thread nothing is installed (Python allows
    signal handlers only there) and ``signum`` stays 0. The handlers found on entry are put back on exit."""

    def __init__(self, on_request: Callable[[int, bool], None] | None = None, *, abort_on_repeat: bool = True) -> None:
        self.signum = 0
        self.on_request = on_request
        self.abort_on_repeat = abort_on_repeat
        self._old: dict[int, Any] = {}
        self._outer: StopSignals | None = None

    @property
    def requested(self) -> bool:
        return self.signum != 0

    @property
    def exit_code(self) -> int:
        """128 + the signal that asked for the stop (130 SIGINT, 143 SIGTERM); 0 when none did."""
        return 128 + self.signum if self.signum else 0

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def record(self, signum: int) -> None:
        """Note a stop request without the abort rule: what an inner scope's handler calls on its enclosing one."""
        first = not self.signum
        if first:
            self.signum = signum
        if self.on_request is not None:
            self.on_request(signum, first)
        if self._outer is not None:
            self._outer.record(signum)

    def handle(self, signum: int, frame: FrameType | None) -> None:
        """The signal handler."""
        repeat = self.requested
        self.record(signum)
        if repeat and signum == signal.SIGINT and self.abort_on_repeat:
            raise KeyboardInterrupt

    def install(self) -> None:
        """(Re)install the handler for the signals this scope owns: after a library replaced it (Lightning installs its
        own SIGTERM handler when a fit starts, gearlab.trainer.train)."""
        if threading.current_thread() is threading.main_thread():
            for s in self._old:
                signal.signal(s, self.handle)

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is not threading.main_thread():
            return self
        for s in STOP_SIGNALS:
            old = signal.getsignal(s)
            if old is signal.SIG_IGN:
                continue
            self._old[s] = old
            outer = getattr(old, "__self__", None)
            if isinstance(outer, StopSignals) and outer is not self:
                self._outer = outer
        if self._outer is not None and self._outer.requested and not self.requested:
            self.signum = self._outer.signum  # asked before this scope began (a child starting in a stopping worker)
        self.install()
        _SCOPES.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if threading.current_thread() is threading.main_thread():
            for s, h in self._old.items():
                signal.signal(s, h if h is not None else signal.SIG_DFL)
            if self in _SCOPES:
                _SCOPES.remove(self)
        self._old = {}
