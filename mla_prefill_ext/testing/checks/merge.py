"""merge.whole_sequence: chunks and new tokens merged in vLLM's order equal attention over the sequence.

Merging uses vLLM's own ``merge_attn_states`` on CUDA. vLLM's op needs CUDA or Triton (on a
CPU its Triton path fails: Triton has no CPU driver), so elsewhere
:func:`mla_prefill_ext.testing.reference.merge_attn_states_torch` is used: the same rule in
torch, with the kernel's float32 arithmetic, output dtype and treatment of infinite LSEs
(empty parts).
"""

from __future__ import annotations

import torch

from mla_prefill_ext.testing.checks.context import CaseContext
from mla_prefill_ext.testing.checks.scale import SAME_SCALE
from mla_prefill_ext.testing.compare import max_abs_diff
from mla_prefill_ext.testing.conventions import pair, synchronize
from mla_prefill_ext.testing.properties import FAIL, SKIP
from mla_prefill_ext.testing.recorder import CaseRecorder
from mla_prefill_ext.testing.reference import ScaledReference, merge_attn_states_any

# A failure of these makes a wrong merged result expected: the report says so.
UPSTREAM = (
    "causal",
    "varlen.isolation",
    "lse.natural_log",
    "new_tokens.values",
    "context_chunk.values",
    "context_chunk.empty",
)


def merged_step(ctx: CaseContext) -> torch.Tensor:
    """The main step's chunks merged in order, then merged with the new tokens, as ``forward_mha`` does."""
    outs = [pair(c) for c in ctx.main.chunks]
    ctx_out, ctx_lse = outs[0]
    for o, lse in outs[1:]:
        ctx_out, ctx_lse = merge_attn_states_any(ctx_out, ctx_lse, o, lse)
    new_out, new_lse = pair(ctx.main.new)
    merged, _ = merge_attn_states_any(ctx_out, ctx_lse, new_out, new_lse)
    synchronize(ctx.driver.device)
    return merged


def check_merge(ctx: CaseContext, rec: CaseRecorder, s_new: float, s_ctx: float, note: str) -> None:
    """At the scale the new tokens (``s_new``) and the chunks (``s_ctx``) were found to use."""
    if rec.blocked("merge.whole_sequence", ["output.shape", "output.unpadded", "lse.layout"]):
        return
    if not ctx.chunk_bounds:
        rec.add("merge.whole_sequence", SKIP, "no context in this case")
        return
    # One scale for the whole sequence: the paths' own, when they agree.
    s0 = ctx.case.scale
    s = (s_new + s_ctx) / 2 if abs(s_new / s_ctx - 1) < SAME_SCALE else s0
    compare_merged(ctx, rec, s, note if s != s0 else "")


def compare_merged(ctx: CaseContext, rec: CaseRecorder, scale: float, note: str) -> None:
    """The merged step against the reference over each request's whole sequence at ``scale``."""
    p, qb, cb = ctx.problem, ctx.query_bounds, ctx.chunk_bounds
    try:
        merged = merged_step(ctx)
    except Exception as e:
        rec.add("merge.whole_sequence", FAIL, f"merge_attn_states raised {type(e).__name__}: {e}")
        return
    err = ref_max = 0.0
    for r in range(ctx.num_requests):
        s, e = qb[r], qb[r + 1]
        if e == s:
            continue
        ks = [p.chunk_k[c][cu[r] : cu[r + 1]] for c, cu in enumerate(cb)] + [p.k[s:e]]
        vs = [p.chunk_v[c][cu[r] : cu[r + 1]] for c, cu in enumerate(cb)] + [p.v[s:e]]
        ref, _ = ScaledReference(p.q[s:e], torch.cat(ks), torch.cat(vs), causal=True)(scale)
        err = max(err, max_abs_diff(merged[s:e], ref))
        ref_max = max(ref_max, ref.abs().max().item())
    tol = ctx.tol.output_rel * ref_max
    upstream = [prop for prop in UPSTREAM if rec.failed(prop)]
    extra = f"expected, given {', '.join(upstream)}" if upstream and err > tol else ""
    rec.measured("merge.whole_sequence", "max |merged - ref|" + note, err, tol, extra)
