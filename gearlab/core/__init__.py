"""The GRPO core: group advantages, the clipped policy loss and its aggregation, KL estimators (``grpo``), the
rollout record (``batch``), chunked log-probs / entropy / KL from hidden states (``logprobs``) and small metrics.
Depends on torch only (plus ``gearlab.parallel`` helpers for compiled and FSDP1 forwards)."""
from gearlab.cpu_kernels import route_linear as _route_linear

# every model gearlab runs passes through the core: from here on, CPU float32 nn.Linear uses the vendor-independent
# oneDNN product (gearlab/cpu_kernels.py)
_route_linear()
