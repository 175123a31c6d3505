"""Every `gearlab ...` command in README.md's code blocks runs, in README order, in one fresh folder.

The commands are read from the README itself, so a command added there without coverage here fails
`test_every_readme_command_is_covered` (fast). `test_readme_commands_run` (slow, ~3 minutes on 2 cores) runs each
one with overrides appended that shrink it to seconds — the same code paths, fewer iterations, problems and samples —
and checks it exits 0 and writes the file / prints the line the README says it does. The commands share the folder,
so those that read `runs/embedded/...` find what the main job wrote.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Commands that need hardware absent from the CI machines, matched against the command line: (pattern, why).
# None of the README's current commands needs one; torchrun / Slurm / vLLM lines would go here if they came back.
NOT_RUN_HERE: list[tuple[str, str]] = [
    (r"^torchrun\b|--nproc_per_node", "several GPUs"),
    (r"^sbatch\b", "a Slurm cluster"),
    (r"rollout\.engine=vllm", "vLLM on a GPU (the CPU lane runs vLLM in tests/rollout, marked vllm)"),
]

# Appended to each command, per sub-command: the same command at a size that runs in seconds on a CPU.
SHORT: dict[str, list[str]] = {
    "compare": ["compare.seeds=[0]", "trainer.max_steps=1", "eval.num_problems=8", "rollout.prompts_per_step=4",
                "rollout.group_size=4", "credit_eval.prompts=2"],
    "train": ["trainer.max_steps=1", "eval.num_problems=8", "rollout.prompts_per_step=4", "rollout.group_size=4"],
    "credit-eval": ["credit_eval.prompts=2", "rollout.group_size=4"],
    "inspect": ["inspect.prompts=2", "rollout.group_size=4"],
    "report": [],
    "new-assigner": [],
    "check-assigner": [],
    "assigners": [],
}


def _ok_compare(words: list[str], cwd: Path, out: str) -> None:
    # "it ends by printing the paired table, the credit-eval table and the learning and power lines"
    assert "| method " in out and "| assigner " in out, out[-2000:]
    assert re.search(r"^learning: ", out, re.M) and re.search(r"^power: ", out, re.M), out[-2000:]
    name = _value(words, "compare.name") or "embedded"
    assert (cwd / "runs" / name / "report" / "report.md").is_file()
    assert (cwd / "runs" / name / "grpo-s0" / "final" / "config.json").is_file()  # what the later commands read


def _ok_report(words: list[str], cwd: Path, out: str) -> None:
    name = next(w for w in words[2:] if "=" not in w)
    assert f"report: runs/{name}/report/report.md" in out and "| method " in out, out[-2000:]
    assert (cwd / "runs" / name / "report" / "curves.png").is_file()


def _ok_inspect(words: list[str], cwd: Path, out: str) -> None:
    d = cwd / (_value(words, "inspect.out_dir") or "inspect")
    assert (d / "credit.html").is_file() and (d / "credit.png").is_file()
    rec = json.loads((d / "credit.json").read_text())
    assert rec["samples"] and {"grpo", "gear"} <= set(rec["assigners"])


def _ok_credit_eval(words: list[str], cwd: Path, out: str) -> None:
    d = cwd / (_value(words, "credit_eval.out_dir") or "credit_eval")
    assert (d / "credit_eval.json").is_file() and (d / "credit_eval.md").is_file()
    assert "AUROC" in out and f"written: {d.name}/credit_eval.json" in out, out[-2000:]


def _ok_train(words: list[str], cwd: Path, out: str) -> None:
    assert "done: 1 iterations" in out, out[-2000:]
    m = re.search(r"^trained model: (\S+)", out, re.M)
    assert m and (cwd / m.group(1) / "config.json").is_file(), out[-2000:]


def _ok_new_assigner(words: list[str], cwd: Path, out: str) -> None:
    name = words[2]
    assert re.search(rf"^wrote .*\b{name}\.py$", out, re.M), out
    assert (cwd / f"{name}.py").is_file()  # outside the repository: a plug-in file in the current folder
    assert (cwd / "conf" / "assigner" / f"{name}.yaml").is_file()


def _ok_check_assigner(words: list[str], cwd: Path, out: str) -> None:
    m = re.search(rf"^{words[2]}: (\d+)/(\d+) checks passed$", out, re.M)
    assert m and m.group(1) == m.group(2), out


def _ok_assigners(words: list[str], cwd: Path, out: str) -> None:
    if len(words) > 2 and "=" not in words[2]:  # `gearlab assigners NAME`: the method and its options
        assert out.startswith(f"{words[2]}: ") and "needs:" in out, out
    else:
        assert re.search(r"^grpo\s", out, re.M), out


CHECK: dict[str, Callable[[list[str], Path, str], None]] = {
    "compare": _ok_compare, "report": _ok_report, "inspect": _ok_inspect, "credit-eval": _ok_credit_eval,
    "train": _ok_train, "new-assigner": _ok_new_assigner, "check-assigner": _ok_check_assigner,
    "assigners": _ok_assigners,
}


def _value(words: list[str], key: str) -> str | None:
    vals = [w.split("=", 1)[1] for w in words if w.startswith(key + "=")]
    return vals[-1] if vals else None


def readme_commands(text: str | None = None) -> list[str]:
    """The gearlab command lines of the README's fenced code blocks, in order: each `&&`-joined part of a line (joined
    over trailing backslashes) that starts with `gearlab` or runs `gearlab.cli`, without its trailing comment."""
    text = (ROOT / "README.md").read_text() if text is None else text
    cmds, fenced, pending = [], False, ""
    for line in text.splitlines():
        if re.match(r"^\s*(```|~~~)", line):
            fenced, pending = not fenced, ""
            continue
        if not fenced:
            continue
        line = pending + line
        if line.rstrip().endswith("\\"):
            pending = line.rstrip()[:-1] + " "
            continue
        pending = ""
        for part in line.split("&&"):
            part = part.strip()
            head = part.split()[:1]
            if head == ["gearlab"] or re.search(r"(^|\s)-m\s+gearlab\.cli\b", part):
                cmds.append(" ".join(shlex.split(part, comments=True)))
    return cmds


def _not_run_here(cmd: str) -> str | None:
    return next((why for pat, why in NOT_RUN_HERE if re.search(pat, cmd)), None)


def test_the_extractor_reads_commands_and_skips_prose():
    text = ("gearlab train outside=a_block\n```bash\npython3 -m venv .venv && pip install -e . && gearlab compare x=1\n"
            "gearlab report embedded          # a comment\ntorchrun --nproc_per_node 8 -m gearlab.cli train \\\n"
            "    a=1 b=2\n# gearlab train commented=out\n```\n```python\nx = 'gearlab train'  # not a command\n```\n")
    assert readme_commands(text) == ["gearlab compare x=1", "gearlab report embedded",
                                     "torchrun --nproc_per_node 8 -m gearlab.cli train a=1 b=2"]


def test_every_readme_command_is_covered():
    cmds = readme_commands()
    assert cmds and cmds[0] == "gearlab compare experiment=embedded", cmds  # the main job comes first
    uncovered = [c for c in cmds if not _not_run_here(c) and (c.split()[0] != "gearlab" or c.split()[1] not in CHECK)]
    assert not uncovered, f"README commands this test does not know how to run and check: {uncovered}"


def _short_warm_start() -> list[str]:
    """The main job copies the shipped warm start when its recipe is the default; without one, a short SFT stands in
    (the same code path at 20 steps) so the test stays within minutes."""
    try:
        from gearlab.config import load_config
        from gearlab.models.shipped import shipped_matches

        if shipped_matches(load_config(["experiment=embedded"]), "embedded:tiny-arith"):
            return []
    except ImportError:
        pass
    return ["warmstart.steps=20"]


@pytest.mark.slow
def test_readme_commands_run(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    plugins: list[str] = []  # names that `gearlab new-assigner` wrote here, as plug-in files
    ran = []
    for cmd in readme_commands():
        if _not_run_here(cmd):
            continue
        words = shlex.split(cmd)
        sub = words[1]
        extra = list(SHORT[sub]) + (_short_warm_start() if sub == "compare" else [])
        # outside the repository the scaffold writes NAME.py into the current folder instead of assigners/NAME.py;
        # the commands that name it then load it as a plug-in file, as docs/credit/README.md says
        mine = [n for n in plugins if n in words[2:]]
        if mine and sub != "new-assigner":
            extra.append(f"assigner.plugins=[{','.join(n + '.py' for n in mine)}]")
        proc = subprocess.run([sys.executable, "-m", "gearlab.cli", *words[1:], *extra], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"`{cmd}` exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        CHECK[sub](words, tmp_path, proc.stdout)
        if sub == "new-assigner":
            plugins.append(words[2])
        ran.append(cmd)
    assert ran and ran[0] == "gearlab compare experiment=embedded"
