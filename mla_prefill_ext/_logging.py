"""The add-on's logger: a child of vLLM's, so its lines look like vLLM's own."""

from __future__ import annotations

import threading
from collections.abc import Hashable
from typing import Any

from vllm.logger import init_logger

# Under the "vllm" logger so vLLM's handler, format and VLLM_LOGGING_LEVEL apply.
logger = init_logger("vllm.mla_prefill_ext")

_LOGGED: set[Hashable] = set()
_LOGGED_LOCK = threading.Lock()


def first_time(key: Hashable) -> bool:
    """True the first time ``key`` is seen in this process (what "log once" means, everywhere)."""
    with _LOGGED_LOCK:
        if key in _LOGGED:
            return False
        _LOGGED.add(key)
        return True


def log_once(level: int, key: Hashable, message: str, *args: Any) -> None:
    """Log ``message`` at ``level`` the first time ``key`` is seen in this process."""
    if first_time(key):
        logger.log(level, message, *args)


def forget_logged() -> None:
    """Log every once-only line again (tests)."""
    with _LOGGED_LOCK:
        _LOGGED.clear()
