"""gearlab: GRPO post-training with pluggable credit assignment."""
__version__ = "0.1.0"
