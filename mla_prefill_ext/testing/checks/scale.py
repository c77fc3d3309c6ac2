"""scale: the softmax scale the backend really uses, found by fitting the reference to its results.

A path's output and LSE (LSE in either base) are compared with the reference at the
backend's ``self.scale``; where they differ, the scale that fits them is searched for, and
the value checks are then made at that scale, so that a wrong scale is reported once.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from mla_prefill_ext.testing.checks.context import CaseContext
from mla_prefill_ext.testing.checks.paths import ResultPath
from mla_prefill_ext.testing.formatting import fmt
from mla_prefill_ext.testing.properties import FAIL, PASS, SKIP
from mla_prefill_ext.testing.recorder import CaseRecorder
from mla_prefill_ext.testing.tolerances import Tolerance

SAME_SCALE = 2e-3  # fitted scales closer than this (relative) are one scale


def fit(norm_err: Callable[[float], float], s0: float) -> tuple[float, float]:
    """The scale in [s0/4, 4 s0] that minimises ``norm_err``: a log grid, then golden section."""
    grid = [s0 * 2.0 ** (x / 8.0) for x in range(-16, 17)]
    errs = [norm_err(s) for s in grid]
    i = min(range(len(grid)), key=errs.__getitem__)
    lo, hi = math.log(grid[max(i - 1, 0)]), math.log(grid[min(i + 1, len(grid) - 1)])
    g = (math.sqrt(5) - 1) / 2
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = norm_err(math.exp(a)), norm_err(math.exp(b))
    for _ in range(30):
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = norm_err(math.exp(a))
        else:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = norm_err(math.exp(b))
    best = min([(errs[i], grid[i]), (fa, math.exp(a)), (fb, math.exp(b))])
    return best[1], best[0]


def norm_err(
    tol: Tolerance, paths: list[ResultPath], scale: float
) -> tuple[float, float, float, float, float]:
    """(normalised error, out err, out tol, lse err (best base), lse tol) of ``paths`` at ``scale``."""
    out_err = ref_max = lse_err = 0.0
    has_out = has_lse = False
    for path in paths:
        oe, rm, le, le2 = path.errors(scale)
        if path.lse is not None:
            le = min(le, le2)  # either base: the base is lse.natural_log's business
            has_lse = True
        has_out = has_out or path.out is not None
        out_err, ref_max, lse_err = max(out_err, oe), max(ref_max, rm), max(lse_err, le)
    out_tol = tol.output_rel * ref_max
    norm = max(
        out_err / out_tol if has_out and out_tol > 0 else 0.0,
        lse_err / tol.lse_abs if has_lse else 0.0,
    )
    return norm, out_err, out_tol, lse_err, tol.lse_abs


class ScaleFit:
    """The outcome of fitting each group of paths: which use self.scale, which another, which none."""

    def __init__(self) -> None:
        self.effective: dict[str, float] = {}  # group -> the scale its values are checked at
        self.fails: list[tuple[str, float, str]] = []  # (group, fitted scale, errors at self.scale)
        self.undetermined: list[str] = []
        self.passes: list[str] = []
        self.misfits: list[tuple[float, float]] = []  # (measured, tolerance) of each group off at self.scale

    @property
    def worst(self) -> tuple[float, float]:
        """The misfit furthest over its tolerance ((0, 0) if none)."""
        return max([(0.0, 0.0), *self.misfits], key=lambda x: x[0] / max(x[1], 1e-300))

    def add_group(self, tol: Tolerance, name: str, paths: list[ResultPath], s0: float) -> None:
        norm, oe, ot, le, lt = norm_err(tol, paths, s0)
        at_s0 = (
            f"max |out - ref| = {fmt(oe)} (tolerance {fmt(ot)}), "
            f"max |lse - ref| = {fmt(le)} (tolerance {fmt(lt)})"
        )
        if norm <= 1.0:
            self.effective[name] = s0
            self.passes.append(name)
            return
        best, best_norm = fit(lambda s: norm_err(tol, paths, s)[0], s0)
        self.misfits.append((oe, ot) if oe / max(ot, 1e-300) >= le / lt else (le, lt))
        if best_norm <= 1.0:
            self.effective[name] = best
            self.fails.append((name, best, at_s0))
        else:
            self.undetermined.append(f"{name}: no scale in [self.scale/4, 4 x self.scale] fits ({at_s0})")


def check_scale(
    ctx: CaseContext, rec: CaseRecorder, usable: bool, new_path: ResultPath, chunk_paths: list[ResultPath]
) -> dict[str, float]:
    """Record ``scale``; return the scale to check each group's values at (self.scale where none)."""
    s0 = ctx.case.scale
    groups: list[tuple[str, list[ResultPath]]] = []
    if rec.passed("causal"):
        groups.append(("new tokens", [new_path]))
    if chunk_paths:
        groups.append(("context chunks", chunk_paths))
    isolated = not rec.failed("varlen.isolation")
    result = ScaleFit()
    for name, paths in groups if usable and isolated else []:
        result.add_group(ctx.tol, name, paths, s0)
    if not isolated:
        rec.blocked("scale", ["varlen.isolation"])
    elif not usable or not groups:
        rec.add(
            "scale",
            SKIP,
            "not evaluated: neither outputs nor LSEs are usable"
            if not usable
            else "not evaluated: no path to check",
        )
    elif result.fails:
        rec.add("scale", FAIL, scale_message(ctx, result.fails), result.worst[0], result.worst[1])
    elif result.undetermined:
        rec.add("scale", SKIP, "not determined (see the value checks): " + "; ".join(result.undetermined))
    else:
        rec.add("scale", PASS, f"self.scale {s0:.6g} used ({', '.join(result.passes)})")
    return result.effective


def scale_message(ctx: CaseContext, fails: list[tuple[str, float, str]]) -> str:
    s0 = ctx.case.scale
    bests = [b for _, b, _ in fails]
    if max(bests) / min(bests) - 1 < SAME_SCALE:  # one wrong scale for every path
        best = sum(bests) / len(bests)
        fitted = [(" and ".join(n for n, _, _ in fails), best)]
    else:
        fitted = [(n, b) for n, b, _ in fails]
    parts = [
        f"{names} compute with scale {b:.6g} = {b / s0:.4f} x self.scale {s0:.6g}{known_scale(ctx, b)}"
        for names, b in fitted
    ]
    at_s0 = "; ".join(f"{n}: {a}" for n, _, a in fails)
    return "; ".join(parts) + f" (at self.scale, {at_s0})"


def known_scale(ctx: CaseContext, s: float) -> str:
    """' = <name>' when ``s`` is a scale a backend commonly uses by mistake."""
    nope, rope, v = ctx.case.dims
    for name, value in (
        ("1/sqrt(qk_head_dim), the default scale: self.scale is ignored", (nope + rope) ** -0.5),
        ("1/sqrt(v_head_dim)", v**-0.5),
        ("1/sqrt(qk_nope_head_dim)", nope**-0.5),
        ("1", 1.0),
    ):
        if abs(s / value - 1) < 5e-3:
            return f" = {name}"
    return ""
