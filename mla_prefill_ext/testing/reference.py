"""A float64 reference for MLA prefill attention, and the LSE merge rule.

Used by the ``check`` command, the tests and the GPU verification suite.
"""

from __future__ import annotations

from typing import Any

import torch


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    dtype: torch.dtype = torch.float64,
    heads_per_step: int = 16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: q [Lq,H,D], k [Lk,H,D], v [Lk,H,Dv] -> out [Lq,H,Dv], lse [H,Lq] in ``dtype``.

    Causal masking is aligned bottom-right (query i sees keys up to Lk - Lq + i),
    which is how new tokens see their cached context plus themselves. Heads are
    processed a few at a time to bound the memory of the score matrix.
    """
    lq, lk, heads = q.shape[0], k.shape[0], q.shape[1]
    mask = None
    if causal:
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).triu(lk - lq + 1)
    outs, lses = [], []
    for h in range(0, heads, heads_per_step):
        hs = slice(h, h + heads_per_step)
        qd, kd, vd = (t[:, hs].to(dtype).transpose(0, 1) for t in (q, k, v))
        s = torch.matmul(qd, kd.transpose(-1, -2)) * scale
        if mask is not None:
            s = s.masked_fill(mask, float("-inf"))
        lses.append(torch.logsumexp(s, dim=-1))
        outs.append(torch.matmul(torch.softmax(s, dim=-1), vd))
    return torch.cat(outs).transpose(0, 1), torch.cat(lses)


class ScaledReference:
    """Float64 attention of one sequence at any softmax scale; the logits are computed once.

    Same inputs, masking and math as :func:`reference_attention`, for callers that need the
    reference at many scales (the conformance suite finds the scale a backend really uses).
    It keeps all heads' float64 logits (``H x Lq x Lk``): for small problems.
    """

    def __init__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool,
        dtype: torch.dtype = torch.float64,
    ) -> None:
        lq, lk = q.shape[0], k.shape[0]
        qd, kd = q.to(dtype).transpose(0, 1), k.to(dtype).transpose(0, 1)
        self.logits = torch.matmul(qd, kd.transpose(-1, -2))  # [H, Lq, Lk], unscaled
        self.v = v.to(dtype).transpose(0, 1)
        self.mask = (
            torch.ones(lq, lk, dtype=torch.bool, device=q.device).triu(lk - lq + 1) if causal else None
        )

    def __call__(self, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """out ``[Lq, H, Dv]`` and LSE ``[H, Lq]`` (natural log) at ``scale``."""
        s = self.logits * scale
        if self.mask is not None:
            s = s.masked_fill(self.mask, float("-inf"))
        return torch.matmul(torch.softmax(s, dim=-1), self.v).transpose(0, 1), torch.logsumexp(s, dim=-1)


def merge_attn_states_torch(
    prefix_output: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_output: torch.Tensor,
    suffix_lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``merge_attn_states`` rule in torch (its kernels need a GPU).

    Outputs ``[tokens, heads, dim]``, LSEs ``[heads, tokens]`` in natural log; an
    infinite LSE (a part with no keys) counts as -inf, as vLLM's kernel does.
    """
    p = torch.where(torch.isinf(prefix_lse), float("-inf"), prefix_lse.float())
    s = torch.where(torch.isinf(suffix_lse), float("-inf"), suffix_lse.float())
    m = torch.maximum(p, s)
    empty = torch.isinf(m)  # neither part has keys: vLLM's kernel emits the prefix
    m = torch.where(empty, 0.0, m)
    pw, sw = torch.exp(p - m), torch.exp(s - m)
    total = torch.where(empty, 1.0, pw + sw)
    pw = torch.where(empty, 1.0, pw)
    out = prefix_output.float() * (pw / total).transpose(0, 1).unsqueeze(-1) + suffix_output.float() * (
        sw / total
    ).transpose(0, 1).unsqueeze(-1)
    lse = torch.where(empty, float("-inf"), torch.log(total) + m)
    return out.to(prefix_output.dtype), lse


def merge_attn_states_any(
    prefix_output: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_output: torch.Tensor,
    suffix_lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's own ``merge_attn_states`` on CUDA, the torch rule elsewhere."""
    if prefix_output.is_cuda:
        from vllm.v1.attention.ops.merge_attn_states import merge_attn_states

        out = torch.empty_like(prefix_output)
        lse = torch.empty_like(prefix_lse)
        merge_attn_states(
            output=out,
            prefix_output=prefix_output,
            prefix_lse=prefix_lse,
            suffix_output=suffix_output,
            suffix_lse=suffix_lse,
            output_lse=lse,
        )
        return out, lse
    return merge_attn_states_torch(prefix_output, prefix_lse, suffix_output, suffix_lse)


def paged_latent_attention(kv_cache: torch.Tensor, scale: float, dtype: torch.dtype = torch.float64) -> Any:
    """The shared-prefix decode's ``Attend`` in plain torch, over a paged latent cache ``[blocks, block_size,
    rank + rope]`` (decode calls on a CPU, and a check of a kernel; computed in ``dtype``)."""
    cache = kv_cache.reshape(kv_cache.shape[0] * kv_cache.shape[1], -1)
    block_size = kv_cache.shape[1]

    def attend(q_pe, q_nope, block_table, seq_lens, cu_queries, max_queries, max_keys, causal):
        rank = q_nope.shape[-1]
        heads = q_pe.shape[1]
        # FA3 reads no further than max_seqlen_q/k: a bound below a sequence's length is a wrong answer there
        if int(seq_lens.max()) > max_keys or int((cu_queries[1:] - cu_queries[:-1]).max()) > max_queries:
            raise ValueError(f"max_keys {max_keys} / max_queries {max_queries} below a sequence's length")
        outs, lses = [], []
        for i in range(seq_lens.shape[0]):
            lo, hi, n = int(cu_queries[i]), int(cu_queries[i + 1]), int(seq_lens[i])
            pages = block_table[i, : -(-n // block_size)].long()
            slots = (pages.view(-1, 1) * block_size + torch.arange(block_size)).view(-1)[:n]
            keys = cache[slots]  # [n, rank + rope]
            q = torch.cat([q_nope[lo:hi], q_pe[lo:hi]], dim=-1)
            k = torch.cat([keys[:, :rank], keys[:, rank:]], dim=-1).unsqueeze(1).expand(n, heads, -1)
            v = keys[:, :rank].unsqueeze(1).expand(n, heads, -1)
            o, s = reference_attention(q, k, v, scale, causal, dtype)
            outs.append(o.to(q_pe.dtype))
            lses.append(s.float())
        return torch.cat(outs), torch.cat(lses, dim=1)

    return attend
