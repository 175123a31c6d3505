"""The verbs of the ``gearlab`` command besides ``train``: ``compare`` and ``report`` (paired comparisons in
MLflow), ``replay`` and ``inspect`` (credit of several assigners on one batch), ``evaluate`` and ``export``;
``assigners``, ``check-assigner`` and ``new-assigner`` (credit methods).
The top of the import graph: nothing in gearlab imports it."""
