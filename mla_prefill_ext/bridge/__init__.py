"""Host 2, vLLM 0.23+: the add-on's backends in vLLM's own MLA prefill registry.

``instrumentor`` applies and removes the bridge (wrappers of vLLM's selector, the
registrations), ``shape`` inspects vLLM's API, ``adapter`` makes an add-on backend
a subclass of vLLM's ``MLAPrefillBackend`` (``adapters`` holds them by name),
``chunks`` maps vLLM 0.29+'s context chunks, ``registration`` keeps vLLM's registry
in step with the add-on's, ``selection`` holds the selector wrappers. It imports
nothing from ``mla_prefill_ext.patches`` (host 1, vLLM 0.20), and the patch nothing
from here. The names below load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from mla_prefill_ext.bridge.shape import PREFILL_PACKAGE

_FROM_INSTRUMENTOR = frozenset(
    {
        "BINDING_MODULES",
        "instrument",
        "instrument_binding",
        "is_instrumented",
        "refuse_if_explicit",
        "state",
        "uninstrument",
    }
)

__all__ = ["PREFILL_PACKAGE", *sorted(_FROM_INSTRUMENTOR)]


def __getattr__(name: str) -> Any:
    if name in _FROM_INSTRUMENTOR:
        return getattr(importlib.import_module(f"{__name__}.instrumentor"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
