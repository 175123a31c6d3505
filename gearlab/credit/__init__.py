"""Credit assignment: the plug-in interface (``CreditAssigner``, ``CreditOutput``, ``Signal``), the registry
(``register``, ``build``, ``available``, the ``gearlab.assigners`` entry-point group), the contract kit every
assigner is checked against (``gearlab.credit.contract``) and the scaffold of ``gearlab new-assigner``.

Adding a credit method: one module with a ``@register("name")`` class in ``assigners/`` (installed as
``gearlab.assigners``) or in your own package (entry-point group ``gearlab.assigners``, or
``assigner.plugins=[file.py]``), plus ``conf/assigner/<name>.yaml``. Nothing in gearlab changes.
"""
from gearlab.credit.api import (ENTRY_POINT_GROUP, CreditAssigner, CreditOutput, available, build, get,
                                load_module, register)
from gearlab.parallel.distributed import all_reduce_sum, gather_values
from gearlab.signals.registry import Signal

# all_reduce_sum / gather_values: for a method's batch-scope statistic (a sum, a median) over the GLOBAL batch when
# the batch is split over data-parallel ranks (no-ops in one process); every rank's assign() calls them together
__all__ = ["ENTRY_POINT_GROUP", "CreditAssigner", "CreditOutput", "Signal", "all_reduce_sum", "available", "build",
           "gather_values", "get", "load_module", "register"]
