"""Real vLLM 0.20 objects on a machine without a GPU: a tiny DeepSeek-V2, its MLA layers, step metadata.

For tests and benchmarks of the add-on's host-side work. Every vLLM class stays real. The
"unspecified" platform of a CPU box has no attention backend and no device facts, so exactly
those lookups are patched (:func:`gpu_view`): the MLA decode backend (vLLM's real TRITON_MLA
classes), the device capability and the compute-unit count.
"""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch

TINY_DEEPSEEK_V2 = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "vocab_size": 1024,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "scoring_func": "softmax",
    "norm_topk_prob": False,
    "aux_loss_alpha": 0.001,
    "seq_aux": True,
    "bos_token_id": 0,
    "eos_token_id": 1,
}

YARN_ROPE_SCALING = {
    "type": "yarn",
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def write_model_dir(root: Path, **overrides: Any) -> Path:
    """A model folder holding only ``config.json``: the tiny DeepSeek-V2 with ``overrides``."""
    cfg = {**TINY_DEEPSEEK_V2, **overrides}
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg))
    return root


def make_vllm_config(model_dir: Path, dtype: str = "bfloat16", **kwargs: Any) -> Any:
    """vLLM's own ``VllmConfig`` for the model in ``model_dir``, on the CPU device (no tokenizer)."""
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, VllmConfig

    model_config = ModelConfig(
        model=str(model_dir), dtype=dtype, skip_tokenizer_init=True, max_model_len=2048
    )
    return VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(block_size=16),
        device_config=DeviceConfig(device="cpu"),
        **kwargs,
    )


_DIST_READY = False


def ensure_distributed(vllm_config: Any) -> None:
    """A one-process gloo group, so vLLM's parallel layers can be built."""
    global _DIST_READY
    if _DIST_READY:
        return
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_distributed_environment(
        world_size=1,
        rank=0,
        distributed_init_method=f"tcp://127.0.0.1:{port}",
        local_rank=0,
        backend="gloo",
    )
    with set_current_vllm_config(vllm_config):
        initialize_model_parallel(1, 1)
    _DIST_READY = True


@contextlib.contextmanager
def gpu_view(capability: tuple[int, int] | None = (9, 0)) -> Iterator[None]:
    """Patch the device facts the unspecified platform lacks; keep vLLM's classes real."""
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend

    cap = None if capability is None else DeviceCapability(*capability)
    with contextlib.ExitStack() as stack:
        stack.enter_context(
            mock.patch.object(
                type(current_platform), "get_device_capability", classmethod(lambda cls, device_id=0: cap)
            )
        )
        stack.enter_context(
            mock.patch(
                "vllm.model_executor.layers.attention.mla_attention.get_attn_backend",
                lambda *a, **k: TritonMLABackend,
            )
        )
        stack.enter_context(
            mock.patch.object(
                type(current_platform), "num_compute_units", classmethod(lambda cls, device_id=0: 132)
            )
        )
        yield


def build_deepseek_attention(vllm_config: Any, prefix: str = "model.layers.0.self_attn") -> Any:
    """vLLM's own DeepseekV2MLAAttention module, built under the given config."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2MLAAttention

    ensure_distributed(vllm_config)
    cfg = vllm_config.model_config.hf_config
    with set_current_vllm_config(vllm_config):
        return DeepseekV2MLAAttention(
            vllm_config=vllm_config,
            config=cfg,
            hidden_size=cfg.hidden_size,
            num_heads=cfg.num_attention_heads,
            qk_nope_head_dim=cfg.qk_nope_head_dim,
            qk_rope_head_dim=cfg.qk_rope_head_dim,
            v_head_dim=cfg.v_head_dim,
            q_lora_rank=cfg.q_lora_rank,
            kv_lora_rank=cfg.kv_lora_rank,
            max_position_embeddings=cfg.max_position_embeddings,
            cache_config=vllm_config.cache_config,
            quant_config=None,
            prefix=prefix,
        )


def mla_layer(attention_module: Any) -> Any:
    """The MLAAttention layer inside vLLM's DeepSeek attention module."""
    return attention_module.mla_attn.mla_attn


def prefill_batch(
    new_lens: list[int],
    context_lens: list[int] | None = None,
    block_table: torch.Tensor | None = None,
    block_size: int = 16,
    table_width: int = 8,
    req_idx: Any = None,
) -> Any:
    """vLLM's per-step metadata for prefills of ``new_lens`` tokens after ``context_lens`` cached ones.

    Without a block table: one dummy table and consecutive slots (no KV cache is read). ``req_idx``:
    each row's request in the V2 runner (vLLM 0.33+), as its metadata carries it.
    """
    from vllm.v1.attention.backend import CommonAttentionMetadata

    context_lens = context_lens or [0] * len(new_lens)
    loc = torch.tensor([0, *torch.tensor(new_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([n + c for n, c in zip(new_lens, context_lens, strict=True)], dtype=torch.int32)
    total = int(loc[-1])
    if block_table is None:
        block_table = torch.zeros(len(new_lens), table_width, dtype=torch.int32)
        slot_mapping = torch.arange(total, dtype=torch.int64)
    else:
        slot_mapping = torch.cat(
            [
                slots(block_table[r], range(c, c + n), block_size)
                for r, (n, c) in enumerate(zip(new_lens, context_lens, strict=True))
            ]
        )
    return CommonAttentionMetadata(
        query_start_loc=loc,
        query_start_loc_cpu=loc.clone(),
        seq_lens=seq_lens,
        num_reqs=len(new_lens),
        num_actual_tokens=total,
        max_query_len=max(new_lens),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=block_table,
        slot_mapping=slot_mapping,
        seq_lens_cpu_upper_bound=seq_lens.clone(),
        **({} if req_idx is None else {"req_idx": req_idx}),
    )


def slots(table_row: torch.Tensor, positions: range, block_size: int) -> torch.Tensor:
    """KV-cache slots of a request's token positions through its block-table row."""
    pos = torch.tensor(list(positions), dtype=torch.int64)
    return table_row.long()[pos // block_size] * block_size + pos % block_size
