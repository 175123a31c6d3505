"""Evaluation metrics shared by training and ``gearlab eval``."""
from __future__ import annotations

import torch
from torch import Tensor


def pass_at_k(num_correct: Tensor, n: int, k: int) -> Tensor:
    """Unbiased pass@k per problem (Chen et al. 2021): 1 − C(n−c, k) / C(n, k).

    num_correct [P] (c correct out of n samples each) → [P] float. Requires k ≤ n.
    """
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    c = num_correct.double()
    # product form avoids huge binomials: C(n−c,k)/C(n,k) = Π_{i=n−c+1}^{n} (1 − k/i)
    i = torch.arange(1, n + 1, dtype=torch.float64, device=c.device)
    terms = torch.where(i[None, :] > (n - c)[:, None], 1 - k / i[None, :], torch.ones_like(i)[None, :])
    fail = terms.prod(-1)
    fail = torch.where(n - c < k, torch.zeros_like(fail), fail)
    return (1 - fail).float()


def sanitize_metric_key(key: str) -> str:
    """MLflow-safe metric name: ``pass@4`` → ``pass_at_4``; ``(`` ``)`` and other symbols → ``_``.

    MLflow rejects "@" in metric names, so gearlab names its metrics the safe way from the start
    (``eval/avg_at_4``); this keeps a name typed with "@" (``compare.metric=eval/avg@4``) pointing at the stored
    metric, and keeps any other key loggable."""
    import re

    key = key.replace("@", "_at_")
    return re.sub(r"[^A-Za-z0-9_\-./ ]", "_", key)
