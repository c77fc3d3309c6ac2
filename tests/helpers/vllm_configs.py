"""Real vLLM configurations carrying a user's choice, as the selector reads them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm.config import AttentionConfig

from mla_prefill_ext.testing import vllm_host as host


def config(model_dir: Path, mla_prefill_backend: str | None = None, **attention: Any) -> Any:
    """A real VllmConfig (bf16) with the given additional_config choice and attention flags."""
    additional = {} if mla_prefill_backend is None else {"mla_prefill_backend": mla_prefill_backend}
    return host.make_vllm_config(
        model_dir, additional_config=additional, attention_config=AttentionConfig(**attention)
    )
