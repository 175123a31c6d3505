"""MLflow experiments made by gearlab: model-training kind, artifacts beside the SQLite store, versions on record."""
from __future__ import annotations

import os
import sys
from importlib import metadata
from pathlib import Path

import mlflow
import torch

from gearlab.config import load_config
from gearlab.trainer.provenance import package_versions
from gearlab.trainer.tracking import (
    EXPERIMENT_KIND_TAG,
    MODEL_TRAINING_KIND,
    artifact_location,
    ensure_experiment,
    git_sha,
    make_logger,
    record_versions,
    tracking_uri,
)


def _cfg(tmp_path, *extra):
    return load_config([f"trainer.output_dir={tmp_path}", *extra])


def test_make_logger_creates_a_model_training_experiment_with_artifacts_beside_the_db(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a stray ./mlruns would appear here
    out = tmp_path / "runs"
    cfg = _cfg(out, "logging.experiment=my/exp")
    uri = tracking_uri(cfg)
    assert uri == f"sqlite:///{out.resolve() / 'mlflow.db'}"
    logger = make_logger(cfg, out / "r1", model_name="tiny")
    assert os.environ.get("MLFLOW_TRACKING_URI") is None  # not leaked to later runs
    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name("my/exp")
    assert exp.tags[EXPERIMENT_KIND_TAG] == MODEL_TRAINING_KIND == "custom_model_development"
    assert exp.artifact_location == (out.resolve() / "mlartifacts" / "my_exp").as_uri()
    run = client.get_run(logger.run_id)
    assert run.info.experiment_id == exp.experiment_id
    assert run.data.tags["versions.torch"] == torch.__version__
    assert run.data.tags["versions.python"] == ".".join(map(str, sys.version_info[:3]))
    assert run.data.tags["versions.gearlab"] == run.data.tags["git_sha"] == git_sha()
    assert set(package_versions()) <= {k[len("versions."):] for k in run.data.tags if k.startswith("versions.")}
    client.log_text(logger.run_id, "hello", "note.txt")  # artifacts land under <output_dir>/mlartifacts
    assert list((out / "mlartifacts" / "my_exp").rglob("note.txt"))
    assert not (tmp_path / "mlruns").exists()


def test_resumed_run_records_versions_and_keeps_a_change(tmp_path):
    cfg = _cfg(tmp_path)
    first = make_logger(cfg, tmp_path / "r", model_name="tiny")
    client = mlflow.MlflowClient(tracking_uri(cfg))
    client.delete_tag(first.run_id, "versions.torch")  # as if the run had been made before the tags existed
    again = make_logger(cfg, tmp_path / "r", model_name="tiny")  # mlflow_run_id beside the run: a resume
    assert again.run_id == first.run_id
    tags = client.get_run(first.run_id).data.tags
    assert tags["resumed"] == "true" and tags["versions.torch"] == torch.__version__
    # resumed under another version: both are kept, the newest last
    record_versions(client, first.run_id, {**package_versions(), "transformers": "0.0.1"})
    old = package_versions()["transformers"]
    assert client.get_run(first.run_id).data.tags["versions.transformers"] == f"{old} -> 0.0.1"
    record_versions(client, first.run_id, {**package_versions(), "transformers": "0.0.1"})  # no change: unchanged
    assert client.get_run(first.run_id).data.tags["versions.transformers"] == f"{old} -> 0.0.1"


def test_an_existing_experiment_without_a_kind_gets_one(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    exp_id = client.create_experiment("old")  # as made by Lightning or an older gearlab
    assert EXPERIMENT_KIND_TAG not in client.get_experiment(exp_id).tags
    assert ensure_experiment(uri, "old") == exp_id
    assert client.get_experiment(exp_id).tags[EXPERIMENT_KIND_TAG] == MODEL_TRAINING_KIND
    client.set_experiment_tag(exp_id, EXPERIMENT_KIND_TAG, "genai_development")  # a kind someone chose stays
    ensure_experiment(uri, "old")
    assert client.get_experiment(exp_id).tags[EXPERIMENT_KIND_TAG] == "genai_development"
    client.delete_experiment(exp_id)  # a deleted experiment is restored, not re-created under a clashing name
    assert ensure_experiment(uri, "old") == exp_id and client.get_experiment(exp_id).lifecycle_stage == "active"


def test_artifact_location_only_for_a_sqlite_store(tmp_path):
    assert artifact_location(
        f"sqlite:///{tmp_path / 'x.db'}", "compare/a b"
    ) == (tmp_path / "mlartifacts" / "compare_a_b").as_uri()
    rel = artifact_location("sqlite:///runs/mlflow.db", "gearlab")
    assert rel == (Path.cwd() / "runs" / "mlartifacts" / "gearlab").as_uri()  # absolute, not relative to a later cwd
    assert artifact_location("http://127.0.0.1:5000", "gearlab") is None
    assert artifact_location("databricks", "gearlab") is None


def test_package_versions_is_cheap_and_complete():
    v = package_versions()
    assert set(v) == {"torch", "transformers", "tokenizers", "lightning", "mlflow", "omegaconf", "numpy", "python",
                      "reasoning-gym", "gearlab",
                      "cpu_model", "cpu_kernels", "aten_cpu_capability", "mkl_cbwr", "onednn_max_cpu_isa", "cpu_linear",
                      "torch_threads", "cpu_capability", "onednn"}  # the last three because torch is loaded here
    assert v["torch_threads"] == str(torch.get_num_threads())
    # what decides CPU digits: the pinned kernels are in force in this (gearlab-importing) process
    assert (v["aten_cpu_capability"], v["mkl_cbwr"], v["cpu_capability"]) == ("avx2", "COMPATIBLE", "AVX2")
    assert v["cpu_linear"] == "onednn" and v["onednn"].startswith("v3.")  # the product's library and its version
    assert v["cpu_model"] not in ("", "unknown")
    assert v["mlflow"] == mlflow.__version__ and all(isinstance(x, str) and x for x in v.values())
    # the distribution's version: reasoning-gym 0.1.25's own __version__ still says 0.1.19
    assert v["reasoning-gym"] == metadata.version("reasoning-gym") != "missing"


def test_runs_url_opens_the_runs_tab_of_the_installed_mlflow_ui():
    """The printed address: the experiment's runs tab with the machine-learning side of the UI's GenAI switch, as the
    installed MLflow defines them (a UI upgrade that renames the route or the switch fails here, not on a user)."""
    from gearlab.trainer.tracking import runs_url

    assert runs_url("sqlite:////data/runs/mlflow.db", "7") == \
        "http://127.0.0.1:5000/#/experiments/7/runs?workflowType=machine_learning"
    assert runs_url("https://user:secret@mlflow.example.org/base/", "3") == \
        "https://mlflow.example.org/base/#/experiments/3/runs?workflowType=machine_learning"  # no credentials printed
    root = Path(mlflow.__file__).parent
    # MLflow's own run links are hash routes under the server's address
    assert 'f"{host_url}/#/experiments/{experiment_id}"' in (
        root / "tracking" / "_tracking_service" / "client.py"
    ).read_text()
    ui = "".join(
        p.read_text(errors="ignore") for p in (root / "server" / "js" / "build" / "static" / "js").glob("main.*.js")
    )
    assert '"/experiments/:experimentId/runs"' in ui  # the runs tab
    assert 'get("workflowType")' in ui and 'MACHINE_LEARNING="machine_learning"' in ui  # the switch, read from the URL
    assert 'key:"mlflow.workflowType"' in ui  # ... which otherwise comes from the browser's storage
