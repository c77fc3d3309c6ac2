"""Per layer: the context part of a step that has a shared-prefix plan, in place of vLLM's loop.

``MLACommonImpl._compute_prefill_context`` returns the context's output and LSE over the step's
prefill queries; with a plan (:mod:`.step`) :func:`mla_prefill_ext.shared_prefix.compute_context`
returns the same two from the shared segments and the private chunks, and ``forward_mha`` merges
them with the new tokens as before. Without a plan vLLM's own code runs, untouched.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from mla_prefill_ext.hosts.core.shared_prefix.step import STEP_ATTR
from mla_prefill_ext.mla_layers import MLA_MODULE
from mla_prefill_ext.shared_prefix import (
    LatentLayout,
    LayerContext,
    compute_context,
    gather_latent,
    vllm_merge,
)


def _arg(args: Any, kwargs: Any, name: str, index: int) -> Any:
    return kwargs[name] if name in kwargs else args[index]


def _kv_b_proj_input(impl: Any) -> Any:
    """``impl.kv_b_proj`` taking latent rows in the dtype vLLM's own context loop gives it.

    vLLM 0.29+ has a helper for it; before, the loop casts to the weight's dtype unless the weight is
    FP8 (the layer quantizes a model-dtype input itself) or packed uint8 (NVFP4).
    """
    import torch

    kv_b_proj = impl.kv_b_proj
    helper = getattr(sys.modules[MLA_MODULE], "_get_kv_b_proj_input_dtype", None)
    if helper is not None:
        dtype = helper(kv_b_proj, False)
    else:
        from vllm.platforms import current_platform

        weight = getattr(kv_b_proj, "weight", None)
        weight_dtype = weight.dtype if weight is not None else getattr(kv_b_proj, "params_dtype", None)
        keep = weight_dtype in (current_platform.fp8_dtype(), torch.uint8) or weight is None
        dtype = None if keep else weight_dtype
    if dtype is None:
        return kv_b_proj
    return lambda latent: kv_b_proj(latent.to(dtype))


_CACHED = "_mla_shared_layer_parts"


def _projection_key(impl: Any) -> tuple[Any, Any]:
    kv_b_proj = impl.kv_b_proj
    return kv_b_proj, getattr(getattr(kv_b_proj, "weight", None), "dtype", None)


def _layer_parts(impl: Any) -> tuple[Any, LatentLayout, Any]:
    """The impl's projection, dims and merge, made once per impl: the layer's host time is on a
    step's critical path when the forward is host-bound (eager). Made again when the impl's
    ``kv_b_proj`` or its weight's dtype changes (a module replaced or requantized after loading).
    Nothing here refers back to the impl (no bound method: the impl and its weights must go when
    vLLM drops them, without waiting for the cycle collector)."""
    key = _projection_key(impl)
    cached = impl.__dict__.get(_CACHED)
    if cached is None or cached[0] is not key[0] or cached[1] != key[1]:
        parts = (
            _kv_b_proj_input(impl),
            LatentLayout(impl.num_heads, impl.kv_lora_rank, impl.qk_nope_head_dim, impl.v_head_dim),
            # The merge kernel vLLM's own context loop calls: the MLA module's binding.
            functools.partial(vllm_merge, kernel=sys.modules[MLA_MODULE].merge_attn_states),
        )
        cached = (*key, parts)
        impl.__dict__[_CACHED] = cached
    return cached[2]


def layer_context(impl: Any, kv_cache: Any, k_scale: Any, workspace: Any) -> LayerContext:
    """What the shared path reads of vLLM's impl for one call: its cache, projection, dims and merge."""
    kv_b_proj, dims, merge = _layer_parts(impl)
    return LayerContext(
        kv_cache=kv_cache,
        kv_b_proj=kv_b_proj,
        dims=dims,
        workspace=workspace,
        merge=merge,
        gather=functools.partial(gather_latent, kv_cache_dtype=impl.kv_cache_dtype, scale=k_scale),
        concat_k=impl._concat_k_nope_k_pe,
    )


def compute_prefill_context(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    """``MLACommonImpl._compute_prefill_context(q, kv_c_and_k_pe_cache, attn_metadata, k_scale)``."""
    attn_metadata = _arg(args, kwargs, "attn_metadata", 2)
    prefill = getattr(attn_metadata, "prefill", None)
    step = getattr(prefill, STEP_ATTR, None)
    if step is None:
        return wrapped(*args, **kwargs)
    q = _arg(args, kwargs, "q", 0)
    layer = layer_context(
        instance,
        _arg(args, kwargs, "kv_c_and_k_pe_cache", 1),
        _arg(args, kwargs, "k_scale", 3),
        prefill.chunked_context.workspace,
    )
    step_backend, segment_backend = step.instances_for(instance)
    return compute_context(q, step.plan, prefill.block_table, step_backend, segment_backend, layer)
