"""Stable import path of the rollout record, which lives in ``gearlab.core.batch``."""
from gearlab.core.batch import RolloutBatch  # noqa: F401
