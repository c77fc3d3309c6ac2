"""vLLM's engine-core scheduler objects, built for real on the CPU: a KV cache of one MLA group and a
``Scheduler`` over it (its class as the configuration picks it), and the requests its input thread
decodes. Constructors differ across vLLM releases: each is given the keyword arguments its release takes."""

from __future__ import annotations

from typing import Any

import torch
from vllm_runner_objects import accepted


def mla_kv_cache_config(num_blocks: int, block_size: int) -> Any:
    """One MLA group (576-wide latent rows, bf16) of ``num_blocks`` blocks."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec

    spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)],
    )


def scheduler(vllm_config: Any, num_blocks: int, block_size: int) -> Any:
    """The scheduler ``EngineCore.__init__`` would make for ``vllm_config`` over such a KV cache."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    vllm_config.cache_config.num_gpu_blocks = num_blocks  # as EngineCore._initialize_kv_caches sets it
    cls = vllm_config.scheduler_config.get_scheduler_cls()  # AsyncScheduler passes **kwargs on
    return cls(
        **accepted(
            Scheduler,
            vllm_config=vllm_config,
            kv_cache_config=mla_kv_cache_config(num_blocks, block_size),
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=block_size,
            hash_block_size=block_size,
            include_finished_set=False,
            log_stats=False,
        )
    )


def engine_core_request(request_id: str, tokens: list[int], max_tokens: int = 1) -> Any:
    """What vLLM's input thread decodes from the driver for a plain prompt (``max_tokens`` output tokens)."""
    import time

    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=list(tokens),
        mm_features=None,
        sampling_params=SamplingParams(max_tokens=max_tokens),
        pooling_params=None,
        arrival_time=time.time(),
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
    )
