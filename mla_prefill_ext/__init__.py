"""Pluggable MLA prefill attention backends for vLLM 0.20.x (patched) and 0.23+ (bridged).

Public API (names as in later upstream vLLM)::

    from mla_prefill_ext import (
        MLAPrefillBackend, MLAPrefillBackendEnum, register_mla_prefill_backend,
        get_mla_prefill_backend, activate, deactivate,
    )

Importing the package is cheap and needs neither vLLM nor PyTorch: the API is
loaded on first use, so that vLLM's plugin loader pays only for :func:`activate`.
A name whose module needs a missing vLLM or PyTorch raises ModuleNotFoundError
saying what is missing and which vLLM versions the add-on supports
(``mla-prefill-ext info`` checks the whole installation).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from mla_prefill_ext.activation import activate, deactivate

__version__ = "0.1.0"

_LAZY = {
    "AutoSelectClaim": "mla_prefill_ext.value_types",
    "KernelWarmup": "mla_prefill_ext.value_types",
    "MLAPrefillBackend": "mla_prefill_ext.backends.base",
    "MLAPrefillBackendEnum": "mla_prefill_ext.registry",
    "register_mla_prefill_backend": "mla_prefill_ext.registry",
    "get_mla_prefill_backend": "mla_prefill_ext.selector",
    "MLAPrefillSelectorConfig": "mla_prefill_ext.value_types",
}

__all__ = [
    "AutoSelectClaim",
    "KernelWarmup",
    "MLAPrefillBackend",
    "MLAPrefillBackendEnum",
    "MLAPrefillSelectorConfig",
    "activate",
    "deactivate",
    "get_mla_prefill_backend",
    "register_mla_prefill_backend",
]

if TYPE_CHECKING:
    from mla_prefill_ext.backends.base import AutoSelectClaim, KernelWarmup, MLAPrefillBackend
    from mla_prefill_ext.registry import MLAPrefillBackendEnum, register_mla_prefill_backend
    from mla_prefill_ext.selector import get_mla_prefill_backend
    from mla_prefill_ext.value_types import MLAPrefillSelectorConfig


# The add-on's own dependencies come with vLLM: when one is missing, say so plainly.
_HOST_MODULES = {"vllm": "vLLM", "torch": "PyTorch"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mla_prefill_ext' has no attribute '{name}'")
    try:
        loaded = importlib.import_module(module)
    except ModuleNotFoundError as e:
        missing = _HOST_MODULES.get((e.name or "").partition(".")[0])
        if missing is None:
            raise
        from mla_prefill_ext.versions import INSTALL_SPEC, SUPPORTED_TEXT

        raise ModuleNotFoundError(
            f"mla_prefill_ext.{name} needs {missing}, which cannot be imported here ({e}). "
            f"mla-prefill-ext is an add-on for vLLM (supported: {SUPPORTED_TEXT}); install "
            f"vLLM, which brings PyTorch: pip install '{INSTALL_SPEC}'. "
            "Run `mla-prefill-ext info` to check the installation.",
            name=e.name,
        ) from None
    value = getattr(loaded, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
