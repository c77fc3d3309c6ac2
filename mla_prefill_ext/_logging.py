"""The add-on's logger: a child of vLLM's, so its lines look like vLLM's own.

Importing this module does not import vLLM (4-5 s): the command line looks a backend name up in
the registry, which logs here, before it imports vLLM.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable
from typing import Any

# Under the "vllm" logger so vLLM's handler, format and VLLM_LOGGING_LEVEL apply: vLLM configures
# that logger when it is imported, before any engine process loads the add-on. (vLLM's init_logger
# adds only its *_once methods, which the add-on does not use: log_once below is its own.)
logger = logging.getLogger("vllm.mla_prefill_ext")

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
