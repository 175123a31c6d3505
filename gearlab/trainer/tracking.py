"""MLflow as the record of every run: Lightning's MLFlowLogger with sanitised keys, standard tags,
the flattened config as params, and a run id kept beside the checkpoints so a resumed run
continues the same MLflow run.

Experiments are created here (:func:`ensure_experiment`, also used by ``gearlab compare``), not by
Lightning: tagged with MLflow 3's model-training experiment kind and, for a SQLite store, with their artifacts
beside the database rather than in ``./mlruns`` of whatever directory a command or the UI was started from.

The kind tag does not decide where the MLflow UI opens: MLflow 3.17's UI starts on its GenAI pages unless its
GenAI / machine-learning switch says otherwise, and that switch is a browser-wide setting (local storage
``mlflow.workflowType``), not an experiment's. :func:`runs_url` gives the address that opens an experiment's runs
whatever the switch says."""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any, Mapping

from lightning.pytorch.loggers import MLFlowLogger

from gearlab.config import Config, ConfigError, flatten, to_yaml
from gearlab.core.metrics import sanitize_metric_key
from gearlab.credit.diagnostics import normalisation_scope
from gearlab.trainer.provenance import git_sha, version_tags  # noqa: F401  (git_sha: kept importable from here)

# MLflow 3 keeps an experiment's kind in this experiment tag (values from the UI's ExperimentKind enum,
# mlflow/server/js): it labels the experiment; it does not override the UI's browser-wide GenAI switch.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
MODEL_TRAINING_KIND = "custom_model_development"
# `mlflow ui` / `mlflow server` listen here unless told otherwise (mlflow/utils/cli_args.py: --host, --port)
MLFLOW_UI_DEFAULT = "http://127.0.0.1:5000"


def tracking_uri(cfg: Config) -> str:
    """cfg.logging.tracking_uri, else $MLFLOW_TRACKING_URI, else a SQLite file under the output dir."""
    if cfg.logging.tracking_uri:
        return cfg.logging.tracking_uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{Path(cfg.trainer.output_dir).resolve() / 'mlflow.db'}"


def check_tracking_uri(cfg: Config, timeout: float = 2.0) -> None:
    """An http(s) tracking store must answer within ``timeout`` seconds, else a one-line ConfigError naming the URI
    and where it was set: MLflow's own client retries a dead server for minutes and ends in a long traceback. Any
    HTTP answer counts, an auth error or a 404 included (the server is there; MLflow reports the rest), and so does a
    TLS handshake it fails. Other stores (SQLite, files) are not probed."""
    import ssl
    import threading
    import urllib.error
    import urllib.parse
    import urllib.request

    uri = tracking_uri(cfg)
    if not uri.lower().startswith(("http://", "https://")):
        return
    setting = "logging.tracking_uri" if cfg.logging.tracking_uri else "$MLFLOW_TRACKING_URI"
    source = f"key '{setting}'" if cfg.logging.tracking_uri else setting
    parts = urllib.parse.urlsplit(uri)
    host = parts.hostname or ""
    try:
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        raise ConfigError(f"{source}: {uri!r} is not a valid http(s) address (its port)") from None
    # credentials in the URI are MLflow's to send: neither probed with nor printed
    shown = urllib.parse.urlunsplit((parts.scheme, (f"[{host}]" if ":" in host else host) + port, parts.path, "", ""))
    failure: list[str] = []

    def probe() -> None:
        try:
            urllib.request.urlopen(shown.rstrip("/") + "/health", timeout=timeout).close()
        except urllib.error.HTTPError:
            pass  # the server answered
        except urllib.error.URLError as e:
            if not isinstance(e.reason, ssl.SSLError):  # a TLS handshake means something is listening
                failure.append(str(e.reason))
        except (OSError, ValueError) as e:  # a timeout mid-answer, a malformed address
            failure.append(str(e) or type(e).__name__)

    # a thread, so that a name lookup that hangs (urlopen's timeout does not cover DNS) cannot hold the run either
    t = threading.Thread(target=probe, daemon=True, name="gearlab-tracking-probe")
    t.start()
    t.join(timeout + 0.5)
    if t.is_alive():
        failure.append(f"no answer in {timeout:g} s")
    if failure:
        raise ConfigError(f"{source}: the MLflow tracking server {shown} is not reachable ({failure[0]}); start it, "
                          f"or point {setting} at a live server") from None


def runs_url(tracking: str, experiment_id: str) -> str:
    """The MLflow UI address that opens the runs table of experiment ``experiment_id``.

    The UI is a hash-routed single page: ``#/experiments/<id>/runs`` is its runs tab, and the ``workflowType``
    query selects the machine-learning side of its GenAI / machine-learning switch for this page, where the stored
    switch would otherwise show the GenAI navigation (route and parameter as MLflow 3.17's UI bundle defines
    them). An ``http(s)://`` tracking URI is the server itself; any other store (SQLite, a folder) is read through
    ``mlflow ui``, at its default address. Credentials in the URI are left out of the address (it is printed)."""
    import urllib.parse

    base = MLFLOW_UI_DEFAULT
    if tracking.lower().startswith(("http://", "https://")):
        parts = urllib.parse.urlsplit(tracking)
        base = urllib.parse.urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", "")).rstrip("/")
    return f"{base}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"


def artifact_location(tracking: str, experiment: str) -> str | None:
    """Where a new experiment keeps its artifacts: for a SQLite store ``sqlite:///DIR/x.db``,
    ``file://DIR/mlartifacts/<experiment, sanitised>`` (absolute), beside the database; None (the
    server's or MLflow's default) for any other store."""
    root = _sqlite_artifact_root(tracking)
    if root is None:
        return None
    folder = re.sub(r"[^A-Za-z0-9._-]+", "_", experiment).strip("._") or "experiment"
    return (root / folder).as_uri()


def _sqlite_artifact_root(tracking: str) -> Path | None:
    """``DIR/mlartifacts`` (absolute) for a SQLite store ``sqlite:///DIR/x.db``; None for an in-memory or any other
    store."""
    if not tracking.startswith("sqlite:///"):
        return None
    db = tracking[len("sqlite:///"):].split("?", 1)[0]
    if not db or db == ":memory:":
        return None
    return Path(db).resolve().parent / "mlartifacts"


def moved_artifact_dir(tracking: str, artifact_uri: str) -> Path | None:
    """A run's artifact folder in a SQLite store that was moved or copied from elsewhere (another folder, another
    machine): its URIs still name the old absolute ``.../mlartifacts/<experiment>/<run>/artifacts``. When that folder
    is missing, the same relative path beside the database here (:func:`artifact_location`'s layout), whether or not
    it exists yet; None when the recorded folder exists, for other stores and for URIs outside an ``mlartifacts``
    tree (MLflow then reads and writes where the URI says)."""
    from urllib.parse import unquote, urlparse

    here = _sqlite_artifact_root(tracking)
    if here is None or not artifact_uri.startswith("file://"):
        return None
    recorded = Path(unquote(urlparse(artifact_uri).path))
    parts = recorded.parts
    if recorded.exists() or "mlartifacts" not in parts:
        return None
    i = len(parts) - 1 - parts[::-1].index("mlartifacts")
    return here.joinpath(*parts[i + 1:]) if Path(*parts[:i + 1]) != here else None


def ensure_experiment(tracking: str, name: str, client: Any = None) -> str:
    """The id of MLflow experiment ``name`` at ``tracking``, created when missing (model-training kind,
    artifacts per :func:`artifact_location`), restored when deleted, and given the model-training kind
    when it has none (an experiment made before gearlab set it). A kind someone chose is left alone."""
    import mlflow
    from mlflow.exceptions import MlflowException

    client = client or mlflow.MlflowClient(tracking)
    exp = client.get_experiment_by_name(name)
    if exp is None:
        try:
            return client.create_experiment(name, artifact_location=artifact_location(tracking, name),
                                            tags={EXPERIMENT_KIND_TAG: MODEL_TRAINING_KIND})
        except MlflowException:
            exp = client.get_experiment_by_name(name)  # another process created it meanwhile
            if exp is None:
                raise
    if exp.lifecycle_stage == "deleted":
        client.restore_experiment(exp.experiment_id)
    if not exp.tags.get(EXPERIMENT_KIND_TAG):
        client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND)
    return exp.experiment_id


def record_versions(client: Any, run_id: str, versions: Mapping[str, str] | None = None) -> dict[str, str]:
    """Set the ``versions.<name>`` tags (:func:`gearlab.trainer.provenance.package_versions`) on a run. On a run that
    already has them (a resumed run) a changed version is kept as history: ``5.17.0 -> 5.24.0``.
    Returns the tags written."""
    from mlflow.entities import RunTag

    have = client.get_run(run_id).data.tags
    new = {}
    for k, v in version_tags(dict(versions) if versions is not None else None).items():
        old = have.get(k)
        value = v if not old else (old if old.split(" -> ")[-1] == v else f"{old} -> {v}")
        if value != old:
            new[k] = value[-5000:]
    if new:
        client.log_batch(run_id, tags=[RunTag(k, v) for k, v in new.items()])
    return new


class GearlabMLFlowLogger(MLFlowLogger):
    """MLFlowLogger whose metric keys are made MLflow-safe without losing meaning (a key with "@" would become
    ``_at_``; gearlab's own keys are already named that way),
    that keeps one value per step in a resumed run, and that marks a run stopped by Ctrl-C KILLED, not FAILED."""

    #: metric key → the last step already on record when this run was reopened (set by ``make_logger``). A
    #: process that died between logging an iteration and checkpointing it re-runs that iteration on resume;
    #: the resume is exact, so the value on record stands and is not logged a second time.
    on_record: dict[str, int] = {}

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        m = {sanitize_metric_key(k): v for k, v in metrics.items()}
        if step is not None and self.on_record:
            m = {k: v for k, v in m.items() if step > self.on_record.get(k, -1)}
        if m:
            super().log_metrics(m, step=step)

    def finalize(self, status: str = "success") -> None:
        # Lightning reports an interrupted fit (a second Ctrl-C, past gearlab's graceful stop) as "failed"
        if status == "failed" and isinstance(sys.exc_info()[1], KeyboardInterrupt):
            status = "KILLED"
        super().finalize(status)

    def log_hyperparams(self, params: Any) -> None:
        # params are logged once, flattened, by make_logger; Lightning's own dump would duplicate them
        return None


def make_logger(cfg: Config, run_dir: Path, *, model_name: str) -> GearlabMLFlowLogger | None:
    """Create (or, when ``run_dir/mlflow_run_id`` exists, reopen) the MLflow run of this training run.
    None on every process but global rank 0."""
    id_file = run_dir / "mlflow_run_id"
    run_id = id_file.read_text().strip() if id_file.is_file() else None
    tags = {"assigner": cfg.assigner.name, "assigner_base": cfg.assigner.base or cfg.assigner.name,
            "seed": str(cfg.trainer.seed), "task": cfg.task.name,
            "model": model_name, "git_sha": git_sha(), **dict(cfg.logging.tags)}
    if os.environ.get("CUDA_VISIBLE_DEVICES"):  # which card a comparison's worker ran this child on
        tags["cuda_visible_devices"] = os.environ["CUDA_VISIBLE_DEVICES"]
    if run_id is None:
        tags.update(version_tags())
    if cfg.logging.parent_run_id:
        tags["mlflow.parentRunId"] = cfg.logging.parent_run_id
    from lightning.pytorch.utilities import rank_zero_only

    if rank_zero_only.rank != 0:
        # launched by torchrun / srun, every rank runs this: only global rank 0 opens the store (two
        # processes creating one SQLite schema at once collide) and logs
        return None
    uri = tracking_uri(cfg)
    if run_id is None:  # created here, not by Lightning: with its kind and artifact location
        ensure_experiment(uri, cfg.logging.experiment)
    logger = GearlabMLFlowLogger(experiment_name=cfg.logging.experiment, run_name=run_dir.name,
                                 tracking_uri=uri, tags=tags, run_id=run_id,
                                 artifact_location=artifact_location(uri, cfg.logging.experiment))
    # Lightning calls mlflow.set_tracking_uri, which also exports MLFLOW_TRACKING_URI: undo that so a
    # later run in this process (a comparison, a test) does not inherit this run's store.
    env_before = os.environ.get("MLFLOW_TRACKING_URI")
    client, rid = logger.experiment, logger.run_id
    if env_before is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = env_before
    if run_id is None:
        run_dir.mkdir(parents=True, exist_ok=True)
        id_file.write_text(rid)
        params = {k: ("" if v is None else str(v))[:6000] for k, v in flatten(cfg).items()}
        alg = cfg.algorithm  # the advantage normalisation in use, in words, beside the keys that set it
        params["credit.normalisation"] = normalisation_scope(alg.scale_by_std, alg.std_scope, alg.leave_one_out)
        from mlflow.entities import Param

        items = list(params.items())
        for s in range(0, len(items), 100):
            client.log_batch(rid, params=[Param(k, v) for k, v in items[s : s + 100]])
        client.log_text(rid, to_yaml(cfg), "config.yaml")
    else:
        client.update_run(rid, status="RUNNING")
        client.set_tag(rid, "resumed", "true")
        record_versions(client, rid)  # the software this part of the run was made with
        logger.on_record = _steps_on_record(client, rid)
        exp = client.get_experiment(client.get_run(rid).info.experiment_id)
        if not exp.tags.get(EXPERIMENT_KIND_TAG):  # an experiment made before gearlab set its kind
            client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND)
    return logger


def _steps_on_record(client: Any, run_id: str) -> dict[str, int]:
    """Metric key → highest step logged so far in ``run_id`` (one history query per key, on resume only)."""
    keys = client.get_run(run_id).data.metrics.keys()
    return {k: max((m.step for m in client.get_metric_history(run_id, k)), default=-1) for k in keys}
