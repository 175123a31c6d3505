"""The GRPO core: group advantages, the clipped policy loss and its aggregation, KL estimators (``grpo``), the
rollout record (``batch``), chunked log-probs / entropy / KL from hidden states (``logprobs``) and small metrics.
Depends on torch only (plus ``gearlab.parallel`` helpers for compiled and FSDP1 forwards)."""
