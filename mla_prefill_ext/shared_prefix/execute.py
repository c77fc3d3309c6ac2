"""The context part of one MLA layer with a step's plan: shared segments once, then private passes.

Returns what vLLM's ``_compute_prefill_context`` returns (output ``[tokens, heads, v_head_dim]``,
LSE ``[heads, tokens]`` float32 natural log, over the step's prefill queries), so that a host
can call it in its place and merge with the new tokens as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from mla_prefill_ext.backend_errors import note_backend_error
from mla_prefill_ext.backends.base import MLAPrefillBackend
from mla_prefill_ext.shared_prefix.plan import ContextPass, ContextPlan

Merge = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""``merge(prefix_out, prefix_lse, suffix_out, suffix_lse) -> (out, lse)``, vLLM's LSE rule."""


class LatentLayout(NamedTuple):
    """The layer's MLA dims (vLLM's attention impl has them as attributes of the same names)."""

    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    v_head_dim: int


def gather_latent(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    one_pass: ContextPass,
    workspace: torch.Tensor,
    kv_cache_dtype: str = "auto",
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The pass's latent rows (``[total, kv_lora_rank + rope]``), written into ``workspace``.

    ``kv_cache``: ``[blocks, block_size, kv_lora_rank + rope]``; ``block_table`` row ``j`` is
    sequence ``j`` of the pass. On CUDA vLLM's own gather kernel, as ``_compute_prefill_context``
    calls it (``scale``: the layer's ``k_scale``, which the kernel needs); elsewhere torch
    indexing, for an unquantized cache.
    """
    total = one_pass.total
    if kv_cache.is_cuda:
        from vllm import _custom_ops as ops

        if scale is None:  # the kernel reads a scale tensor even for an unquantized cache
            scale = torch.ones(1, dtype=torch.float32, device=kv_cache.device)

        ops.gather_and_maybe_dequant_cache(
            src_cache=kv_cache,
            dst=workspace,
            block_table=block_table,
            cu_seq_lens=one_pass.cu_seq_lens,
            token_to_seq=one_pass.token_to_seq,
            num_tokens=total,
            kv_cache_dtype=kv_cache_dtype,
            scale=scale,
            seq_starts=one_pass.starts,
        )
        return workspace[:total]
    if kv_cache_dtype != "auto":
        raise NotImplementedError(f"a {kv_cache_dtype} KV cache is gathered on CUDA only")
    block_size = kv_cache.shape[1]
    seq = one_pass.token_to_seq.long()
    offset = torch.arange(total) - one_pass.cu_seq_lens.long()[seq]
    pos = one_pass.starts.long()[seq] + offset
    slots = block_table.long()[seq, pos // block_size] * block_size + pos % block_size
    workspace[:total] = kv_cache.reshape(-1, kv_cache.shape[-1])[slots]
    return workspace[:total]


def up_project(
    kv_b_proj: Callable[[torch.Tensor], Any],
    latent: torch.Tensor,
    dims: LatentLayout,
    concat_k: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K ``[tokens, heads, nope + rope]`` and V ``[tokens, heads, v]`` from latent rows, as vLLM does.

    ``kv_b_proj`` is the layer's (a vLLM linear layer returns ``(out, bias)``; a tensor is taken
    as is); dtype handling of quantized weights stays with the caller's callable. ``concat_k``:
    the impl's ``_concat_k_nope_k_pe(k_nope, k_pe)`` (``k_pe`` ``[tokens, 1, rope]``); default
    ``torch.cat``.
    """
    kv_c, k_pe = latent[..., : dims.kv_lora_rank], latent[..., dims.kv_lora_rank :]
    out = kv_b_proj(kv_c)
    out = out[0] if isinstance(out, tuple) else out
    kv_nope = out.view(-1, dims.num_heads, dims.qk_nope_head_dim + dims.v_head_dim)
    k_nope, v = kv_nope.split([dims.qk_nope_head_dim, dims.v_head_dim], dim=-1)
    k_pe = k_pe.unsqueeze(1).to(k_nope.dtype)
    if concat_k is not None:
        return concat_k(k_nope, k_pe), v
    return torch.cat((k_nope, k_pe.expand(-1, dims.num_heads, -1)), dim=-1), v


class LayerContext(NamedTuple):
    """What one layer's context part reads besides the plan: vLLM's impl holds all of it.

    ``gather``: :func:`gather_latent` or the same with ``kv_cache_dtype``/``scale`` bound
    (``functools.partial``); ``merge``: :func:`vllm_merge` on a GPU; ``concat_k``: see
    :func:`up_project`.
    """

    kv_cache: torch.Tensor
    kv_b_proj: Callable[[torch.Tensor], Any]
    dims: LatentLayout
    workspace: torch.Tensor
    merge: Merge
    gather: Callable[..., torch.Tensor] = gather_latent
    concat_k: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None


def _run_passes(
    backend: MLAPrefillBackend,
    q: torch.Tensor,
    passes: tuple[ContextPass, ...],
    block_table: torch.Tensor,
    layer: LayerContext,
    kind: str,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    out = lse = None
    for i, one_pass in enumerate(passes):
        latent = layer.gather(layer.kv_cache, block_table, one_pass, layer.workspace)
        k, v = up_project(layer.kv_b_proj, latent, layer.dims, layer.concat_k)
        try:
            o, l_ = backend.run_prefill_context_chunk(i, q, k, v)
        except Exception as e:  # never caught: named, it stops the engine in vLLM's worker
            note_backend_error(
                e, backend, f"run_prefill_context_chunk, shared-prefix {kind} pass {i}", q=q, k=k, v=v
            )
            raise
        out, lse = (o, l_) if out is None else layer.merge(out, lse, o, l_)
    return out, lse


def compute_context(
    q: torch.Tensor,
    plan: ContextPlan,
    prefill_block_table: torch.Tensor,
    step_backend: MLAPrefillBackend,
    segment_backend: MLAPrefillBackend | None,
    layer: LayerContext,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the step's prefill queries ``q`` over their cached context, by ``plan``.

    ``plan`` (its tensors on ``q``'s device, :meth:`ContextPlan.to`): its shared segments run on
    ``segment_backend`` (prepared by :class:`~mla_prefill_ext.shared_prefix.views.SegmentInstance`)
    with the members' query rows, its private passes on ``step_backend`` (prepared after
    :func:`~mla_prefill_ext.shared_prefix.views.attach_private_chunks`) with all of ``q``;
    ``prefill_block_table`` holds the step's prefill rows. ``layer.workspace``: vLLM's context
    workspace, at least as many rows as the largest pass.
    """
    out = lse = None
    if plan.has_segments:
        if segment_backend is None:
            raise RuntimeError("the plan has shared segments but no segment backend was prepared")
        if plan.members_are_all_rows and q.shape[0] == plan.num_query_tokens:  # q and the output as they are
            out, lse = _run_passes(
                segment_backend, q, plan.segment_passes, plan.segment_block_table, layer, "segment"
            )
        else:
            rows = plan.member_rows
            seg_out, seg_lse = _run_passes(
                segment_backend, q[rows], plan.segment_passes, plan.segment_block_table, layer, "segment"
            )
            assert seg_out is not None and seg_lse is not None
            # Rows of requests in no group: no keys here (-inf), as a request with no context in a chunk.
            out = seg_out.new_zeros(q.shape[0], *seg_out.shape[1:])
            lse = seg_lse.new_full((seg_lse.shape[0], q.shape[0]), float("-inf"))
            out[rows] = seg_out
            lse[:, rows] = seg_lse
    priv_out, priv_lse = _run_passes(
        step_backend, q, plan.private_passes, prefill_block_table, layer, "private"
    )
    if priv_out is not None:
        out, lse = (priv_out, priv_lse) if out is None else layer.merge(out, lse, priv_out, priv_lse)
    if out is None or lse is None:
        raise RuntimeError("compute_context ran for a step without cached context")
    return out, lse


def vllm_merge(
    prefix_out: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_out: torch.Tensor,
    suffix_lse: torch.Tensor,
    kernel: Callable[..., None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``merge_attn_states`` (CUDA or Triton: a GPU), as its context loop calls it.

    ``kernel``: the binding to call (a host passes the MLA module's own, the one vLLM's loop calls).
    """
    if kernel is None:
        from vllm.v1.attention.ops.merge_attn_states import merge_attn_states as kernel

    out, lse = torch.empty_like(prefix_out), torch.empty_like(prefix_lse)
    kernel(
        output=out,
        prefix_output=prefix_out,
        prefix_lse=prefix_lse,
        suffix_output=suffix_out,
        suffix_lse=suffix_lse,
        output_lse=lse,
    )
    return out, lse
