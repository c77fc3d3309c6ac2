"""Where the add-on cannot serve, vLLM runs stock and only an explicit choice is refused (every vLLM).

On a vLLM without a mode (0.21-0.22: ``versions.NONE``) activation arms only this guard;
the 0.20 patch arms it too when its targets changed. It says once why nothing is
patched, refuses an explicit choice in the environment at once, and wraps
``MLAAttention.__init__`` (the same class on every vLLM the add-on knows) so that a choice
in an engine's ``additional_config``, visible only while that engine is built, is refused
as its first MLA layer is built. Nothing else is touched.
"""

from __future__ import annotations

import threading
from types import ModuleType
from typing import Any

import wrapt

from mla_prefill_ext._logging import logger
from mla_prefill_ext.hosts.core import refusal
from mla_prefill_ext.hosts.core.instrumentor import Wrappers

LAYER_INIT = "MLAAttention.__init__"


class StockGuard:
    """The explicit-choice guard over vLLM's MLA module, and why it is there."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.wrappers = Wrappers()  # the one on MLAAttention.__init__, once wrapped
        self._lock = threading.RLock()

    @property
    def handle(self) -> Any:
        """The wrapper on ``MLAAttention.__init__`` (None: not wrapped)."""
        return self.wrappers.installed[0][2] if self.wrappers.installed else None

    def arm(self, reason: str, mla_module: ModuleType | None = None) -> None:
        """Say why once, guard the layer of ``mla_module`` (when at hand), refuse an explicit choice now."""
        with self._lock:
            if reason != self.reason and refusal.explicit_choice() is None:
                logger.warning(
                    "mla-prefill-ext is not patching vLLM (%s); vLLM runs its stock MLA prefill.", reason
                )
            self.reason = reason
            if mla_module is not None and self.handle is None:
                try:
                    self.wrappers.wrap(mla_module, LAYER_INIT, refusal.explicit_choice_guard(reason))
                except (AttributeError, wrapt.PathResolutionError):
                    pass  # no MLA layer class at all: nothing can ask for a prefill backend
        refusal.refuse_if_explicit(reason)

    def disarm(self, mla_module: ModuleType | None = None) -> None:
        """Remove the wrapper (idempotent; the core's bookkeeping knows its module)."""
        with self._lock:
            self.wrappers.unwrap_all()
            self.reason = None


STOCK_GUARD = StockGuard()
"""The process's one guard: activation arms it on a vLLM without a mode."""
