"""Instrument / uninstrument vLLM's MLA module: the patch itself.

Shaped like an OpenTelemetry instrumentor: it declares the vLLM versions it
supports (:data:`SUPPORTED_VLLM`), and :func:`instrument` / :func:`uninstrument`
are symmetric and idempotent. Patching is all or none: on an unsupported vLLM,
or when any target is missing or shaped differently, nothing is wrapped, one
line says why, and vLLM runs as stock. When the user explicitly chose a backend
and the patch cannot honour it, :func:`instrument` raises instead, so that the
engine fails at start with the reason rather than ignoring the choice.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import wrapt

from mla_prefill_ext._logging import logger
from mla_prefill_ext.patches import version, wrappers
from mla_prefill_ext.patches.layers import MLA_MODULE
from mla_prefill_ext.patches.targets import (
    PREFILL_CHOICE_FUNCTIONS,
    QUERY_QUANT_FUNCTION,
    TargetStatus,
    inspect_targets,
)
from mla_prefill_ext.patches.version import SUPPORTED_VLLM

# The package (patches/__init__.py) re-exports exactly these, lazily; a test keeps the two equal.
__all__ = [
    "SUPPORTED_VLLM",
    "PatchState",
    "instrument",
    "is_instrumented",
    "refuse_if_explicit",
    "skip",
    "state",
    "uninstrument",
]


@dataclass
class PatchState:
    """What the patch did in this process (for diagnostics and tests)."""

    instrumented: bool = False
    vllm_version: str | None = None
    skipped_reason: str | None = None
    targets: list[TargetStatus] = field(default_factory=list)
    handles: list[tuple[str, Any]] = field(default_factory=list)
    guard: Any = None  # the explicit-choice guard installed instead of the patch


_STATE = PatchState()
_LOCK = threading.RLock()
_LOG_FILTER = wrappers.StalePrefillLogFilter()


def state() -> PatchState:
    return _STATE


def is_instrumented() -> bool:
    return _STATE.instrumented


def _wrapper_table(module: ModuleType) -> list[tuple[str, Any]]:
    table: list[tuple[str, Any]] = [
        ("MLAAttention.__init__", wrappers.layer_init),
        ("MLACommonImpl.__init__", wrappers.make_impl_init_wrapper(module)),
        ("MLACommonMetadataBuilder.__init__", wrappers.builder_init),
        ("MLACommonMetadataBuilder.build", wrappers.builder_build),
        (QUERY_QUANT_FUNCTION, wrappers.supports_prefill_query_quantization),
    ]
    table += [(name, wrappers.prefill_is_ours) for name in PREFILL_CHOICE_FUNCTIONS]
    return table


def _explicit_choice() -> str | None:
    """The user's explicit backend choice visible in this process, if any."""
    choice = wrappers.current_explicit_choice()
    return f"{choice.source}={choice.name}" if choice else None


def refuse_if_explicit(reason: str) -> None:
    """Raise when the user explicitly chose a backend that cannot be honoured."""
    choice = _explicit_choice()
    if choice:
        raise RuntimeError(
            f"mla-prefill-ext cannot honour {choice}: {reason}. Unset it to run vLLM's "
            "stock MLA prefill, or install a supported vLLM "
            f"(vllm{SUPPORTED_VLLM})."
        )


def skip(reason: str, module: ModuleType | None = None) -> None:
    """Leave vLLM stock: say why once, and refuse an explicit choice.

    An environment choice is refused at once. A choice in ``additional_config`` is
    only visible once an engine's configuration is current, so when the MLA module is
    at hand a guard on ``MLAAttention.__init__`` refuses it as the first MLA layer is
    built, and otherwise lets vLLM run untouched.
    """
    with _LOCK:
        if reason != _STATE.skipped_reason and _explicit_choice() is None:
            logger.warning(
                "mla-prefill-ext is not patching vLLM (%s); vLLM runs its stock MLA prefill.",
                reason,
            )
        _STATE.skipped_reason = reason
        if module is not None and _STATE.guard is None:
            try:
                _STATE.guard = wrapt.wrap_function_wrapper(
                    module,
                    "MLAAttention.__init__",
                    wrappers.make_explicit_choice_guard(reason, refuse_if_explicit),
                )
            except (AttributeError, wrapt.PathResolutionError):
                pass  # no MLA layer class at all: nothing can ask for a prefill backend
    refuse_if_explicit(reason)


def instrument(module: ModuleType) -> bool:
    """Patch vLLM's MLA module (all or none). True when the patch is in place."""
    with _LOCK:
        if _STATE.instrumented:
            return True
        _STATE.vllm_version = version.installed_vllm_version()
        reason = version.unsupported_reason(_STATE.vllm_version)
        _STATE.targets = inspect_targets(module)
        if reason is None:
            bad = [f"{t.path} {t.problem}" for t in _STATE.targets if not t.ok]
            if bad:
                reason = "patch targets changed in vLLM " + str(_STATE.vllm_version) + ": " + "; ".join(bad)
        if reason is None:
            reason = _apply(module)
        if reason is not None:
            skip(reason, module)
            return False
        _STATE.skipped_reason = None
        _STATE.instrumented = True
        logging.getLogger(MLA_MODULE).addFilter(_LOG_FILTER)
        logger.debug("mla-prefill-ext patched %s", ", ".join(p for p, _ in _STATE.handles))
        return True


def _apply(module: ModuleType) -> str | None:
    applied: list[tuple[str, Any]] = []
    try:
        for path, wrapper in _wrapper_table(module):
            applied.append((path, wrapt.wrap_function_wrapper(module, path, wrapper)))
    except Exception as e:  # all or none: undo the part that landed
        for path, handle in reversed(applied):
            wrapt.unwrap_object(module, path, handle, missing_ok=True)
        return f"wrapping failed ({type(e).__name__}: {e})"
    _STATE.handles = applied
    return None


def uninstrument(module: ModuleType) -> None:
    """Remove every wrapper the patch (or its guard) installed; a no-op when none is.

    Layers built while the patch was in place keep their backend.
    """
    with _LOCK:
        if _STATE.guard is not None:
            wrapt.unwrap_object(module, "MLAAttention.__init__", _STATE.guard, missing_ok=True)
            _STATE.guard = None
        _STATE.skipped_reason = None
        if not _STATE.instrumented:
            return
        for path, handle in reversed(_STATE.handles):
            try:
                wrapt.unwrap_object(module, path, handle, missing_ok=True)
            except wrapt.WrapperNotOutermostError as e:
                logger.warning("mla-prefill-ext could not remove its wrapper on %s: %s", path, e)
        for name in (*PREFILL_CHOICE_FUNCTIONS, QUERY_QUANT_FUNCTION):
            cache_clear = getattr(getattr(module, name, None), "cache_clear", None)
            if cache_clear is not None:
                cache_clear()  # answers cached by the stock functions must not leak across
        _STATE.handles = []
        _STATE.instrumented = False
        logging.getLogger(MLA_MODULE).removeFilter(_LOG_FILTER)
