"""Testing kit for MLA prefill backend authors: a conformance suite against a float64 reference.

In your own tests::

    from mla_prefill_ext.testing import assert_conformant

    def test_my_backend_is_conformant():
        assert_conformant(MyPrefillBackend, device="cuda")

:func:`run_conformance` returns a :class:`ConformanceReport` (``ok``, ``failures``,
``failed_properties``, ``to_dict()``, ``format()``) instead of raising. The properties
checked are listed in :data:`PROPERTIES`; the tolerances per dtype in :data:`TOLERANCES`.
This package is a test helper: the runtime path never imports it.

Layout: ``problem`` and ``reference`` (synthetic steps on vLLM's metadata, the float64
reference), ``properties`` and ``tolerances`` (what is checked, how closely), ``cases``,
``conventions/`` (how a host calls a backend: one module per calling convention),
``checks/`` (one module per property family), ``case_run`` (one case), ``report``, and
``runner`` (the entry points).
"""

from mla_prefill_ext.testing.cases import DEFAULT_DIMS, DEFAULT_DTYPES, DEFAULT_NUM_HEADS, ConformanceCase
from mla_prefill_ext.testing.properties import PROPERTIES
from mla_prefill_ext.testing.report import CheckResult, ConformanceReport
from mla_prefill_ext.testing.runner import assert_conformant, run_conformance
from mla_prefill_ext.testing.tolerances import TOLERANCES, Tolerance

__all__ = [
    "DEFAULT_DIMS",
    "DEFAULT_DTYPES",
    "DEFAULT_NUM_HEADS",
    "PROPERTIES",
    "TOLERANCES",
    "CheckResult",
    "ConformanceCase",
    "ConformanceReport",
    "Tolerance",
    "assert_conformant",
    "run_conformance",
]
