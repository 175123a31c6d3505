"""`gearlab inspect` runs every applicable assigner on one batch and writes JSON / HTML / PNG."""
import json

from gearlab import credit
from gearlab.config import load_config
from gearlab.commands.credit_pictures import display_order
from gearlab.commands.inspect import inspect


def test_inspect_writes_the_three_files(tmp_path, tiny_model_dir):
    cfg = load_config([f"model.name_or_path={tiny_model_dir}", f"trainer.output_dir={tmp_path}",
                       f"inspect.out_dir={tmp_path / 'insp'}", "inspect.prompts=2", "rollout.group_size=2",
                       "rollout.max_new_tokens=10"])
    out = inspect(cfg)
    rec = json.loads((tmp_path / "insp" / "credit.json").read_text())
    # every single-turn method but those that sample extra rollouts (vineppo: only when named)
    single_turn = [n for n in credit.available()
                   if not credit.get(n).requires_turns and not credit.get(n).extra_rollouts]
    assert rec["assigners"] == single_turn and "vineppo" not in single_turn and len(rec["samples"]) == 4
    s = rec["samples"][0]
    assert {"tokens", "response_mask", "turn_ids", "reward", "seq_advantage", "credit", "signals", "segments"} <= set(s)
    assert set(s["credit"]) == set(single_turn)
    assert all(len(v) == len(s["tokens"]) for v in s["credit"].values())
    if "gear" in single_turn:
        assert "kl" in s["signals"] and "gear" in s["segments"]
    html = (tmp_path / "insp" / "credit.html").read_text()
    assert html.startswith("<html>") and "grpo" in html
    assert (tmp_path / "insp" / "credit.png").read_bytes()[:4] == b"\x89PNG"
    assert out["png"].endswith("credit.png")
    assert rec["order"] == display_order(rec["samples"]) and sorted(rec["order"]) == list(range(4))
    assert all(s["informative"] == (s["seq_advantage"] != 0) for s in rec["samples"])


def test_the_inspect_line_after_a_tool_task_run_is_a_command_that_works(tmp_path, tiny_model_dir):
    """The closing line of `gearlab train` on the tool task names task=tool_arith and the sampling keys the run
    changed; pasted back (shell-split), it inspects that task: multi-turn episodes and the turn methods."""
    import shlex
    import shutil

    from gearlab.cli import main
    from gearlab.commands.closing import train_summary
    from gearlab.trainer.train import TrainResult

    cfg = load_config(["task=tool_arith", f"trainer.output_dir={tmp_path}", "rollout.group_size=2",
                       "rollout.max_new_tokens=32", "rollout.max_turns=2", "trainer.max_steps=2", "optim.lr=1e-3"])
    rdir = tmp_path / "tool_arith-grpo-s0"
    shutil.copytree(tiny_model_dir, rdir / "final")  # the trained model's place
    res = TrainResult(rdir, "", "", {}, iterations_done=2, max_steps=2)
    line = train_summary(res, ["train"], cfg).splitlines()[-1]
    assert line == (f"see its credit on one batch: gearlab inspect task=tool_arith model.name_or_path={rdir / 'final'} "
                    f"rollout.group_size=2 rollout.max_new_tokens=32 rollout.max_turns=2")
    words = shlex.split(line.split(": ", 1)[1])
    assert words[:2] == ["gearlab", "inspect"]
    assert main([*words[1:], f"inspect.out_dir={tmp_path / 'insp'}", "inspect.prompts=1",
                 "inspect.assigners=[grpo,mt_grpo]"]) == 0
    rec = json.loads((tmp_path / "insp" / "credit.json").read_text())
    assert rec["task"] == "tool_arith" and rec["assigners"] == ["grpo", "mt_grpo"] and len(rec["samples"]) == 2
    assert all("turn_rewards" in s for s in rec["samples"])  # multi-turn episodes, not the default arith task


def test_inspect_line_quotes_what_the_shell_would_split_and_names_a_task_without_yaml(tmp_path):
    from gearlab.commands.inspect import inspect_command

    cfg = load_config(["task=jsonl", "task.options.train_path=my data/train.jsonl", "task.options.test_path='true'",
                       "model.dtype=float32"])
    line = inspect_command(cfg, "runs/x/final")
    assert line == ("gearlab inspect task=jsonl model.name_or_path=runs/x/final 'task.options.test_path=\"true\"' "
                    "'task.options.train_path=my data/train.jsonl' model.dtype=float32")
    back = load_config(shlex_words(line)[2:])  # a file named "true" stays a string, the space stays in the path
    assert dict(back.task.options) == {"train_path": "my data/train.jsonl", "test_path": "true"}
    # a task registered by a plug-in, with no conf/task/NAME.yaml: task=NAME would not load, task.name=NAME does
    cfg = load_config(["task.name=my_plugin_task", "task.plugins=[my_tasks.py]", "task.options.level=3"])
    line = inspect_command(cfg, "m")
    assert line == ("gearlab inspect task.name=my_plugin_task model.name_or_path=m task.options.level=3 "
                    "'task.plugins=[my_tasks.py]'")
    back = load_config(shlex_words(line)[2:])
    assert (back.task.name, dict(back.task.options), list(back.task.plugins)) == ("my_plugin_task", {"level": 3},
                                                                                  ["my_tasks.py"])


def shlex_words(line: str) -> list[str]:
    import shlex

    return shlex.split(line)


def test_shared_scale_is_a_config_key():
    assert load_config([]).inspect.shared_scale is False
    assert load_config(["inspect.shared_scale=true"]).inspect.shared_scale is True


def test_two_labels_of_one_method_get_their_own_signals(tmp_path, tiny_model_dir, monkeypatch):
    """A signal computed with another method label's options is another signal: shear with one span per response
    and with 4-token spans must not share the cached span distances (they once did)."""
    import hashlib

    from gearlab.tasks.arithmetic import ArithmeticTask

    # a random tiny model is never right: reward a hash of the text, so that groups have both outcomes
    monkeypatch.setattr(ArithmeticTask, "reward", lambda self, p, c: float(hashlib.sha256(c.encode()).digest()[0] % 2))
    cfg = load_config([f"model.name_or_path={tiny_model_dir}", f"trainer.output_dir={tmp_path}",
                       f"inspect.out_dir={tmp_path / 'insp'}", "inspect.prompts=2", "rollout.group_size=4",
                       "rollout.max_new_tokens=12", "inspect.assigners=[shear,'shear:span_len=4,stride=2']"])
    inspect(cfg)
    rec = json.loads((tmp_path / "insp" / "credit.json").read_text())
    a, b = "shear", "shear:span_len=4,stride=2"
    assert rec["assigners"] == [a, b]
    assert any(s["credit"][a] != s["credit"][b] for s in rec["samples"] if s["seq_advantage"] != 0)
