"""causal and varlen.isolation: perturb keys and values a token must not see; its results must not move.

They compare with the unperturbed main step, not with a reference, so they hold whatever
the scale or the LSE convention, and a wrong scale is never reported as a masking bug.
"""

from __future__ import annotations

import torch

from mla_prefill_ext.testing.checks.context import CaseContext
from mla_prefill_ext.testing.compare import max_abs_diff
from mla_prefill_ext.testing.conventions import StepResult, pair
from mla_prefill_ext.testing.formatting import fmt
from mla_prefill_ext.testing.problem import PrefillProblem
from mla_prefill_ext.testing.properties import FAIL, PASS
from mla_prefill_ext.testing.recorder import CaseRecorder


def perturbed(ctx: CaseContext, rows_new: list[slice], rows_chunk: list[list[slice]]) -> PrefillProblem:
    """A copy of the main problem with the keys and values of ``rows_new`` (and per chunk) changed."""
    p = ctx.problem.clone()
    for r in rows_new:
        p.k[r] = p.k[r] * 2 + 3
        p.v[r] += 8
    for c, rs in enumerate(rows_chunk):
        for r in rs:
            p.chunk_k[c][r] = p.chunk_k[c][r] * 2 + 3
            p.chunk_v[c][r] += 8
    return p


def probe_diff(
    ctx: CaseContext, step: StepResult, rows: list[slice], chunks: bool
) -> tuple[float, float, float, float]:
    """(max |Δout|, out tolerance, max |ΔLSE|, lse tolerance) over ``rows``, vs the main step."""
    T, H = ctx.tokens, ctx.heads
    pairs = [(pair(ctx.main.new), pair(step.new))]
    if chunks:
        pairs += [(pair(a), pair(b)) for a, b in zip(ctx.main.chunks, step.chunks, strict=True)]
    dout = dlse = ref_max = 0.0
    for (o0, l0), (o1, l1) in pairs:
        for r in rows:
            if isinstance(o0, torch.Tensor) and isinstance(o1, torch.Tensor) and o0.shape == o1.shape:
                if o0.dim() >= 1 and o0.shape[0] == T:
                    dout = max(dout, max_abs_diff(o0[r], o1[r], nan_equal=True))
                    ref_max = max(ref_max, torch.nan_to_num(o0[r].double()).abs().max().item())
            if isinstance(l0, torch.Tensor) and isinstance(l1, torch.Tensor) and l0.shape == (H, T):
                if l1.shape == l0.shape:
                    dlse = max(dlse, max_abs_diff(l0[:, r], l1[:, r], nan_equal=True))
    return dout, ctx.tol.output_rel * ref_max, dlse, ctx.tol.lse_abs


def probe(
    ctx: CaseContext,
    rec: CaseRecorder,
    prop: str,
    p: PrefillProblem,
    rows: list[slice],
    chunks: bool,
    what: str,
) -> bool:
    """Run a step on ``p``; record ``prop`` failed (and return False) if ``rows`` moved."""
    step = ctx.driver.step(ctx.backend, p, with_lse=True, plain=None)
    if step.error:
        rec.add(prop, FAIL, f"the probe step raised: {step.error}")
        return False
    dout, out_tol, dlse, lse_tol = probe_diff(ctx, step, rows, chunks)
    if dout > out_tol or dlse > lse_tol:
        out_worse = dout / max(out_tol, 1e-300) >= dlse / lse_tol
        rec.add(
            prop,
            FAIL,
            f"{what}: their output moved by max {fmt(dout)} (tolerance {fmt(out_tol)}), "
            f"their LSE by max {fmt(dlse)} (tolerance {fmt(lse_tol)})",
            dout if out_worse else dlse,
            out_tol if out_worse else lse_tol,
        )
        return False
    return True


def check_causal(ctx: CaseContext, rec: CaseRecorder) -> None:
    # One request at a time, so that attention across requests (varlen.isolation's) cannot show here.
    no_chunk_rows: list[list[slice]] = [[] for _ in ctx.chunk_bounds]
    for r in range(ctx.num_requests):
        s, e = ctx.query_bounds[r], ctx.query_bounds[r + 1]
        if e - s < 2:
            continue
        m = s + (e - s) // 2
        ok = probe(
            ctx,
            rec,
            "causal",
            perturbed(ctx, [slice(m, e)], no_chunk_rows),
            [slice(s, m)],
            chunks=False,
            what=f"with the second half of request {r}'s new tokens perturbed, its first half must not "
            "change (new tokens see later tokens)",
        )
        if not ok:
            return
    rec.add("causal", PASS, "earlier tokens unchanged when later new tokens are perturbed")


def check_isolation(ctx: CaseContext, rec: CaseRecorder) -> None:
    n = ctx.num_requests
    for r in (0, n - 1):
        rows_chunk = [[slice(cu[r], cu[r + 1])] for cu in ctx.chunk_bounds]
        others = [ctx.request_rows(j) for j in range(n) if j != r]
        ok = probe(
            ctx,
            rec,
            "varlen.isolation",
            perturbed(ctx, [ctx.request_rows(r)], rows_chunk),
            others,
            chunks=True,
            what=f"with request {r}'s keys and values perturbed (new tokens and context), the other "
            "requests must not change (attention crosses requests)",
        )
        if not ok:
            return
    rec.add("varlen.isolation", PASS, "other requests unchanged when one request is perturbed")
