"""The one instrumentor base: a patch set's instrument / uninstrument, symmetric, idempotent, all or none.

Shaped like OpenTelemetry's instrumentors: a patch set says what must hold before it
patches (:meth:`Instrumentor.check`: the vLLM version, the shape of its targets) and
what it wraps (:meth:`Instrumentor.wrappers`); :meth:`Instrumentor.instrument` wraps
all of it or, when a check fails or a wrap raises, nothing (the part that landed is
undone), and :meth:`Instrumentor.uninstrument` removes exactly what it wrapped. Each
patch set is one instance of a subclass (``patches.PATCH_SETS`` lists them); its
state is that instance's, never a module's.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

import wrapt

from mla_prefill_ext._logging import logger
from mla_prefill_ext.patches import version

if TYPE_CHECKING:
    from mla_prefill_ext.patches.targets import TargetStatus


@dataclass
class PatchState:
    """What a patch set did in this process (for diagnostics and tests)."""

    instrumented: bool = False
    vllm_version: str | None = None
    skipped_reason: str | None = None
    targets: list[TargetStatus] = field(default_factory=list)
    handles: list[tuple[str, Any]] = field(default_factory=list)
    guard: Any = None  # the explicit-choice guard installed instead of the patch


class Instrumentor:
    """One patch set over one vLLM module. Subclasses name what they wrap; the base applies it."""

    def __init__(self) -> None:
        self._state = PatchState()
        self._lock = threading.RLock()

    def state(self) -> PatchState:
        return self._state

    def is_instrumented(self) -> bool:
        return self._state.instrumented

    def wrappers(self, module: ModuleType) -> list[tuple[str, Any]]:
        """(dotted path in ``module``, wrapt wrapper) for every target, in the order to wrap."""
        raise NotImplementedError

    def check(self, module: ModuleType) -> str | None:
        """Why ``module`` must not be patched (None: patch it). Default: the vLLM version."""
        self._state.vllm_version = version.installed_vllm_version()
        return version.unsupported_reason(self._state.vllm_version)

    def skip(self, reason: str, module: ModuleType | None = None) -> None:
        """Nothing was patched: record why (a patch set that must say more overrides this)."""
        self._state.skipped_reason = reason

    def on_instrumented(self, module: ModuleType) -> None:
        """Runs once every wrapper is in place (inside the lock)."""

    def on_uninstrumented(self, module: ModuleType) -> None:
        """Runs once every wrapper is removed (inside the lock)."""

    def instrument(self, module: ModuleType) -> bool:
        """Patch ``module`` (all or none; idempotent). True when the patch is in place."""
        with self._lock:
            if self._state.instrumented:
                return True
            reason = self.check(module)
            if reason is None:
                reason = self._apply(module)
            if reason is not None:
                self.skip(reason, module)
                return False
            self._state.skipped_reason = None
            self._state.instrumented = True
            self.on_instrumented(module)
            return True

    def _apply(self, module: ModuleType) -> str | None:
        applied: list[tuple[str, Any]] = []
        try:
            for path, wrapper in self.wrappers(module):
                applied.append((path, wrapt.wrap_function_wrapper(module, path, wrapper)))
        except Exception as e:  # all or none: undo the part that landed
            for path, handle in reversed(applied):
                wrapt.unwrap_object(module, path, handle, missing_ok=True)
            return f"wrapping failed ({type(e).__name__}: {e})"
        self._state.handles = applied
        return None

    def uninstrument(self, module: ModuleType) -> None:
        """Remove every wrapper :meth:`instrument` installed (idempotent; a no-op when none is)."""
        with self._lock:
            self._state.skipped_reason = None
            if not self._state.instrumented:
                return
            for path, handle in reversed(self._state.handles):
                try:
                    wrapt.unwrap_object(module, path, handle, missing_ok=True)
                except wrapt.WrapperNotOutermostError as e:
                    logger.warning("mla-prefill-ext could not remove its wrapper on %s: %s", path, e)
            self._state.handles = []
            self._state.instrumented = False
            self.on_uninstrumented(module)
