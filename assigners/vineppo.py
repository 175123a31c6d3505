"""VinePPO: each step's credit is the change in Monte-Carlo value it causes.

Method: Kazemnejad et al., "VinePPO: Refining Credit Assignment in RL Training of LLMs" (arXiv 2410.01679),
docs/credit/vineppo.md.

    V_j = mean_c r(x, y_≤e_j ⊕ z_c),  z_c ~ π_old(· | x, y_≤e_j),  c = 1..K      [SRC: MC value of a prefix]
    A_t = V_j − V_{j−1}  for every generated token t of step j                      [SRC: step advantage]
    V_0 = the prompt's value (K continuations from the prompt alone); V_S = r(x, y) [SRC]

The values come from the ``mc_step_advantage`` signal (gearlab.signals.mc), which continues each response from the
end of each of its steps (``Task.step_ends``: lines by default; multi-turn: turns, the episode replayed in a fresh
environment up to there, gearlab.rollout.replay) through the run's rollout engine. No group baseline:
a group whose rewards are all equal still gets step credit (``keeps_zero_groups = False``).

Provenance of choices:
  * K = 8 continuations per step end, at most 8 steps per response (later steps merge into the last): [PROPOSED]
    budget defaults, options; the paper's K per task was not checked here.
  * Steps = lines ([INF]: the paper splits reasoning at newlines into steps).
  * Raw advantages, not normalised: [PROPOSED].
  * Continuations sample with the rollout's temperature / top-p / top-k, budget = what the response had left [INF].
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from gearlab.core.batch import RolloutBatch
from gearlab.credit import CreditAssigner, CreditOutput, Signal, register
from gearlab.credit.options import option

MC = "mc_step_advantage"


@dataclass
class VinePPOOptions:
    k: int = option(8, "Monte-Carlo continuations per step end (K) [PROPOSED]", lo=2)
    max_steps: int = option(8, "steps per response at most; later steps merge into the last [PROPOSED]", lo=1)


@register("vineppo")
class VinePPOAssigner(CreditAssigner):
    needs = frozenset({MC})
    keeps_zero_groups = False  # MC step values credit steps even where the group's rewards are all equal
    extra_rollouts = True  # K continuations per step end

    Options = VinePPOOptions

    def signal_options(self) -> dict[str, Any]:
        return {"mc_k": self.k, "mc_max_steps": self.max_steps}

    def setup(self, *, seed: int, total_steps: int, task: Any) -> None:
        if getattr(task, "multi_turn", False) and not getattr(task, "replayable", True):
            raise ValueError(f"vineppo replays multi-turn episodes up to each turn, and task {task.name!r} says its "
                             "environment cannot be replayed (Task.replayable = False)")

    def chunk_local(self, rows: int) -> bool:
        return True  # A_t depends on row t's own signal only

    def assign(self, batch: RolloutBatch, seq_advantages: Tensor, signals: dict[Signal, Tensor]) -> CreditOutput:
        mask = batch.response_mask
        adv = signals[MC].to(mask.device).float().detach() * mask.float()  # [B, T]
        n = int(mask.sum())
        metrics = {
            "vineppo/adv_abs_mean": float(adv[mask].abs().mean()) if n else 0.0,
            "vineppo/frac_nonzero": float((adv[mask] != 0).float().mean()) if n else 0.0,
        }
        return CreditOutput(token_advantages=adv, metrics=metrics)
