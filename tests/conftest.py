"""Shared fixtures: a tiny tokenizer/model built in-process (no download) and a real MLflow server."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.pop("MLFLOW_TRACKING_URI", None)
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slurm`` start a Slurm cluster on this host (installing slurm-wlm and munge with apt where
    missing): they run only when asked for by marker, ``pytest -m slurm`` (the CI's slurm lane), never in ``pytest``.
    Tests marked ``serial`` keep every core busy for minutes: beside another xdist worker they ran ~5x slower (the
    warm-start recomputation, 240 s alone on 2 cores, took 1,147 s), so xdist workers skip them and the main lane runs
    them alone afterwards, ``pytest -m serial``."""
    wanted = config.getoption("markexpr") or ""
    slurm_reason = "starts a Slurm cluster: run with `pytest -m slurm` (the CI's slurm lane)"
    skips = {"slurm": pytest.mark.skip(reason=slurm_reason)}
    if os.environ.get("PYTEST_XDIST_WORKER"):
        skips["serial"] = pytest.mark.skip(reason="needs the cores to itself: run with `pytest -m serial`")
    for item in items:
        for mark, skip in skips.items():
            if mark not in wanted and item.get_closest_marker(mark) is not None:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def tokenizer():
    from gearlab.models.tiny import build_tokenizer

    tok = build_tokenizer()
    tok.padding_side = "left"
    return tok


@pytest.fixture(scope="session")
def tiny_model_factory(tokenizer):
    from gearlab.models.tiny import build_tiny_model

    def make(seed: int = 0):
        return build_tiny_model(tokenizer, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                head_dim=16, intermediate_size=128, seed=seed).eval()

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer, tiny_model_factory) -> Path:
    """A saved tiny model folder (random weights) that `model.name_or_path` can point at."""
    d = tmp_path_factory.mktemp("tiny_model")
    tiny_model_factory(0).save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real `mlflow server` on 127.0.0.1 with a SQLite backend; yields its URI."""
    d = tmp_path_factory.mktemp("mlflow_server")
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{d / 'srv.db'}",
         "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--artifacts-destination", str(d / "artifacts")],
        cwd=d, stdout=open(d / "server.log", "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    deadline = time.time() + 90
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mlflow server exited: {(d / 'server.log').read_text()[-2000:]}")
        try:
            if urllib.request.urlopen(f"{uri}/health", timeout=2).status == 200:
                break
        except OSError:
            time.sleep(0.5)
    else:
        proc.kill()
        raise RuntimeError("mlflow server did not become healthy in 90 s")
    yield uri
    import signal

    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
