"""The value checks: new-token and chunk outputs and LSEs against the float64 reference, at the fitted scale.

``scale`` is settled first (see ``scale.py``); each value check then compares at the scale
the backend uses, so a wrong scale is reported once, as ``scale``, and a check that cannot
be made because another failed is reported as skipped with the reason.
"""

from __future__ import annotations

import torch

from mla_prefill_ext.testing.checks.context import CaseContext
from mla_prefill_ext.testing.checks.merge import check_merge
from mla_prefill_ext.testing.checks.paths import ResultPath, chunk_paths, new_token_path
from mla_prefill_ext.testing.checks.scale import check_scale
from mla_prefill_ext.testing.checks.structure import Usability
from mla_prefill_ext.testing.conventions import pair
from mla_prefill_ext.testing.formatting import fmt
from mla_prefill_ext.testing.properties import FAIL, PASS, SKIP
from mla_prefill_ext.testing.recorder import CaseRecorder

# In the order they are recorded; one that cannot be computed fails the ones not yet recorded.
PROPS = (
    "scale",
    "new_tokens.values",
    "new_tokens.without_lse",
    "context_chunk.values",
    "lse.natural_log",
    "context_chunk.empty",
    "merge.whole_sequence",
)
EMPTY_LSE = -1e4  # an LSE at or below this gets no weight in a float32 merge (exp underflows)
FITTED_NOTE = " (at the scale the backend uses; see scale)"


def check_scale_and_values(ctx: CaseContext, rec: CaseRecorder, usable: Usability) -> None:
    """``scale``, then every value check at the scale each path uses, then the merge."""
    s0 = ctx.case.scale
    new_path, chunks = new_token_path(ctx, usable), chunk_paths(ctx, usable)
    effective = check_scale(ctx, rec, usable.outputs or usable.lse, new_path, chunks)
    note = FITTED_NOTE if rec.failed("scale") else ""
    s_new = effective.get("new tokens", s0)
    s_ctx = effective.get("context chunks", s0)
    check_new_tokens(ctx, rec, new_path, s_new, note)
    check_chunk_values(ctx, rec, chunks, s_ctx, note)
    check_natural_log(ctx, rec, [(new_path, s_new)] if rec.passed("causal") else [], chunks, s_ctx, note)
    check_empty_rows(ctx, rec)
    check_merge(ctx, rec, s_new, s_ctx, note)


def check_new_tokens(
    ctx: CaseContext, rec: CaseRecorder, new_path: ResultPath, scale: float, note: str
) -> None:
    """new_tokens.values and new_tokens.without_lse."""
    tol = ctx.tol.output_rel
    needs = ["output.shape", "output.unpadded", "causal", "varlen.isolation"]
    if not rec.blocked("new_tokens.values", needs):
        oe, rm, _, _ = new_path.errors(scale)
        rec.measured("new_tokens.values", "max |out - ref|" + note, oe, tol * rm)
    plain = ctx.main.plain
    if isinstance(plain, (tuple, list)):
        rec.add(
            "new_tokens.without_lse",
            FAIL,
            f"return_softmax_lse=False returned a {type(plain).__name__} of {len(plain)}, "
            "not the output tensor",
        )
    elif not rec.blocked("new_tokens.without_lse", needs):
        oe, rm, _, _ = ResultPath("plain", new_path.pieces, plain, None).errors(scale)
        rec.measured("new_tokens.without_lse", "max |out - ref|" + note, oe, tol * rm)


def check_chunk_values(
    ctx: CaseContext, rec: CaseRecorder, chunks: list[ResultPath], scale: float, note: str
) -> None:
    """context_chunk.values: every chunk's output, each request over its keys in the chunk."""
    if not chunks:
        rec.add("context_chunk.values", SKIP, "no context in this case")
    elif not rec.blocked("context_chunk.values", ["output.shape", "output.unpadded", "varlen.isolation"]):
        oe = rm = 0.0
        for path in chunks:
            e, m, _, _ = path.errors(scale)
            oe, rm = max(oe, e), max(rm, m)
        rec.measured("context_chunk.values", "max |out - ref|" + note, oe, ctx.tol.output_rel * rm)


def check_natural_log(
    ctx: CaseContext,
    rec: CaseRecorder,
    new_paths: list[tuple[ResultPath, float]],
    chunks: list[ResultPath],
    s_ctx: float,
    note: str,
) -> None:
    """lse.natural_log: every LSE against the reference's; says so when it is base 2 instead."""
    if rec.blocked("lse.natural_log", ["lse.layout", "varlen.isolation"]):
        return
    lse_abs = ctx.tol.lse_abs
    errs = [p.errors(s) for p, s in [*new_paths, *((cp, s_ctx) for cp in chunks)]]
    err = max((e[2] for e in errs), default=0.0)
    err2 = max((e[3] for e in errs), default=0.0)
    extra = ""
    if err > lse_abs and err2 <= lse_abs:
        extra = (
            f"the LSE is in base 2 (times ln 2 it matches to {fmt(err2)}): convert it "
            "(lse * ln 2) for merge_attn_states, which uses exp"
        )
    if not rec.passed("causal"):
        extra += ("; " if extra else "") + "new-token LSE not compared (causal failed)"
    rec.measured("lse.natural_log", "max |lse - ref|" + note, err, lse_abs, extra)


def check_empty_rows(ctx: CaseContext, rec: CaseRecorder) -> None:
    """context_chunk.empty: a request with no keys in a chunk gets LSE -inf and a finite output."""
    if not ctx.chunk_bounds:
        rec.add("context_chunk.empty", SKIP, "no context in this case")
        return
    if rec.blocked("context_chunk.empty", ["output.shape", "lse.layout"]):
        return
    bad, n = [], 0
    for c, cu in enumerate(ctx.chunk_bounds):
        out, lse = pair(ctx.main.chunks[c])
        for r in range(ctx.num_requests):
            s, e = ctx.query_bounds[r], ctx.query_bounds[r + 1]
            if cu[r + 1] > cu[r] or e == s:
                continue
            n += 1
            lr, orow = lse[:, s:e].float(), out[s:e]
            if not bool((torch.isinf(lr) | (lr <= EMPTY_LSE)).all()):
                bad.append(f"chunk {c}, request {r}: LSE max {fmt(lr.max().item())}, expected -inf")
            if not bool(torch.isfinite(orow).all()):
                bad.append(f"chunk {c}, request {r}: output not finite (NaN or inf poisons the merge)")
    if bad:
        rec.add("context_chunk.empty", FAIL, "; ".join(bad))
    else:
        rec.add("context_chunk.empty", PASS, f"{n} empty (chunk, request) pairs: LSE -inf, output finite")
