"""The vLLM 0.23+ host: the add-on's backends bridged into vLLM's own MLA prefill registry.

``bridge`` applies and removes the bridge (wrappers of vLLM's selector, the
registrations), ``shape`` inspects vLLM's API, ``adapter`` makes an add-on backend
a subclass of vLLM's ``MLAPrefillBackend`` (``adapter_classes`` holds them by name: the
class paths vLLM's registry and its engine processes resolve), ``chunks`` maps vLLM
0.29+'s context chunks, ``vllm_registry_sync`` keeps vLLM's registry in step with the
add-on's, ``selector_wrappers`` holds the wrappers of vLLM's selector, ``report`` what
``info`` shows. What both hosts do is in :mod:`mla_prefill_ext.hosts.core`; it imports
nothing from ``mla_prefill_ext.hosts.vllm_0_20`` (vLLM 0.20), and that host nothing
from here. The names below load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from mla_prefill_ext.hosts.vllm_0_23.shape import PREFILL_PACKAGE

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
        return getattr(importlib.import_module(f"{__name__}.bridge"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
