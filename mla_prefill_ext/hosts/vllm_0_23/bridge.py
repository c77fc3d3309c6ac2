"""Instrument / uninstrument vLLM 0.23+'s MLA prefill selector: the bridge itself.

Symmetric and idempotent, all or none: one
:class:`~mla_prefill_ext.hosts.core.instrumentor.Instrumentor`, as the patch's patch sets, with
the core's refusal (:mod:`mla_prefill_ext.hosts.core.refusal`).
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

from types import ModuleType
from typing import Any

from mla_prefill_ext import versions
from mla_prefill_ext._logging import logger
from mla_prefill_ext.hosts.core import refusal
from mla_prefill_ext.hosts.core.instrumentor import Instrumentor, PatchState
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


class BridgeState(PatchState):
    """What the bridge did in this process (for diagnostics and tests): the patch sets' state, plus
    the shape of vLLM's API it bridged and what the selector bindings get."""

    def __init__(self) -> None:
        super().__init__()
        self.shape: Shape | None = None
        self.binding_wrapper: Any = None  # what the bindings get: the selection wrapper, or the guard

    @property
    def problem(self) -> str | None:
        """Why the bridge is not in place (None: in place, or not tried yet)."""
        return self.skipped_reason

    def __repr__(self) -> str:
        return f"BridgeState(instrumented={self.instrumented}, problem={self.problem!r})"


def _unwrapped(function: Any) -> Any:
    return getattr(function, "__wrapped__", function)


class BridgeInstrumentor(Instrumentor):
    """vLLM 0.23+'s MLA prefill selector module, bridged (the core's instrumentor design).

    :meth:`check` inspects vLLM's API (:mod:`shape`), :meth:`wrappers` names the selector's two
    functions, :meth:`complete` registers the add-on's backends in vLLM's registry (all or none
    with the wrappers), :meth:`skip` declines: one WARNING and a guard that refuses an explicit
    add-on choice. A bridge that declined stays declined until :meth:`uninstrument`.
    """

    def __init__(self) -> None:
        super().__init__()
        self._state: BridgeState = BridgeState()
        self._shape: Shape | None = None  # what check() found, for wrappers() and complete()
        self.original_get: Any = None  # vLLM's own get_mla_prefill_backend (bindings of it get wrapped)

    def state(self) -> BridgeState:
        return self._state

    def check(self, module: ModuleType | None) -> str | None:
        if self._state.skipped_reason is not None:
            return self._state.skipped_reason  # declined before: the guard is in place already
        shape, problems = current()
        if shape is None:
            return "vLLM's MLA prefill API has changed: " + "; ".join(problems)
        self._shape = shape
        return None

    def wrappers(self, module: ModuleType) -> list[tuple[str, Any]]:
        assert self._shape is not None
        self.original_get = _unwrapped(getattr(module, GET))
        self._state.binding_wrapper = selector_wrappers.make_get_wrapper(self._shape)
        return [(GET, self._state.binding_wrapper), (AUTO, selector_wrappers.make_auto_wrapper(self._shape))]

    def complete(self, module: ModuleType) -> str | None:
        assert self._shape is not None
        try:
            vllm_registry_sync.sync(self._shape, force=True)
        except Exception as e:  # all or none: the base removes the wrappers, CUSTOM is taken back here
            vllm_registry_sync.unregister(self._shape)  # (names added to vLLM's enum cannot be removed)
            return f"bridging failed ({type(e).__name__}: {e})"
        return None

    def skip(self, reason: str, module: ModuleType | None = None) -> None:
        """Wrap nothing but a guard that refuses the add-on's explicit choice (once)."""
        if self._state.skipped_reason is not None:
            return
        self._shape = None
        message = f"vLLM {versions.installed_vllm_version()}: {reason}"
        self._state.skipped_reason = message
        self._state.binding_wrapper = None
        if refusal.explicit_choice() is None:
            logger.warning(
                "mla-prefill-ext is not bridging vLLM's MLA prefill selection (%s); vLLM selects its own "
                "backends as without the add-on.",
                message,
            )
        if module is not None and callable(getattr(module, GET, None)):
            self.original_get = _unwrapped(getattr(module, GET))
            self._state.binding_wrapper = refusal.explicit_choice_guard(message, selector_wrappers.config_arg)
            self._state.wrappers.wrap(module, GET, self._state.binding_wrapper)

    def on_instrumented(self, module: ModuleType) -> None:
        self._state.shape = self._shape
        logger.debug("mla-prefill-ext bridged %s", SELECTOR_MODULE)

    def uninstrument(self, module: ModuleType | None = None) -> None:
        """Remove every wrapper (the guard's too) and vLLM's CUSTOM registration (idempotent)."""
        with self._lock:
            self._state.wrappers.unwrap_all()
            if self._state.shape is not None:
                vllm_registry_sync.unregister(self._state.shape)
            self._state.instrumented = False
            self._state.skipped_reason = None
            self._state.shape = None
            self._state.binding_wrapper = None
            self._shape = None
            selector_wrappers.clear_caches()


INSTRUMENTOR = BridgeInstrumentor()


def state() -> BridgeState:
    return INSTRUMENTOR.state()


def is_instrumented() -> bool:
    return INSTRUMENTOR.is_instrumented()


def refuse_if_explicit(reason: str) -> None:
    """Raise when the user explicitly chose a backend that cannot be honoured (the core's refusal)."""
    refusal.refuse_if_explicit(reason)


def instrument(selector_module: ModuleType | None = None) -> str | None:
    """Bridge vLLM's selector (all or none). None when bridged, else the reason it is not."""
    import sys

    shape, _ = current()
    module = shape.selector if shape is not None else selector_module or sys.modules.get(SELECTOR_MODULE)
    INSTRUMENTOR.instrument(module)  # type: ignore[arg-type]  # None: declined without a guard
    if INSTRUMENTOR.state().binding_wrapper is not None:
        _instrument_loaded_bindings()
    return INSTRUMENTOR.state().problem


def _instrument_loaded_bindings() -> None:
    import sys

    for name in BINDING_MODULES:
        loaded = sys.modules.get(name)
        if loaded is not None:
            instrument_binding(loaded)


def instrument_binding(module: ModuleType) -> None:
    """Wrap a module's own binding of ``get_mla_prefill_backend`` (idempotent)."""
    state = INSTRUMENTOR.state()
    with INSTRUMENTOR._lock:
        if state.binding_wrapper is None or module.__name__ == SELECTOR_MODULE:
            return
        bound = getattr(module, GET, None)
        if bound is None or bound is not INSTRUMENTOR.original_get:
            return  # not vLLM's function (someone else's, or ours already)
        state.wrappers.wrap(module, GET, state.binding_wrapper)


def uninstrument() -> None:
    """Remove every wrapper and vLLM's CUSTOM registration the bridge made (idempotent)."""
    INSTRUMENTOR.uninstrument()
