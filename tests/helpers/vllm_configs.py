"""Real vLLM configurations carrying a user's choice, as the selector reads them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm.config import AttentionConfig

from mla_prefill_ext.testing import vllm_host as host

# A model that does not use MLA (its config.json): engines of it are not the add-on's.
LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 1,
    "vocab_size": 1000,
    "max_position_embeddings": 2048,
    "torch_dtype": "bfloat16",
}


def config(model_dir: Path, mla_prefill_backend: str | None = None, **attention: Any) -> Any:
    """A real VllmConfig (bf16) with the given additional_config choice and attention flags."""
    additional = {} if mla_prefill_backend is None else {"mla_prefill_backend": mla_prefill_backend}
    return host.make_vllm_config(
        model_dir, additional_config=additional, attention_config=AttentionConfig(**attention)
    )
