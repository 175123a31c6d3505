"""gearlab: GRPO post-training with pluggable credit assignment."""
from gearlab.cpu_kernels import pin as _pin_cpu_kernels

# before anything computes on the CPU: one instruction set on every x86-64 machine (gearlab/cpu_kernels.py)
_pin_cpu_kernels()

__version__ = "0.1.0"
