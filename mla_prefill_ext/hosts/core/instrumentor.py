"""The one instrumentor design, for both hosts: wrappers applied all or none, removed symmetrically.

Shaped like OpenTelemetry's instrumentors. :class:`Wrappers` is the bookkeeping: every
``wrapt`` wrapper an instrumentor put in place, applied all or none
(:meth:`Wrappers.wrap_all` undoes the part that landed when one wrap raises) and removed
exactly (:meth:`Wrappers.unwrap_all`, ``wrapt.unwrap_object``; a wrapper someone wrapped
on top of stays, with one WARNING). :class:`Instrumentor` is one patch set over one vLLM
module on it: what must hold before it patches (:meth:`Instrumentor.check`), what it wraps
(:meth:`Instrumentor.wrappers`), what else patching takes that must land with the wrappers or
not at all (:meth:`Instrumentor.complete`, e.g. a registration), and a symmetric, idempotent
instrument / uninstrument. The patch host's patch sets and the bridge subclass it; the
shared-prefix path and the stock guard keep their wrappers in a :class:`Wrappers`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import wrapt

from mla_prefill_ext._logging import logger


class Wrappers:
    """The wrappers one instrumentor installed, in the order it installed them."""

    def __init__(self) -> None:
        self.installed: list[tuple[ModuleType, str, Any]] = []

    @property
    def handles(self) -> list[tuple[str, Any]]:
        """(dotted path in its module, wrapper) of each, for diagnostics and tests."""
        return [(path, handle) for _, path, handle in self.installed]

    def wrap(self, module: ModuleType, path: str, wrapper: Any) -> Any:
        handle = wrapt.wrap_function_wrapper(module, path, wrapper)
        self.installed.append((module, path, handle))
        return handle

    def wrap_all(self, module: ModuleType, table: list[tuple[str, Any]]) -> str | None:
        """Wrap every (path, wrapper) of ``table`` in ``module``, or none: the reason when none."""
        return self.wrap_each([(module, path, wrapper) for path, wrapper in table])

    def wrap_each(self, table: list[tuple[ModuleType, str, Any]]) -> str | None:
        """Wrap every (module, path, wrapper) of ``table``, or none: the reason when none."""
        start = len(self.installed)
        try:
            for module, path, wrapper in table:
                self.wrap(module, path, wrapper)
        except Exception as e:  # all or none: undo the part that landed
            self._undo_since(start)
            return f"wrapping failed ({type(e).__name__}: {e})"
        return None

    def _undo_since(self, start: int) -> None:
        """Remove the wrappers installed after the first ``start``."""
        landed, self.installed = self.installed[start:], self.installed[:start]
        for i, (mod, path, handle) in reversed(list(enumerate(landed))):
            try:
                wrapt.unwrap_object(mod, path, handle, missing_ok=True)
            except wrapt.WrapperNotOutermostError as e:  # still in place: still ours to remove later
                self.installed[start:start] = landed[: i + 1]
                logger.warning(
                    "mla-prefill-ext could not remove its wrapper on %s.%s: %s", mod.__name__, path, e
                )
                return

    def unwrap_all(self) -> None:
        """Remove every wrapper, last first (idempotent)."""
        for module, path, handle in reversed(self.installed):
            try:
                wrapt.unwrap_object(module, path, handle, missing_ok=True)
            except wrapt.WrapperNotOutermostError as e:
                logger.warning(
                    "mla-prefill-ext could not remove its wrapper on %s.%s: %s", module.__name__, path, e
                )
        self.installed = []


@dataclass
class PatchState:
    """What a patch set did in this process (for diagnostics and tests)."""

    instrumented: bool = False
    vllm_version: str | None = None
    skipped_reason: str | None = None
    targets: list[Any] = field(default_factory=list)  # the host's target statuses
    wrappers: Wrappers = field(default_factory=Wrappers)

    @property
    def handles(self) -> list[tuple[str, Any]]:
        return self.wrappers.handles


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
        """Why ``module`` must not be patched (None: patch it). Default: nothing to check."""
        return None

    def complete(self, module: ModuleType) -> str | None:
        """The rest of patching, once every wrapper is in place: None when done, else why not (then
        every wrapper is removed again and :meth:`skip` runs). Default: nothing more."""
        return None

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
                reason = self._state.wrappers.wrap_all(module, self.wrappers(module))
                if reason is None:
                    reason = self.complete(module)
                    if reason is not None:  # all or none: the wrappers go too
                        self._state.wrappers.unwrap_all()
            if reason is not None:
                self.skip(reason, module)
                return False
            self._state.skipped_reason = None
            self._state.instrumented = True
            self.on_instrumented(module)
            return True

    def uninstrument(self, module: ModuleType) -> None:
        """Remove every wrapper :meth:`instrument` installed (idempotent; a no-op when none is)."""
        with self._lock:
            self._state.skipped_reason = None
            if not self._state.instrumented:
                return
            self._state.wrappers.unwrap_all()
            self._state.instrumented = False
            self.on_uninstrumented(module)
