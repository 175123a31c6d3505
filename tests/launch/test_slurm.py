"""A real multi-node launch through Slurm: the shipped `experiments/slurm/gearlab.sbatch`, 2 nodes × 1 task, on CPU.

From scratch on this host: Debian's `slurm-wlm` and `munge` (installed with apt where missing; needs root), a munged of
its own (own key, socket, pid file), a slurm.conf with one controller and two compute nodes `n1`, `n2` on 127.0.0.1
(one slurmd each, `slurmd -N n1` / `-N n2`, their own port, spool folder, pid file and log; Debian builds Slurm with
multiple-slurmd support: `scontrol show config` says MULTIPLE_SLURMD = Yes). The job trains 2 iterations of the
embedded task (the shipped warm start of the tiny model) with FSDP2 over gloo, one rank per node, and checkpoints.

Marked `slurm`: skipped in the main lane (tests/conftest.py), run by the CI's slurm lane, `pytest -q -m slurm`, in
the main lane's venv. Every wait is bounded; the daemons and whatever they started are stopped in a `finally`.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import mlflow
import pytest
import torch

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "experiments" / "slurm" / "gearlab.sbatch"
STEPS = 2
NODES = ("n1", "n2")
DAEMONS = ("sbatch", "sinfo", "scontrol", "scancel", "srun", "slurmctld", "slurmd", "munged", "munge", "unmunge")


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin:/sbin:/bin")


def _ensure_slurm_installed() -> None:
    """Debian's slurm-wlm and munge, with apt when any of their programs is missing (the CI box starts bare)."""
    if all(_which(d) for d in DAEMONS):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.fail("Slurm/munge are not installed and cannot be installed here (needs root and apt-get): "
                    "apt-get install -y slurm-wlm munge")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd, limit in ((["apt-get", "update", "-q"], 180),
                       (["apt-get", "install", "-y", "-q", "--no-install-recommends", "slurm-wlm", "munge"], 300)):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=env)
        assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{(r.stdout + r.stderr)[-3000:]}"
    missing = [d for d in DAEMONS if not _which(d)]
    assert not missing, f"still missing after apt-get install slurm-wlm munge: {missing}"


def _tail(path: Path, n: int = 3000) -> str:
    return f"--- {path.name}:\n{path.read_text(errors='replace')[-n:]}" if path.is_file() else f"--- {path.name}: none"


class Cluster:
    """munged + slurmctld + one slurmd per node, all children of this process, on free ports."""

    def __init__(self, base: Path):
        self.base = base
        self.marker = f"GEARLAB_SLURM_TEST={uuid.uuid4().hex}"  # in the environ of everything started from here
        self.procs: list[subprocess.Popen] = []
        # munged insists that every user can reach its socket's folder: pytest's tmp folders are 0700, so its own
        self.munge_dir = Path(tempfile.mkdtemp(prefix="gearlab-munge-", dir="/tmp"))
        self.munge_dir.chmod(0o755)
        self.conf = base / "slurm.conf"
        for d in ("state", "log", *(f"spool/{n}" for n in NODES)):
            (base / d).mkdir(parents=True, exist_ok=True)
        k, v = self.marker.split("=")
        self.env = {key: val for key, val in os.environ.items() if not key.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
        self.env.update({k: v, "SLURM_CONF": str(self.conf)})

    def logs(self) -> str:
        files = [self.base / "log" / f for f in ("slurmctld.log", *(f"slurmd-{n}.log" for n in NODES))]
        return "\n".join([_tail(f, 1500) for f in files] + [_tail(self.munge_dir / "munged.log", 800)])

    def _spawn(self, args: list[str], log: str) -> subprocess.Popen:
        p = subprocess.Popen(args, env=self.env, stdout=open(self.base / "log" / log, "w"), stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs.append(p)
        return p

    def start(self) -> None:
        key = self.munge_dir / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o400)
        sock = self.munge_dir / "munge.socket"
        self._spawn([_which("munged"), "--foreground", f"--key-file={key}", f"--socket={sock}",
                     f"--pid-file={self.munge_dir / 'munged.pid'}", f"--seed-file={self.munge_dir / 'munged.seed'}",
                     f"--log-file={self.munge_dir / 'munged.log'}"], "munged.out")
        self._wait(lambda: subprocess.run([_which("munge"), "-n", "-S", str(sock)], capture_output=True,
                                          timeout=5).returncode == 0, 30, "munged did not answer")
        ctld, *node_ports = _free_ports(1 + len(NODES))
        b = self.base
        nodes = "\n".join(f"NodeName={n} NodeAddr=127.0.0.1 Port={p} CPUs=1 State=UNKNOWN"
                          for n, p in zip(NODES, node_ports))
        self.conf.write_text(f"""\
ClusterName=gearlabtest
SlurmctldHost=localhost
SlurmctldPort={ctld}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={sock}
StateSaveLocation={b}/state
SlurmdSpoolDir={b}/spool/%n
SlurmctldPidFile={b}/slurmctld.pid
SlurmdPidFile={b}/slurmd-%n.pid
SlurmctldLogFile={b}/log/slurmctld.log
SlurmdLogFile={b}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
SlurmdTimeout=60
KillWait=5
{nodes}
PartitionName=debug Nodes={",".join(NODES)} Default=YES MaxTime=10 State=UP
""")
        self._spawn([_which("slurmctld"), "-D", "-f", str(self.conf)], "slurmctld.out")
        for n in NODES:
            self._spawn([_which("slurmd"), "-D", "-N", n, "-f", str(self.conf)], f"slurmd-{n}.out")

        def idle() -> bool:
            r = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=10, check=False)
            states = dict(line.split() for line in r.stdout.splitlines() if line.strip())
            return all(states.get(n) == "idle" for n in NODES)

        self._wait(idle, 60, "the two nodes did not come up idle")

    def _wait(self, ok, seconds: float, what: str) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead:
                raise AssertionError(f"{dead} exited\n{self.logs()}")
            try:
                if ok():
                    return
            except (subprocess.TimeoutExpired, ValueError):
                pass
            time.sleep(0.5)
        raise AssertionError(f"{what} within {seconds} s\n{self.logs()}")

    def run(self, args: list[str], *, timeout: float, check: bool = True, **kw) -> subprocess.CompletedProcess:
        r = subprocess.run([_which(args[0]), *args[1:]], env=kw.pop("env", self.env), capture_output=True,
                           text=True, timeout=timeout, **kw)
        assert not check or r.returncode == 0, f"{args} failed: {r.stdout}{r.stderr}"
        return r

    def job(self, job_id: str) -> dict[str, str]:
        out = self.run(["scontrol", "-o", "show", "job", job_id], timeout=10).stdout
        return dict(w.split("=", 1) for w in out.split() if "=" in w)

    def stop(self, job_id: str | None) -> None:
        """Cancel the job and wait (bounded) for it to end, stop the daemons, then kill whatever this cluster started
        that is still there: slurmstepd and the job's tasks are not the slurmds' children and outlive them. They are
        found by this cluster's marker in their environment (tasks) or an open file under its folder (a slurmstepd
        blanks its environment for its process title but keeps its node's slurmd log open). Never raises."""
        if job_id:
            try:
                self.run(["scancel", job_id], timeout=10, check=False)
                deadline = time.monotonic() + 20
                while self.job(job_id).get("JobState") in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.5)
            except Exception:  # noqa: BLE001 - the controller may be gone already
                pass
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        for pid in self._leftovers():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        shutil.rmtree(self.munge_dir, ignore_errors=True)

    def _leftovers(self) -> list[int]:
        needle, prefixes = self.marker.encode(), (f"{self.base}/", f"{self.munge_dir}/")
        found = []
        for pid in (int(d) for d in os.listdir("/proc") if d.isdigit()):
            if pid == os.getpid():  # this process holds the daemons' output files open
                continue
            try:
                if needle in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") or any(
                    os.readlink(f"/proc/{pid}/fd/{fd}").startswith(prefixes) for fd in os.listdir(f"/proc/{pid}/fd")
                ):
                    found.append(pid)
            except OSError:  # gone meanwhile, or not ours to read
                pass
        return found


def test_sbatch_two_nodes_trains_and_checkpoints(tmp_path):
    _ensure_slurm_installed()
    from gearlab.models.shipped import copy_shipped

    model = tmp_path / "model"  # a model folder, as on a cluster (model.name_or_path=/models/...): the embedded
    copy_shipped(model)  # tiny model's shipped warm start
    work = tmp_path / "work"
    work.mkdir()
    cluster = Cluster(tmp_path / "slurm")
    job_id = None
    t0 = time.monotonic()
    try:
        cluster.start()
        t_up = time.monotonic() - t0
        master_port = _free_ports(1)[0]
        # the job's environment is this one (sbatch's default --export=ALL): gearlab on PATH; the rendezvous at
        # 127.0.0.1, since the node names n1, n2 resolve nowhere (on a cluster, Lightning takes the first node's name)
        env = {**cluster.env, "PATH": f"{Path(sys.executable).parent}:{cluster.env.get('PATH', '/usr/bin:/bin')}",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port), "OMP_NUM_THREADS": "1"}
        overrides = [f"model.name_or_path={model}", "trainer.accelerator=cpu", "rollout.prompts_per_step=4",
                     "rollout.group_size=4", "rollout.max_new_tokens=16", "eval.num_problems=0",
                     "trainer.progress_bar=false", f"trainer.max_steps={STEPS}", "trainer.output_dir=runs"]
        # the script's #SBATCH lines are a GPU cluster's; command-line options override them
        r = cluster.run(["sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=0",
                         "--cpus-per-task=1", "--time=5", f"--output={work}/slurm-%j.out", str(SCRIPT), *overrides],
                        timeout=30, cwd=work, env=env)
        job_id = r.stdout.strip().split(";")[0]
        deadline = time.monotonic() + 240
        while (info := cluster.job(job_id))["JobState"] in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            assert time.monotonic() < deadline, f"job {job_id} still {info['JobState']} after 240 s\n{cluster.logs()}"
            time.sleep(1)
        t_job = time.monotonic() - t0 - t_up
        out_file = work / f"slurm-{job_id}.out"
        out = out_file.read_text(errors="replace") if out_file.is_file() else "(no job output)"
        assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), f"{info}\n{out[-4000:]}\n{cluster.logs()}"
        # one rank per node: Lightning saw a world of 2 from Slurm's variables, and each slurmd launched a task of
        # the job's step 0
        assert "GLOBAL_RANK: 0, MEMBER: 1/2" in out and "GLOBAL_RANK: 1, MEMBER: 2/2" in out, out[-4000:]
        for n in NODES:
            log = (cluster.base / "log" / f"slurmd-{n}.log").read_text(errors="replace")
            assert f"launch task StepId={job_id}.0 " in log, f"node {n} ran no task of step {job_id}.0\n{log[-2000:]}"
        assert f"done: {STEPS} iterations" in out, out[-4000:]
        run_dir = work / "runs" / "arith-grpo-s0"
        ckpt = run_dir / "checkpoints" / "last.ckpt"  # FSDP2's sharded checkpoint: one shard per rank
        assert sorted(p.name for p in ckpt.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"], out[-3000:]
        meta = torch.load(ckpt / "meta.pt", weights_only=False)
        assert meta["gearlab"]["iterations_done"] == STEPS
        assert meta["gearlab"]["config"]["trainer"]["num_nodes"] == 2
        assert meta["gearlab"]["config"]["trainer"]["devices"] == 1
        assert json.loads((run_dir / "summary.json").read_text())["iterations_done"] == STEPS
        assert (run_dir / "final" / "model.safetensors").is_file()
        client = mlflow.MlflowClient(f"sqlite:///{work / 'runs' / 'mlflow.db'}")
        run = client.get_run((run_dir / "mlflow_run_id").read_text())
        assert run.info.status == "FINISHED"
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "train/reward")) == list(range(STEPS))
        print(f"slurm cluster up in {t_up:.1f} s, job {job_id} done in {t_job:.1f} s")
    finally:
        cluster.stop(job_id)
