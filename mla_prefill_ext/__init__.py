"""Pluggable MLA prefill attention backends for vLLM 0.20.x.

Public API (names as in later upstream vLLM)::

    from mla_prefill_ext import (
        MLAPrefillBackend, MLAPrefillBackendEnum, register_mla_prefill_backend,
        get_mla_prefill_backend, activate, deactivate,
    )

Importing the package is cheap: the API is loaded on first use, so that vLLM's
plugin loader pays only for :func:`activate`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from mla_prefill_ext.activation import activate, deactivate

__version__ = "0.1.0"

_LAZY = {
    "MLAPrefillBackend": "mla_prefill_ext.backends.base",
    "MLAPrefillBackendEnum": "mla_prefill_ext.registry",
    "register_mla_prefill_backend": "mla_prefill_ext.registry",
    "get_mla_prefill_backend": "mla_prefill_ext.selector",
    "MLAPrefillSelectorConfig": "mla_prefill_ext.selector",
}

__all__ = [
    "MLAPrefillBackend",
    "MLAPrefillBackendEnum",
    "MLAPrefillSelectorConfig",
    "activate",
    "deactivate",
    "get_mla_prefill_backend",
    "register_mla_prefill_backend",
]

if TYPE_CHECKING:
    from mla_prefill_ext.backends.base import MLAPrefillBackend
    from mla_prefill_ext.registry import MLAPrefillBackendEnum, register_mla_prefill_backend
    from mla_prefill_ext.selector import MLAPrefillSelectorConfig, get_mla_prefill_backend


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mla_prefill_ext' has no attribute '{name}'")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
