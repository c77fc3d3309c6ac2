"""vLLM 0.20's legacy prefill flags on ``attention_config``, read as a backend choice.

vLLM 0.20 chose its prefill kernel with ``use_trtllm_ragged_deepseek_prefill``,
``disable_flashinfer_prefill`` (default True) and ``use_cudnn_prefill``; later vLLM
migrated them into its own backend choice (0.21) and then removed them (0.23). They
count only when the user set no choice (``additional_config`` or
``MLA_PREFILL_BACKEND``). The selector knows nothing of them: this host reads them
and hands the selector the resulting :class:`~mla_prefill_ext.settings.Choice`,
which is not explicit (a legacy choice that cannot serve falls back to automatic
selection, with a warning, as vLLM 0.20 itself silently did).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from mla_prefill_ext._logging import log_once
from mla_prefill_ext.settings import BACKEND_ENV, Choice, user_setting

if TYPE_CHECKING:
    from mla_prefill_ext.backends.base import MLAPrefillBackend
    from mla_prefill_ext.selector import Selection

TRTLLM_SOURCE = "legacy attention_config.use_trtllm_ragged_deepseek_prefill"
FLASHINFER_SOURCE = "legacy attention_config.disable_flashinfer_prefill=False"


def legacy_choice(vllm_config: Any) -> Choice | None:
    """The backend vLLM 0.20's flags ask for, when the user set no choice (None: automatic)."""
    if user_setting(getattr(vllm_config, "additional_config", None))[0]:
        return None  # the user's setting wins, and silences the flags
    attention_config = getattr(vllm_config, "attention_config", None)
    if attention_config is None:
        return None
    if getattr(attention_config, "use_cudnn_prefill", False):
        log_once(
            logging.WARNING,
            ("legacy", "use_cudnn_prefill"),
            "attention_config.use_cudnn_prefill is deprecated and ignored: the cuDNN MLA "
            "prefill backend was removed (as in later vLLM). Selecting the MLA prefill "
            "backend automatically; set %s to choose one.",
            BACKEND_ENV,
        )
    if getattr(attention_config, "use_trtllm_ragged_deepseek_prefill", False):
        return Choice("TRTLLM_RAGGED", TRTLLM_SOURCE, False)
    if getattr(attention_config, "disable_flashinfer_prefill", True) is False:
        return Choice("FLASHINFER", FLASHINFER_SOURCE, False)
    return None


def selection_for(vllm_config: Any) -> Selection:
    """The selection for an engine configuration on vLLM 0.20: the user's choice, else the flags."""
    from mla_prefill_ext import selector

    return selector.selection_for(vllm_config, legacy_choice(vllm_config))


def backend_for(vllm_config: Any) -> type[MLAPrefillBackend]:
    """The backend class the patched layers of this engine configuration run."""
    return selection_for(vllm_config).backend
