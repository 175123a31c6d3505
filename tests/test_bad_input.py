"""Bad input to the real command line: each case ends with exit code 2 and ONE line on stderr naming the file and
line (or the key, or the URI), before any work: nothing is written under ``trainer.output_dir``.

Cases: a prompt far over the model's context (a 10 MB line, refused from its bytes in little time and memory) or
just over it (tokens counted after the chat template), ``task.max_prompt_tokens``, a YAML syntax error, an
unwritable output folder, a missing data file, a non-UTF-8 byte, a line that is not JSON, and an MLflow tracking
server that is down or never answers.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from gearlab.config import ConfigError, conf_dir, load_config
from gearlab.trainer.tracking import check_tracking_uri

# the tiny model's context is 512 tokens; rollout.max_new_tokens defaults to 48
LIMIT_MSG = "over the limit of 464 tokens (the model's context 512 minus rollout.max_new_tokens 48)"


def _cli(
    cwd: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 180
) -> tuple[int, list[str], float, int]:
    """Run ``python -m gearlab.cli ARGS``: (exit code, the non-empty lines of stderr, seconds, peak memory in MB)."""
    err = cwd / "stderr.txt"
    start = time.monotonic()
    with err.open("w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "gearlab.cli", *args], cwd=cwd, stdout=subprocess.DEVNULL,
                                stderr=fh, env={**os.environ, **(env or {})})
        killer = threading.Timer(timeout, proc.kill)
        killer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak memory, not the session's largest
        finally:
            killer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
    elapsed = time.monotonic() - start
    assert elapsed < timeout, f"killed after {timeout} s"
    lines = [ln for ln in err.read_text().splitlines() if ln.strip()]
    return proc.returncode, lines, elapsed, usage.ru_maxrss // 1024


def _train(
    tmp_path: Path, model_dir: Path, *extra: str, env: dict[str, str] | None = None
) -> tuple[int, list[str], float, int]:
    return _cli(tmp_path, "train", f"model.name_or_path={model_dir}", f"trainer.output_dir={tmp_path / 'out'}",
                "trainer.max_steps=2", "rollout.prompts_per_step=2", "rollout.group_size=2",
                "algorithm.micro_batch_size=4", "eval.num_problems=0", "trainer.progress_bar=false", *extra, env=env)


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _one_line_exit_2(rc: int, lines: list[str], *needles: str) -> str:
    assert rc == 2, lines
    assert len(lines) == 1, lines
    assert lines[0].startswith("gearlab: error: "), lines
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


# -- prompt lengths ---------------------------------------------------------------------------------------------------

def test_a_10_mb_prompt_line_is_refused_from_its_bytes(tmp_path, tiny_model_dir):
    data = tmp_path / "train.jsonl"
    with data.open("w") as fh:
        fh.write(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n\n")
        fh.write(json.dumps({"prompt": "9 + 9 = 18. " * 850_000, "answer": "18"}) + "\n")  # 10.2 MB on line 3
    rc, lines, seconds, peak_mb = _train(tmp_path, tiny_model_dir, "task=jsonl", f"task.options.train_path={data}")
    line = _one_line_exit_2(rc, lines, f"{data}:3: prompt is 10,200,000 bytes, so at least ", LIMIT_MSG)
    assert "tokens after the chat template" not in line  # refused before tokenising
    # unchecked, it grew to 24 GB and was killed by the kernel; now the CLI's own start-up dominates (its imports
    # alone take about 0.7 GB; 2.1 GB peak was measured on CI's machine)
    assert seconds < 60 and peak_mb < 4_000, (seconds, peak_mb)
    assert not (tmp_path / "out").exists()


def test_a_prompt_over_the_context_names_file_row_and_lengths(tmp_path, tiny_model_dir):
    data = _jsonl(tmp_path / "train.jsonl", [{"prompt": "1+1?", "answer": "2"}, {"prompt": "2+2?", "answer": "4"},
                                              {"prompt": "1 + 2 = 3. " * 500, "answer": "3"},
                                              {"prompt": "4 + 4 = 8. " * 500, "answer": "8"}])
    rc, lines, _, _ = _train(tmp_path, tiny_model_dir, "task=jsonl", f"task.options.train_path={data}")
    line = _one_line_exit_2(rc, lines, f"{data}:3: prompt is ", " tokens after the chat template, ", LIMIT_MSG,
                            "1 more row(s) are over it too")
    n = int(line.split("prompt is ")[1].split(" tokens")[0].replace(",", ""))
    assert 5_000 <= n <= 5_100  # 10 tokens a repeat ("1", " +", " ", "2", ...) and the template's few
    assert not (tmp_path / "out").exists()


def test_task_max_prompt_tokens_caps_below_the_context(tmp_path, tiny_model_dir):
    data = _jsonl(tmp_path / "train.jsonl", [{"prompt": "1+1?", "answer": "2"},
                                              {"prompt": "What is 12 + 30 + 7 + 1?", "answer": "50"}])
    rc, lines, _, _ = _train(tmp_path, tiny_model_dir, "task=jsonl", f"task.options.train_path={data}",
                             "task.max_prompt_tokens=12")
    _one_line_exit_2(rc, lines, f"{data}:2: prompt is ", "over the limit of 12 tokens (task.max_prompt_tokens)")
    assert not (tmp_path / "out").exists()


def test_a_negative_max_prompt_tokens_is_a_config_error():
    with pytest.raises(ConfigError, match="key 'task.max_prompt_tokens': must be >= 0"):
        load_config(["task.max_prompt_tokens=-1"])


def test_fsdp1_with_a_signal_that_runs_the_model_is_refused_before_any_work(tmp_path, tiny_model_dir):
    """OAR's saliency passes differ in number between ranks; FSDP1 gathers at every forward, so ranks would wait on
    each other: refused in one line naming the key (FSDP2 gathers once for them, tests/parallel/test_world_size.py)."""
    rc, lines, _, _ = _train(tmp_path, tiny_model_dir, "assigner=oar_g", "trainer.strategy=fsdp1", "trainer.devices=2",
                             "trainer.accelerator=cpu")
    _one_line_exit_2(rc, lines, "key 'trainer.strategy': fsdp1 gathers the weights at every forward",
                     "(input_grad_saliency)", "use fsdp2")


# -- configuration files and folders ----------------------------------------------------------------------------------

def test_yaml_syntax_error_names_file_and_line(tmp_path, tiny_model_dir):
    conf = tmp_path / "conf"
    shutil.copytree(conf_dir(), conf)
    broken = conf / "experiment" / "broken.yaml"
    broken.write_text("trainer:\n  max_steps: 3\nrollout:\n  group_size: [4\n")
    rc, lines, _, _ = _train(tmp_path, tiny_model_dir, "experiment=broken", env={"GEARLAB_CONF_DIR": str(conf)})
    _one_line_exit_2(rc, lines, f"{broken}:5: YAML syntax error: did not find expected ',' or ']'",
                     "flow sequence that starts at line 4")


def test_malformed_override_value_is_one_line(tmp_path, tiny_model_dir):
    rc, lines, _, _ = _train(tmp_path, tiny_model_dir, "rollout.group_size=[4")
    _one_line_exit_2(rc, lines, "override 'rollout.group_size=[4': the value is not valid YAML")


def test_output_dir_that_cannot_be_created(tmp_path, tiny_model_dir):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    rc, lines, _, _ = _train(tmp_path, tiny_model_dir, f"trainer.output_dir={blocker / 'runs'}")
    _one_line_exit_2(rc, lines, "key 'trainer.output_dir': cannot create ", f"{blocker} is not a directory")
    assert blocker.read_text() == "not a folder"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through directory permissions")
def test_output_dir_without_write_permission(tmp_path, tiny_model_dir):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        rc, lines, _, _ = _train(tmp_path, tiny_model_dir, f"trainer.output_dir={locked / 'runs'}")
    finally:
        locked.chmod(0o700)
    _one_line_exit_2(rc, lines, "key 'trainer.output_dir': ", "is not writable", "Permission denied")
    assert not any(locked.iterdir())


@pytest.mark.parametrize("bad,says", [("rollout.group_size=[4", "override 'rollout.group_size=[4'"),
                                      ("assigner.options.q_on=1.5", "key 'assigner.options.q_on': must be <= 1.0"),
                                      ("task.options.path=missing.jsonl", "data file not found: missing.jsonl")])
def test_bad_input_is_refused_before_lightning_is_imported(tmp_path, tiny_model_dir, bad, says):
    """A typo costs the config's load and the cheap checks (~2 s), not Lightning's import (~5 s more on 2 cores): the
    command line checks overrides, assigner options and data files first."""
    probe = ("import sys; from gearlab.cli import main; rc = main(sys.argv[1:]); "
             "print('imported lightning:', 'lightning' in sys.modules); sys.exit(rc)")
    extra = {"assigner.options.q_on=1.5": ["assigner=gear"], "task.options.path=missing.jsonl": ["task=fncall"]}
    proc = subprocess.run([sys.executable, "-c", probe, "train", f"model.name_or_path={tiny_model_dir}",
                           f"trainer.output_dir={tmp_path / 'out'}", *extra.get(bad, []), bad],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    _one_line_exit_2(proc.returncode, [ln for ln in proc.stderr.splitlines() if ln.strip()], says)
    assert proc.stdout.strip() == "imported lightning: False"


# -- data files
# ---------------------------------------------------------------------------------------------------------

def test_missing_fncall_data_file(tmp_path, tiny_model_dir):
    rc, lines, _, _ = _train(tmp_path, tiny_model_dir, "task=fncall", "task.options.path=missing.jsonl")
    _one_line_exit_2(rc, lines, "key 'task': function-calling data file not found: missing.jsonl")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("task,option", [("jsonl", "train_path"), ("fncall", "path")])
def test_non_utf8_byte_names_file_line_and_column(tmp_path, tiny_model_dir, task, option):
    good = {"jsonl": {"prompt": "1+1?", "answer": "2"},
            "fncall": {"query": "Weather in Paris?", "tools": [], "answers": [{"name": "w", "arguments": {}}]}}[task]
    data = tmp_path / "data.jsonl"
    data.write_bytes((json.dumps(good) + "\n").encode() * 2 + b'{"prompt": "caf\xe9"}\n')  # Latin-1 "é" on line 3
    rc, lines, _, _ = _train(tmp_path, tiny_model_dir, f"task={task}", f"task.options.{option}={data}")
    _one_line_exit_2(rc, lines, f"{data}:3: not valid UTF-8 (byte 0xe9 at column 16)")
    assert not (tmp_path / "out").exists()


def test_invalid_json_line_names_file_and_line(tmp_path, tiny_model_dir):
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1?", "answer": "2"}\n{"prompt": "2+2?", "answer": 4\n')
    rc, lines, _, _ = _train(tmp_path, tiny_model_dir, "task=jsonl", f"task.options.train_path={data}")
    _one_line_exit_2(rc, lines, f"{data}:2: not valid JSON")


# -- the MLflow tracking server
# -----------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def silent_server():
    """An address that accepts connections and never answers (a hung server): the probe must time out."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    yield f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()


# the CLI's own start-up (importing torch and Lightning) takes 5-10 s on a loaded 2-core machine; the probe adds 2 s
CLI_SECONDS = 25


def test_train_with_a_dead_tracking_server_stops_at_once(tmp_path, tiny_model_dir):
    uri = f"http://127.0.0.1:{_free_port()}"
    rc, lines, seconds, _ = _train(tmp_path, tiny_model_dir, env={"MLFLOW_TRACKING_URI": uri})
    _one_line_exit_2(rc, lines, f"$MLFLOW_TRACKING_URI: the MLflow tracking server {uri} is not reachable",
                     "Connection refused")
    assert seconds < CLI_SECONDS  # before: 259 s of retries
    assert not (tmp_path / "out").exists()


def test_compare_with_a_hung_tracking_server_stops_at_once(tmp_path, tiny_model_dir, silent_server):
    rc, lines, seconds, _ = _cli(tmp_path, "compare", f"model.name_or_path={tiny_model_dir}",
                                 f"trainer.output_dir={tmp_path / 'out'}", "seeds=[0]",
                                 f"logging.tracking_uri={silent_server.replace('//', '//user:s3cret@')}")
    line = _one_line_exit_2(rc, lines, f"key 'logging.tracking_uri': the MLflow tracking server {silent_server} is "
                                       "not reachable (timed out)")
    assert "s3cret" not in line  # credentials are not printed
    assert seconds < CLI_SECONDS
    assert not (tmp_path / "out").exists()


def test_probe_times_out_in_about_two_seconds(silent_server):
    cfg = load_config([f"logging.tracking_uri={silent_server}"])
    start = time.monotonic()
    with pytest.raises(ConfigError, match="not reachable"):
        check_tracking_uri(cfg)
    assert time.monotonic() - start < 3.0


def test_probe_accepts_any_http_answer_and_skips_local_stores(tmp_path):
    class NotFound(BaseHTTPRequestHandler):
        def do_GET(self):  # a server without /health (behind a proxy, an older version) is still a server
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    srv = HTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        check_tracking_uri(load_config([f"logging.tracking_uri=http://127.0.0.1:{srv.server_port}"]))
    finally:
        srv.shutdown()
        srv.server_close()
    check_tracking_uri(load_config([f"logging.tracking_uri=sqlite:///{tmp_path / 'x.db'}"]))  # not probed
    assert not (tmp_path / "x.db").exists()
