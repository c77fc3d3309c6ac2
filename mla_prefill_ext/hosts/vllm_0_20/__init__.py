"""The vLLM 0.20.x host: the patch of vLLM's MLA layer (on 0.21-0.22 only ``info`` reads its report).

Two patch sets, each one :class:`~mla_prefill_ext.hosts.core.instrumentor.Instrumentor`
(symmetric, idempotent, all or none), listed once in :data:`PATCH_SETS` with the vLLM
module each patches: ``mla`` (the MLA layer, impl and metadata builder, through
``hooks/``) and ``engine_config`` (the settings stamped into the engine configuration).
Beside them: ``targets`` (what the MLA patch wraps and the shape each must have),
``scope`` (where the add-on takes over), ``legacy_flags`` (vLLM 0.20's own prefill flags,
read as a choice for the selector), ``report`` (what ``info`` shows). The supported
versions are :mod:`mla_prefill_ext.versions`' patch row; vLLM's MLA layers are read by
:mod:`mla_prefill_ext.mla_layers`, shared with the bridge (``hosts/vllm_0_23``).

None of them loads with the package: activation needs no more than :data:`MLA_MODULE`,
so a vLLM process that never imports the MLA module (an API server, a model
without MLA) never loads the rest. The names below load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from mla_prefill_ext.mla_layers import MLA_MODULE

if TYPE_CHECKING:
    from mla_prefill_ext.hosts.core.instrumentor import Instrumentor

ARG_UTILS_MODULE = "vllm.engine.arg_utils"

PATCH_SETS: dict[str, str] = {
    # vLLM module -> the patch set's module (its INSTRUMENTOR), in the order activation applies them.
    ARG_UTILS_MODULE: f"{__name__}.engine_config",
    MLA_MODULE: f"{__name__}.mla",
}

# name -> the submodule that defines it: the MLA patch set's API, loaded on first use.
_LAZY = {
    "instrument": "mla",
    "is_instrumented": "mla",
    "refuse_if_explicit": "mla",
    "skip": "mla",
    "state": "mla",
    "uninstrument": "mla",
}

__all__ = ["ARG_UTILS_MODULE", "MLA_MODULE", "PATCH_SETS", "instrumentor_for", *sorted(_LAZY)]


def instrumentor_for(module_name: str) -> Instrumentor:
    """The patch set that patches the vLLM module ``module_name`` (loads it)."""
    return importlib.import_module(PATCH_SETS[module_name]).INSTRUMENTOR


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is not None:
        return getattr(importlib.import_module(f"{__name__}.{module}"), name)
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        return importlib.import_module(f"{__name__}.{name}")  # a submodule: vllm_0_20.mla, ...
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
