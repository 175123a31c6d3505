"""Model-based saliency signals (OAR). Registered with ``gearlab.signals.register_signal``."""
