"""Instrument / uninstrument vLLM 0.23+'s MLA prefill selector: the bridge itself.

Symmetric and idempotent, all or none, on the core's instrumentor bookkeeping
(:class:`~mla_prefill_ext.hosts.core.instrumentor.Wrappers`) and refusal
(:mod:`mla_prefill_ext.hosts.core.refusal`), as the patch's patch sets.
:func:`instrument` inspects vLLM's API (:mod:`shape`), wraps its selector's
``get_mla_prefill_backend`` and ``_auto_select_mla_prefill_backend`` with ``wrapt``,
and registers the add-on's backends in vLLM's registry. Modules that imported
``get_mla_prefill_backend`` by name (vLLM's MLA layer module, the prefill package,
Kimi-K3's MLA) get the same wrapper on their binding when they are imported
(:func:`instrument_binding`). When vLLM's API has a shape the bridge does not know,
nothing is wrapped but a guard: an explicit add-on choice refuses at start with
the reason, and vLLM selects as it always does.
"""

from __future__ import annotations

import threading
from types import ModuleType
from typing import Any

from mla_prefill_ext import versions
from mla_prefill_ext._logging import logger
from mla_prefill_ext.hosts.core import refusal
from mla_prefill_ext.hosts.core.instrumentor import Wrappers
from mla_prefill_ext.hosts.vllm_0_23 import selector_wrappers, vllm_registry_sync
from mla_prefill_ext.hosts.vllm_0_23.shape import PREFILL_PACKAGE, SELECTOR_MODULE, Shape, current
from mla_prefill_ext.mla_layers import MLA_MODULE

GET = "get_mla_prefill_backend"
AUTO = "_auto_select_mla_prefill_backend"

BINDING_MODULES = (
    PREFILL_PACKAGE,
    MLA_MODULE,
    "vllm.models.kimi_k3.nvidia.mla",
)
"""Modules that hold their own binding of ``get_mla_prefill_backend`` (``from ... import``)."""


class BridgeState:
    """What the bridge did in this process (for diagnostics and tests)."""

    # A plain class: a dataclass costs about 1 ms to create, in every vLLM process.
    def __init__(self) -> None:
        self.instrumented = False
        self.shape: Shape | None = None
        self.problem: str | None = None
        self.binding_wrapper: Any = None  # what the bindings get: the selection wrapper, or the guard
        self.wrappers = Wrappers()

    def __repr__(self) -> str:
        return f"BridgeState(instrumented={self.instrumented}, problem={self.problem!r})"


_STATE = BridgeState()
_LOCK = threading.RLock()
_original_get: Any = None


def state() -> BridgeState:
    return _STATE


def is_instrumented() -> bool:
    return _STATE.instrumented


def refuse_if_explicit(reason: str) -> None:
    """Raise when the user explicitly chose a backend that cannot be honoured (the core's refusal)."""
    refusal.refuse_if_explicit(reason)


def _config_arg(args: tuple, kwargs: dict) -> Any:
    return kwargs.get("vllm_config", args[0] if args else None)


def _wrap(module: ModuleType, name: str, wrapper: Any) -> None:
    _STATE.wrappers.wrap(module, name, wrapper)


def instrument(selector_module: ModuleType | None = None) -> str | None:
    """Bridge vLLM's selector (all or none). None when bridged, else the reason it is not."""
    global _original_get
    with _LOCK:
        if _STATE.instrumented:
            return None
        if _STATE.problem is not None:
            return _STATE.problem
        shape, problems = current()
        if shape is None:
            import sys

            module = selector_module or sys.modules.get(SELECTOR_MODULE)
            return _decline("vLLM's MLA prefill API has changed: " + "; ".join(problems), module)
        module = shape.selector
        _original_get = getattr(getattr(module, GET), "__wrapped__", getattr(module, GET))
        try:
            _STATE.binding_wrapper = selector_wrappers.make_get_wrapper(shape)
            _wrap(module, GET, _STATE.binding_wrapper)
            _wrap(module, AUTO, selector_wrappers.make_auto_wrapper(shape))
            vllm_registry_sync.sync(shape, force=True)
        except Exception as e:  # all or none
            _STATE.wrappers.unwrap_all()
            _STATE.binding_wrapper = None
            return _decline(f"bridging failed ({type(e).__name__}: {e})", module)
        _STATE.shape = shape
        _STATE.instrumented = True
    _instrument_loaded_bindings()
    logger.debug("mla-prefill-ext bridged %s", SELECTOR_MODULE)
    return None


def _instrument_loaded_bindings() -> None:
    import sys

    for name in BINDING_MODULES:
        loaded = sys.modules.get(name)
        if loaded is not None:
            instrument_binding(loaded)


def _decline(reason: str, module: ModuleType | None) -> str:
    """Wrap nothing but a guard that refuses the add-on's explicit choice."""
    global _original_get
    message = f"vLLM {versions.installed_vllm_version()}: {reason}"
    _STATE.problem = message
    if refusal.explicit_choice() is None:
        logger.warning(
            "mla-prefill-ext is not bridging vLLM's MLA prefill selection (%s); vLLM selects its own "
            "backends as without the add-on.",
            message,
        )
    if module is not None and callable(getattr(module, GET, None)):
        _original_get = getattr(getattr(module, GET), "__wrapped__", getattr(module, GET))
        _STATE.binding_wrapper = refusal.explicit_choice_guard(message, _config_arg)
        _wrap(module, GET, _STATE.binding_wrapper)
        _instrument_loaded_bindings()
    return message


def instrument_binding(module: ModuleType) -> None:
    """Wrap a module's own binding of ``get_mla_prefill_backend`` (idempotent)."""
    with _LOCK:
        if _STATE.binding_wrapper is None or module.__name__ == SELECTOR_MODULE:
            return
        bound = getattr(module, GET, None)
        if bound is None or bound is not _original_get:
            return  # not vLLM's function (someone else's, or ours already)
        _wrap(module, GET, _STATE.binding_wrapper)


def uninstrument() -> None:
    """Remove every wrapper and vLLM's CUSTOM registration the bridge made (idempotent)."""
    with _LOCK:
        _STATE.wrappers.unwrap_all()
        if _STATE.shape is not None:
            vllm_registry_sync.unregister(_STATE.shape)
        _STATE.instrumented = False
        _STATE.shape = None
        _STATE.problem = None
        _STATE.binding_wrapper = None
        selector_wrappers.clear_caches()
