"""Testing kit for MLA prefill backend authors: a conformance suite against a float64 reference.

In your own tests::

    from mla_prefill_ext.testing import assert_conformant

    def test_my_backend_is_conformant():
        assert_conformant(MyPrefillBackend, device="cuda")

:func:`run_conformance` returns a :class:`ConformanceReport` (``ok``, ``failures``,
``failed_properties``, ``to_dict()``, ``format()``) instead of raising. The properties
checked are listed in :data:`PROPERTIES`; the tolerances per dtype in :data:`TOLERANCES`.
This package is a test helper: the runtime path never imports it.
"""

from mla_prefill_ext.testing.conformance import (
    DEFAULT_DIMS,
    DEFAULT_DTYPES,
    DEFAULT_NUM_HEADS,
    PROPERTIES,
    TOLERANCES,
    CheckResult,
    ConformanceCase,
    ConformanceReport,
    Tolerance,
    assert_conformant,
    run_conformance,
)

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
