"""An explicit backend choice the add-on cannot honour fails at start, with the reason (both hosts).

Where the add-on cannot serve (an unsupported vLLM, patch targets that changed, a vLLM
API the bridge does not know), vLLM runs as stock; but a backend the user chose by name
(``MLA_PREFILL_BACKEND``, ``additional_config["mla_prefill_backend"]``) must not be
silently ignored: the engine fails at start with :func:`refusal_message`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mla_prefill_ext import settings
from mla_prefill_ext.versions import SUPPORTED_TEXT


class ChoiceRefusedError(RuntimeError):
    """An explicit choice, or the settings it rests on, refused where vLLM itself selects (the bridge).

    Not a ValueError on purpose: vLLM 0.33's MLA layer catches ValueError from its prefill selection
    for sparse-MLA layers and then runs without a dense prefill backend (one warning), which would
    drop the user's choice silently. The message is the add-on's own, as the selector wrote it.
    """


def current_vllm_config() -> Any:
    """The engine configuration being built in this process (None: none, or no vLLM)."""
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:
        return None
    return get_current_vllm_config_or_none()


def explicit_choice(vllm_config: Any = None) -> settings.Choice | None:
    """The user's explicit choice for ``vllm_config`` (default: the one being built here), if any."""
    config = current_vllm_config() if vllm_config is None else vllm_config
    return settings.explicit_choice(getattr(config, "additional_config", None))


def refusal_message(choice: settings.Choice, reason: str) -> str:
    return (
        f"mla-prefill-ext cannot honour {choice.source}={choice.name}: {reason}. Unset it to run vLLM's "
        f"own MLA prefill, or install a supported vLLM ({SUPPORTED_TEXT})."
    )


def refuse_if_explicit(reason: str, vllm_config: Any = None) -> None:
    """Raise RuntimeError when the user explicitly chose a backend (see :func:`explicit_choice`)."""
    choice = explicit_choice(vllm_config)
    if choice is not None:
        raise RuntimeError(refusal_message(choice, reason))


def explicit_choice_guard(reason: str, config_of: Callable[[tuple, dict], Any] | None = None) -> Any:
    """A wrapt wrapper that refuses an explicit choice, then calls vLLM's function as stock.

    ``config_of(args, kwargs)`` finds the engine configuration in the call (default: the
    configuration being built in this process).
    """

    def guard(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        refuse_if_explicit(reason, None if config_of is None else config_of(args, kwargs))
        return wrapped(*args, **kwargs)

    return guard
