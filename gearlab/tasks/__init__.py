"""Tasks: problems with ground truth and a verifier reward."""
from gearlab.tasks import arithmetic, jsonl  # noqa: F401  (registers the built-in tasks)
