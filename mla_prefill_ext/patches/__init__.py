"""The vLLM 0.20.x patch: the only code that knows vLLM's MLA internals.

``instrumentor`` applies and removes it (:func:`instrument` / :func:`uninstrument`,
symmetric and idempotent, all or none), ``targets`` names and checks what it
wraps, ``wrappers`` holds the wrappers, ``layers`` reads vLLM's MLA layers,
``version`` declares the vLLM versions it supports.

Only ``layers`` (for :data:`MLA_MODULE`) loads with the package: activation needs
no more, so a vLLM process that never imports the MLA module (an API server, a
model without MLA) never loads the rest. The names below load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from mla_prefill_ext.patches.layers import MLA_MODULE

_FROM_INSTRUMENTOR = frozenset(
    {
        "SUPPORTED_VLLM",
        "PatchState",
        "instrument",
        "is_instrumented",
        "refuse_if_explicit",
        "skip",
        "state",
        "uninstrument",
    }
)
_SUBMODULES = frozenset({"instrumentor", "layers", "targets", "version", "wrappers"})

__all__ = ["MLA_MODULE", *sorted(_FROM_INSTRUMENTOR)]


def __getattr__(name: str) -> Any:
    if name in _FROM_INSTRUMENTOR:
        return getattr(importlib.import_module(f"{__name__}.instrumentor"), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_FROM_INSTRUMENTOR, *_SUBMODULES})
