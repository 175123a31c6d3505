"""The verbs of the ``gearlab`` command besides ``train``: ``compare`` and ``report`` (paired comparisons in
MLflow), ``replay`` and ``inspect`` (credit of several assigners on one batch), ``evaluate`` and ``export``.
The top of the import graph: nothing in gearlab imports it."""
