"""Tasks: problems with ground truth and a verifier reward (``Task``, ``Problem``), and their registry
(``register_task``, ``get_task``, ``available_tasks``; entry-point group ``gearlab.tasks``)."""
from gearlab.tasks.base import Problem, Task
from gearlab.tasks.registry import available_tasks, get_task, register_task

__all__ = ["Problem", "Task", "available_tasks", "get_task", "register_task"]
