"""The MLA patch set: vLLM 0.20's MLA layer, impl and metadata builder run the selected backend.

Patching is all or none (:class:`~mla_prefill_ext.hosts.core.instrumentor.Instrumentor`):
on an unsupported vLLM, or when any target is missing or shaped differently, nothing
is wrapped, one line says why, and vLLM runs as stock. When the user explicitly chose a
backend and the patch cannot honour it, :func:`instrument` raises instead, so that the
engine fails at start with the reason rather than ignoring the choice.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

from mla_prefill_ext import versions
from mla_prefill_ext._logging import logger
from mla_prefill_ext.hosts.core import refusal
from mla_prefill_ext.hosts.core.instrumentor import Instrumentor
from mla_prefill_ext.hosts.core.stock_guard import LAYER_INIT, STOCK_GUARD
from mla_prefill_ext.hosts.vllm_0_20.hooks import builder, dispatch, layer
from mla_prefill_ext.hosts.vllm_0_20.targets import (
    PREFILL_CHOICE_FUNCTIONS,
    QUERY_QUANT_FUNCTION,
    inspect_targets,
)
from mla_prefill_ext.mla_layers import MLA_MODULE


def refuse_if_explicit(reason: str) -> None:
    """Raise when the user explicitly chose a backend that cannot be honoured (the core's refusal)."""
    refusal.refuse_if_explicit(reason)


class MLAInstrumentor(Instrumentor):
    """Wraps vLLM's MLA module; where it cannot, guards the layer against an explicit choice."""

    def __init__(self) -> None:
        super().__init__()
        self._log_filter = dispatch.StalePrefillLogFilter()

    def wrappers(self, module: ModuleType) -> list[tuple[str, Any]]:
        table: list[tuple[str, Any]] = [
            (LAYER_INIT, layer.layer_init),
            ("MLACommonImpl.__init__", layer.make_impl_init_wrapper(module)),
            ("MLACommonMetadataBuilder.__init__", builder.builder_init),
            ("MLACommonMetadataBuilder.build", builder.builder_build),
            (QUERY_QUANT_FUNCTION, dispatch.supports_prefill_query_quantization),
        ]
        table += [(name, dispatch.prefill_is_ours) for name in PREFILL_CHOICE_FUNCTIONS]
        return table

    def check(self, module: ModuleType) -> str | None:
        state = self._state
        state.vllm_version = versions.installed_vllm_version()
        reason = versions.unsupported_reason(versions.PATCH, state.vllm_version)
        state.targets = inspect_targets(module)
        if reason is None:
            bad = [f"{t.path} {t.problem}" for t in state.targets if not t.ok]
            if bad:
                reason = "patch targets changed in vLLM " + str(state.vllm_version) + ": " + "; ".join(bad)
        return reason

    def skip(self, reason: str, module: ModuleType | None = None) -> None:
        """Leave vLLM stock: say why once, and refuse an explicit choice (the core's stock guard).

        An environment choice is refused at once. A choice in ``additional_config`` is
        only visible once an engine's configuration is current, so when the MLA module is
        at hand a guard on ``MLAAttention.__init__`` refuses it as the first MLA layer is
        built, and otherwise lets vLLM run untouched.
        """
        with self._lock:
            self._state.skipped_reason = reason
        STOCK_GUARD.arm(reason, module)

    def on_instrumented(self, module: ModuleType) -> None:
        logging.getLogger(MLA_MODULE).addFilter(self._log_filter)
        logger.debug("mla-prefill-ext patched %s", ", ".join(p for p, _ in self._state.handles))

    def uninstrument(self, module: ModuleType) -> None:
        """Remove every wrapper the patch (or its guard) installed; a no-op when none is.

        Layers built while the patch was in place keep their backend.
        """
        with self._lock:
            STOCK_GUARD.disarm(module)
            super().uninstrument(module)

    def on_uninstrumented(self, module: ModuleType) -> None:
        for name in (*PREFILL_CHOICE_FUNCTIONS, QUERY_QUANT_FUNCTION):
            cache_clear = getattr(getattr(module, name, None), "cache_clear", None)
            if cache_clear is not None:
                cache_clear()  # answers cached by the stock functions must not leak across
        logging.getLogger(MLA_MODULE).removeFilter(self._log_filter)


INSTRUMENTOR = MLAInstrumentor()
# The patch set's API, as the host package re-exports it (hosts.vllm_0_20.instrument(...), ...).
instrument = INSTRUMENTOR.instrument
uninstrument = INSTRUMENTOR.uninstrument
is_instrumented = INSTRUMENTOR.is_instrumented
state = INSTRUMENTOR.state
skip = INSTRUMENTOR.skip
