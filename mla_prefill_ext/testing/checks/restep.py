"""metadata.restep: one instance prepared for steps of other shapes gives what a fresh instance gives."""

from __future__ import annotations

from typing import Any

import torch

from mla_prefill_ext.backends.base import MLAPrefillBackend
from mla_prefill_ext.testing.cases import RESTEP_SHAPES
from mla_prefill_ext.testing.checks.context import BackendDriver, CaseContext
from mla_prefill_ext.testing.compare import max_abs_diff
from mla_prefill_ext.testing.conventions import StepResult, pair
from mla_prefill_ext.testing.formatting import fmt, shape_str
from mla_prefill_ext.testing.problem import PrefillProblem
from mla_prefill_ext.testing.properties import FAIL, PASS
from mla_prefill_ext.testing.recorder import CaseRecorder
from mla_prefill_ext.testing.tolerances import Tolerance


def as_vllm_runs(driver: BackendDriver, backend: MLAPrefillBackend, prob: PrefillProblem) -> StepResult:
    """A step on a copy of ``prob``: with LSE and the chunks when it has context, else without LSE."""
    c = prob.clone()
    has_ctx = prob.has_context
    return driver.step(backend, c, with_lse=has_ctx, plain=None if has_ctx else c)


def fresh_step(driver: BackendDriver, prob: PrefillProblem) -> StepResult:
    try:
        return as_vllm_runs(driver, driver.new_backend(), prob)
    except Exception as e:
        return StepResult(error=f"constructing raised {type(e).__name__}: {e}")


def describe(label: str, prob: PrefillProblem) -> str:
    return f"{label}: {len(prob.new_lens)} requests, new tokens {prob.new_lens}, " + (
        f"context {prob.context_lens} in {len(prob.chunk_k)} chunks" if prob.has_context else "no context"
    )


def result_pairs(prob: PrefillProblem, got: StepResult, fresh: StepResult) -> list[tuple[str, Any, Any]]:
    """(what, reused instance's result, fresh instance's) of every call the step made."""
    if prob.has_context:
        return [("new tokens", got.new, fresh.new)] + [
            (f"chunk {i}", x, y) for i, (x, y) in enumerate(zip(got.chunks, fresh.chunks, strict=True))
        ]
    return [("new tokens without LSE", got.plain, fresh.plain)]


class RestepFindings:
    """Every difference from a fresh instance, and the worst (measured, tolerance) among them."""

    def __init__(self, tol: Tolerance) -> None:
        self.tol = tol
        self.problems: list[str] = []
        self.differences: list[tuple[float, float]] = []

    @property
    def worst(self) -> tuple[float, float]:
        # The first difference furthest over its tolerance, as the report's measured value.
        return max([(0.0, 0.0), *self.differences], key=lambda x: x[0] / max(x[1], 1e-300))

    def step_raised(self, desc: str, error: str) -> None:
        self.problems.append(f"{desc}: {error}")

    def compare(self, desc: str, what: str, a: Any, b: Any) -> None:
        """The reused instance's result ``a`` against a fresh instance's ``b``, output and LSE."""
        for part, x, y in zip(("output", "LSE"), pair(a), pair(b), strict=True):
            if not isinstance(y, torch.Tensor):
                continue
            if not isinstance(x, torch.Tensor) or x.shape != y.shape:
                self.problems.append(
                    f"{desc}: {what} {part} shape {shape_str(x)}, a fresh instance's {shape_str(y)}"
                )
                continue
            d = max_abs_diff(x, y, nan_equal=True)
            tol = (
                self.tol.lse_abs
                if part == "LSE"
                else self.tol.output_rel * torch.nan_to_num(y.double(), posinf=0, neginf=0).abs().max().item()
            )
            if d > tol:
                self.problems.append(
                    f"{desc}: {what} {part} differs from a fresh instance's by {fmt(d)} "
                    f"(tolerance {fmt(tol)})"
                )
                self.differences.append((d, tol))


def check_restep(ctx: CaseContext, rec: CaseRecorder) -> None:
    """Steps of other shapes on one instance; each must equal a fresh instance's step."""
    driver = ctx.driver
    try:
        reused = driver.new_backend()
    except Exception as e:
        rec.add("metadata.restep", FAIL, f"constructing a second instance raised {type(e).__name__}: {e}")
        return
    sequence: list[tuple[str, PrefillProblem, StepResult | None]] = [
        (f"step {i + 2}", driver.problem(new, ctx_lens, chunks), None)
        for i, (new, ctx_lens, chunks) in enumerate(RESTEP_SHAPES)
    ]
    sequence.append((f"step {len(sequence) + 2} (the first shapes again)", ctx.problem, ctx.main))
    as_vllm_runs(driver, reused, ctx.problem)  # step 1: the main shapes, as the first step
    findings = RestepFindings(ctx.tol)
    for label, prob, fresh in sequence:
        got = as_vllm_runs(driver, reused, prob)
        fresh = fresh or fresh_step(driver, prob)
        desc = describe(label, prob)
        if got.error:
            findings.step_raised(desc, got.error)
            continue
        if fresh.error:
            continue  # a fresh instance fails too: not a restep problem (runs covers the main shapes)
        for what, a, b in result_pairs(prob, got, fresh):
            if b is not None:
                findings.compare(desc, what, a, b)
    if findings.problems:
        worst = findings.worst
        rec.add(
            "metadata.restep",
            FAIL,
            "the backend carries state of an earlier step: " + "; ".join(findings.problems),
            worst[0] if worst[1] else None,
            worst[1] if worst[1] else None,
        )
    else:
        rec.add("metadata.restep", PASS, f"{len(sequence)} further steps equal fresh instances'")
