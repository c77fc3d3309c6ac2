"""Synthetic MLA prefill problems built on vLLM's own prefill metadata classes.

The ``check`` command, the tests, the GPU suite and the benchmark run backends
on these: new tokens of several requests, optionally with cached context split
into chunks, exactly as vLLM's MLA metadata builder would describe them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from mla_prefill_ext.testing.reference import merge_attn_states_any, reference_attention


def deepseek_yarn_scale(qk_head_dim: int = 192, factor: float = 40.0, mscale_all_dim: float = 0.707) -> float:
    """DeepSeek-V2-Lite's softmax scale: qk_head_dim**-0.5 times the YaRN mscale squared."""
    mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0 if factor > 1 else 1.0
    return qk_head_dim**-0.5 * mscale * mscale


@dataclass
class PrefillProblem:
    """New tokens ``q/k/v`` plus per-chunk context ``k/v``, and vLLM's metadata for them."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    chunk_k: list[torch.Tensor]
    chunk_v: list[torch.Tensor]
    metadata: Any
    new_lens: list[int]
    context_lens: list[int]
    full_k: list[torch.Tensor]  # per request: context then new tokens
    full_v: list[torch.Tensor]

    @property
    def has_context(self) -> bool:
        return bool(self.chunk_k)

    def reference(self, scale: float, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """Attention of each request's new tokens over its whole sequence, in ``dtype``."""
        outs, start = [], 0
        for i, n in enumerate(self.new_lens):
            q = self.q[start : start + n]
            out, _ = reference_attention(q, self.full_k[i], self.full_v[i], scale, causal=True, dtype=dtype)
            outs.append(out)
            start += n
        return torch.cat(outs)

    def query_bounds(self) -> list[int]:
        """Token offsets of the requests in ``q``/``k``/``v``: ``[0, n0, n0 + n1, ...]``."""
        return [0, *torch.tensor(self.new_lens).cumsum(0).tolist()]

    def chunk_bounds(self) -> list[list[int]]:
        """Per context chunk, the offsets of the requests' keys in ``chunk_k[i]``/``chunk_v[i]``."""
        from mla_prefill_ext.backends.base import context_chunks

        return [c.cu_seq_lens_cpu.tolist() for c in context_chunks(self.metadata)]

    def clone(self) -> PrefillProblem:
        """A copy with fresh tensors in the same layouts (V stays a kv_b_proj tail); metadata shared."""

        def copy_v(t: torch.Tensor) -> torch.Tensor:
            lead = t.stride(-2) - t.shape[-1] if t.dim() == 3 and t.stride(-1) == 1 else 0
            return kv_b_proj_tail(t.clone(), lead) if lead > 0 else t.clone()

        return PrefillProblem(
            self.q.clone(),
            self.k.clone(),
            copy_v(self.v),
            [t.clone() for t in self.chunk_k],
            [copy_v(t) for t in self.chunk_v],
            self.metadata,
            list(self.new_lens),
            list(self.context_lens),
            [t.clone() for t in self.full_k],
            [t.clone() for t in self.full_v],
        )

    def flops(self, new_tokens: bool = True, context: bool = True) -> float:
        """Attention FLOPs (QK^T and PV) of the new tokens (causal half) and/or the context."""
        d_qk, d_v, heads = self.q.shape[-1], self.v.shape[-1], self.q.shape[1]
        total = 0.0
        for n, c in zip(self.new_lens, self.context_lens, strict=True):
            pairs = (n * (n + 1) / 2 if new_tokens else 0) + (n * c if context else 0)
            total += 2.0 * heads * pairs * (d_qk + d_v)
        return total


def kv_b_proj_tail(v: torch.Tensor, lead: int) -> torch.Tensor:
    """``v`` laid out as vLLM hands it to prefill: the tail of kv_b_proj's per-head rows.

    vLLM splits ``[k_nope | v]`` per head, so V is a strided view with ``lead`` columns in
    front of it. They are NaN here: a backend that reads them (FLASH_ATTN's copy-free
    widening of V) must keep them out of its result, and a test would see if it did not.
    """
    rows = torch.full((*v.shape[:-1], lead + v.shape[-1]), float("nan"), dtype=v.dtype, device=v.device)
    rows[..., lead:] = v
    return rows[..., lead:]


def make_problem(
    new_lens: list[int],
    context_lens: list[int] | None = None,
    num_chunks: int = 2,
    num_heads: int = 16,
    qk_nope_head_dim: int = 128,
    qk_rope_head_dim: int = 64,
    v_head_dim: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> PrefillProblem:
    from vllm.model_executor.layers.attention.mla_attention import MLACommonPrefillMetadata

    context_lens = context_lens or [0] * len(new_lens)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    d_qk = qk_nope_head_dim + qk_rope_head_dim

    def rand(n: int, d: int) -> torch.Tensor:
        return torch.randn(n, num_heads, d, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)

    full_k = [rand(c + n, d_qk) for n, c in zip(new_lens, context_lens, strict=True)]
    full_v = [rand(c + n, v_head_dim) for n, c in zip(new_lens, context_lens, strict=True)]
    q = rand(sum(new_lens), d_qk)
    k = torch.cat([fk[c:] for fk, c in zip(full_k, context_lens, strict=True)])
    v = torch.cat([fv[c:] for fv, c in zip(full_v, context_lens, strict=True)])
    query_start_loc = torch.tensor([0, *torch.tensor(new_lens).cumsum(0).tolist()], dtype=torch.int32)

    chunked = None
    add_on_chunks = None
    chunk_k: list[torch.Tensor] = []
    chunk_v: list[torch.Tensor] = []
    if max(context_lens) > 0:
        cs = math.ceil(max(context_lens) / num_chunks)
        starts = torch.arange(num_chunks, dtype=torch.int32).unsqueeze(1) * cs
        starts = starts.expand(-1, len(new_lens))
        ends = torch.minimum(torch.tensor(context_lens, dtype=torch.int32).unsqueeze(0), starts + cs)
        seq_lens = (ends - starts).clamp(min=0).to(torch.int32)
        cu = torch.zeros(num_chunks, len(new_lens) + 1, dtype=torch.int32)
        torch.cumsum(seq_lens, dim=1, out=cu[:, 1:])
        for i in range(num_chunks):
            chunk_k.append(
                torch.cat(
                    [fk[starts[i, j] : ends[i, j].clamp(min=starts[i, j])] for j, fk in enumerate(full_k)]
                )
            )
            chunk_v.append(
                torch.cat(
                    [fv[starts[i, j] : ends[i, j].clamp(min=starts[i, j])] for j, fv in enumerate(full_v)]
                )
            )
        totals = cu[:, -1]
    if chunk_k and not _per_chunk_lists(MLACommonPrefillMetadata.ChunkedContextMetadata):
        # vLLM 0.29+ describes chunks as objects over their own requests' query rows; a
        # problem keeps the add-on's view of them (what context_chunks() gives a backend).
        from mla_prefill_ext.backends.base import ContextChunk

        add_on_chunks = [
            ContextChunk(
                index=i,
                query_start_loc=query_start_loc.to(device),
                max_query_len=max(new_lens),
                cu_seq_lens=cu[i].to(device),
                cu_seq_lens_cpu=cu[i],
                max_seq_len=int(seq_lens[i].max()),
                seq_lens=seq_lens[i],
            )
            for i in range(num_chunks)
        ]
    elif chunk_k:
        chunked = MLACommonPrefillMetadata.ChunkedContextMetadata(
            cu_seq_lens=cu.to(device),
            starts=starts.contiguous().to(device),
            seq_tot=totals.tolist(),
            max_seq_lens=seq_lens.max(dim=1).values.tolist(),
            seq_lens=seq_lens,
            workspace=torch.empty(0, device=device),
            token_to_seq=torch.empty(0, dtype=torch.int32, device=device),
            chunk_total_token=totals.tolist(),
        )
    metadata = MLACommonPrefillMetadata(
        block_table=torch.empty(0, dtype=torch.int32, device=device),
        query_start_loc=query_start_loc.to(device),
        max_query_len=max(new_lens),
        chunked_context=chunked,
        q_data_type=dtype,
        output_dtype=dtype,
    )
    if add_on_chunks is not None:
        metadata.mla_prefill_context_chunks = add_on_chunks
    v = kv_b_proj_tail(v, qk_nope_head_dim)
    chunk_v = [kv_b_proj_tail(c, qk_nope_head_dim) for c in chunk_v]
    return PrefillProblem(
        q, k, v, chunk_k, chunk_v, metadata, list(new_lens), list(context_lens), full_k, full_v
    )


def _per_chunk_lists(chunked_context_cls: type) -> bool:
    """Whether vLLM's ChunkedContextMetadata has the per-chunk lists of vLLM 0.20-0.27."""
    return "max_seq_lens" in getattr(chunked_context_cls, "__dataclass_fields__", {})


def run_backend(backend: Any, problem: PrefillProblem) -> torch.Tensor:
    """One MLA prefill step as vLLM's ``forward_mha`` runs it: new tokens, chunks, merges."""
    backend.prepare_metadata(problem.metadata)
    if not problem.has_context:
        return backend.run_prefill_new_tokens(problem.q, problem.k, problem.v, False)
    suffix, suffix_lse = backend.run_prefill_new_tokens(problem.q, problem.k, problem.v, True)
    ctx_out = ctx_lse = None
    for i, (kc, vc) in enumerate(zip(problem.chunk_k, problem.chunk_v, strict=True)):
        out, lse = backend.run_prefill_context_chunk(i, problem.q, kc, vc)
        if ctx_out is None:
            ctx_out, ctx_lse = out, lse
        else:
            ctx_out, ctx_lse = merge_attn_states_any(ctx_out, ctx_lse, out, lse)
    merged, _ = merge_attn_states_any(ctx_out, ctx_lse, suffix, suffix_lse)
    return merged
