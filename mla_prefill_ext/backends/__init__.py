"""MLA prefill backends: the abstract base and one module per backend.

Backend modules are imported lazily, by class path, through the registry.
"""

from mla_prefill_ext.backends.base import R1_MLA_DIMS, MLAPrefillBackend

__all__ = ["R1_MLA_DIMS", "MLAPrefillBackend"]
