"""Per-token signals an assigner may declare: the vocabulary and registry (``registry``), the provider that
computes exactly the declared ones, chunked and without gradient (``provider``), and the model-based signals of
OAR (``saliency``, ``spans``). Depends on ``gearlab.core``."""
