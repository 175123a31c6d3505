"""Stable import path of the GRPO maths, which live in ``gearlab.core.grpo``."""
from gearlab.core.grpo import (AGG_MODES, KL_KINDS, aggregate, engine_mismatch, group_advantages,  # noqa: F401
                               kl_penalty, policy_loss, zero_std_fraction)
