"""FSDP2 training through `gearlab train` on 2 CPU processes (gloo): a stopped-and-resumed sharded run
ends bit-identical to an uninterrupted one, in the same MLflow run; `gearlab export` consolidates the
sharded checkpoint; a 2-"node" torchrun launch (localhost rendezvous, one process per node) trains and
checkpoints."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import mlflow
import pytest
import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _common(model_dir, out, *extra):
    return [f"model.name_or_path={model_dir}", "trainer.accelerator=cpu", "rollout.prompts_per_step=4",
            "rollout.group_size=4", "rollout.max_new_tokens=8", "eval.num_problems=0", "trainer.progress_bar=false",
            "algorithm.entropy_coef=0.05", "optim.lr=1e-3", "trainer.max_steps=4", "trainer.checkpoint_every=3",
            f"trainer.output_dir={out}", *extra]


def _train(args, cwd, env=None):
    r = subprocess.run([sys.executable, "-m", "gearlab.cli", "train", *args], capture_output=True, text=True,
                       timeout=600, cwd=cwd, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _weights(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_fsdp2_stop_resume_is_exact_and_exports(tmp_path, tiny_model_dir):
    a, b = tmp_path / "a", tmp_path / "b"
    _train(_common(tiny_model_dir, a, "trainer.devices=2"), tmp_path)
    _train(_common(tiny_model_dir, b, "trainer.devices=2", "trainer.stop_after=2"), tmp_path)
    ckpt = b / "arith-grpo-s0" / "checkpoints" / "last.ckpt"
    assert ckpt.is_dir() and sorted(p.name for p in ckpt.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    client = mlflow.MlflowClient(f"sqlite:///{b / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("gearlab").experiment_id])
    assert run.info.status == "KILLED"  # stopped, not finished: a comparison would resume it
    r = _train(_common(tiny_model_dir, b, "trainer.devices=2"), tmp_path)
    assert "resuming from" in r.stderr
    wa, wb = _weights(a / "arith-grpo-s0" / "final"), _weights(b / "arith-grpo-s0" / "final")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    start = _weights(tiny_model_dir)
    assert any(not torch.equal(wa[k], start[k]) for k in wa)  # it trained
    (run,) = client.search_runs([client.get_experiment_by_name("gearlab").experiment_id])
    hist = client.get_metric_history(run.info.run_id, "update/entropy_bonus")
    assert run.info.status == "FINISHED" and sorted(m.step for m in hist) == [0, 1, 2, 3]
    # export the (2-process) sharded checkpoint in one process
    out = tmp_path / "exported"
    e = subprocess.run([sys.executable, "-m", "gearlab.cli", "export", f"model.name_or_path={tiny_model_dir}",
                        f"export.checkpoint={a / 'arith-grpo-s0' / 'checkpoints' / 'last.ckpt'}", f"export.out={out}"],
                       capture_output=True, text=True, timeout=300)
    assert e.returncode == 0, e.stderr[-2000:]
    we = _weights(out)
    assert all(torch.equal(we[k], wa[k]) for k in we)


def test_two_node_torchrun_launch(tmp_path, tiny_model_dir):
    port = _free_port()
    args = _common(tiny_model_dir, tmp_path / "n", "trainer.devices=1", "trainer.num_nodes=2", "trainer.max_steps=2",
                   "eval.num_problems=4", "eval.k=2")  # evaluation split over the 2 ranks
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                               "--node_rank", str(n), "--master_addr", "127.0.0.1", "--master_port", str(port),
                               "-m", "gearlab.cli", "train", *args], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in (0, 1)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (so, se) in zip(procs, outs):
        assert p.returncode == 0, se[-3000:]
    assert "MEMBER: 2/2" in outs[1][1] + outs[1][0]
    run_dir = tmp_path / "n" / "arith-grpo-s0"
    assert sorted(
        p.name for p in (run_dir / "checkpoints" / "last.ckpt").glob("*.distcp")
    ) == ["__0_0.distcp", "__1_0.distcp"]
    assert (run_dir / "final" / "model.safetensors").is_file()
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'n' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("gearlab").experiment_id])
    assert len(client.get_metric_history(run.info.run_id, "eval/greedy_accuracy")) == 2  # before and after


@pytest.mark.parametrize("override,msg", [("trainer.strategy=fsdp1", "fsdp1 needs GPUs"),
                                          ("trainer.cpu_offload=true", "only with trainer.strategy=fsdp2"),
                                          ("rollout.prompts_per_step=3", "not divisible by the 2 processes")])
def test_bad_distributed_settings_fail_before_work(tmp_path, override, msg):
    r = subprocess.run([sys.executable, "-m", "gearlab.cli", "train", "trainer.devices=2", "trainer.accelerator=cpu",
                        "trainer.strategy=ddp" if "cpu_offload" in override else "trainer.strategy=auto", override,
                        f"trainer.output_dir={tmp_path}"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not any(tmp_path.iterdir())
