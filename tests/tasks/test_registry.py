"""Adding a task from outside the repository: a `.py` file given as `task.plugins`, or a package announcing it
in the `gearlab.tasks` entry-point group. Nothing in gearlab is edited."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import mlflow
import pytest

from gearlab.tasks.registry import available_tasks, get_task

TASK_SRC = textwrap.dedent('''
    """A task written outside gearlab: repeat a two-digit number."""
    import random
    from gearlab.tasks import Problem, Task, register_task

    @register_task("{name}")
    class RepeatNumber(Task):
        def problems(self, split, n, seed=0):
            rng = random.Random(f"{{split}}/{{seed}}")
            out = []
            for _ in range(n):
                x = rng.randint(10, 99)
                out.append(Problem(f"Repeat {{x}}.", str(x), f"Answer: {{x}}"))
            return out

        def extract_answer(self, completion):
            return completion.rsplit("Answer:", 1)[-1].strip() or None
''')


def test_builtin_tasks_are_found_without_a_list():
    assert {"arith", "arith_hard", "jsonl", "tool_arith", "fncall", "gsm8k", "math500"} <= set(available_tasks())


def test_every_task_yaml_selects_a_registered_task():
    from gearlab.config import conf_dir, load_config

    stems = sorted(p.stem for p in (conf_dir() / "task").glob("*.yaml"))
    # the maths tasks docs/configuration.md names as task=NAME
    assert {"gsm8k", "math", "math500", "aime"} <= set(stems)
    assert [s for s in stems if load_config([f"task={s}"]).task.name not in available_tasks()] == []


def test_task_from_a_file_trains(tmp_path, tiny_model_dir):
    plugin = tmp_path / "repeat_task.py"
    plugin.write_text(TASK_SRC.format(name="repeat_number"))
    out = subprocess.run([sys.executable, "-m", "gearlab.cli", "train", "task.name=repeat_number",
                          f"task.plugins=[{plugin}]", f"model.name_or_path={tiny_model_dir}",
                          f"trainer.output_dir={tmp_path / 'runs'}", "trainer.max_steps=2",
                          "rollout.prompts_per_step=2",
                          "rollout.group_size=2", "rollout.max_new_tokens=6", "eval.num_problems=4",
                          "trainer.progress_bar=false"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("gearlab").experiment_id])
    assert run.data.tags["task"] == "repeat_number" and "train/reward" in run.data.metrics


def test_missing_task_plugin_is_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "gearlab.cli", "train", f"task.plugins=[{tmp_path / 'nope.py'}]",
                          f"trainer.output_dir={tmp_path}"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "task.plugins" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_task_from_an_entry_point(tmp_path):
    from tests.plugin_site import entry_point_site

    site = entry_point_site(tmp_path, "acme_tasks", "gearlab.tasks", TASK_SRC.format(name="acme_repeat"))
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from gearlab.tasks import get_task; "
            "t = get_task('acme_repeat'); print(type(t).__module__, t.problems('train', 1)[0].prompt)")
    out = subprocess.run([sys.executable, "-c", code, str(site)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("acme_tasks Repeat ")


def test_a_name_taken_by_another_class_is_an_error():
    from gearlab.tasks import Task, register_task

    get_task("arith")
    with pytest.raises(ValueError, match="already registered"):
        @register_task("arith")
        class Other(Task):  # noqa: F811
            def problems(self, split, n, seed=0):
                return []

            def extract_answer(self, completion):
                return None
