"""Stamp the user's settings into the engine configuration where it is created.

vLLM ships its ``VllmConfig`` to every engine process and worker, on every node.
The process that creates it (``EngineArgs.create_engine_config``: the user's
process, ``vllm serve``'s front end) records its add-on settings, when any is set,
under ``additional_config["mla_prefill_ext"]``, as vLLM itself records other keys there.
A process that builds MLA layers compares its own settings with the stamp
(``wrappers.refuse_if_settings_differ``) and refuses at start when they differ:
the settings did not reach it, and running would silently ignore the user's choice.
"""

from __future__ import annotations

import threading
from types import ModuleType
from typing import Any

import wrapt

ARG_UTILS_MODULE = "vllm.engine.arg_utils"
TARGET = "EngineArgs.create_engine_config"

_LOCK = threading.Lock()
_handle: Any = None


def stamp_settings(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    config = wrapped(*args, **kwargs)
    from mla_prefill_ext import settings

    additional = settings.stamped(getattr(config, "additional_config", None))
    if additional is not None:
        config.additional_config = additional
    return config


def instrument(module: ModuleType) -> bool:
    """Wrap ``EngineArgs.create_engine_config`` (idempotent). False when it is not there."""
    global _handle
    with _LOCK:
        if _handle is not None:
            return True
        try:
            _handle = wrapt.wrap_function_wrapper(module, TARGET, stamp_settings)
        except (AttributeError, wrapt.PathResolutionError):
            return False
        return True


def uninstrument(module: ModuleType) -> None:
    global _handle
    with _LOCK:
        if _handle is not None:
            wrapt.unwrap_object(module, TARGET, _handle, missing_ok=True)
            _handle = None


def is_instrumented() -> bool:
    return _handle is not None
