"""Runs every check on one case: constructs the backend, runs the main step, then each family in turn."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

import torch

from mla_prefill_ext.backends.base import MLAPrefillBackend
from mla_prefill_ext.testing.cases import CONTEXT_LENS, NEW_LENS, NUM_CHUNKS, ConformanceCase
from mla_prefill_ext.testing.checks import inputs, probes, restep, structure, values
from mla_prefill_ext.testing.checks.context import BackendDriver, CaseContext
from mla_prefill_ext.testing.conventions import CallingConvention
from mla_prefill_ext.testing.properties import FAIL, PASS
from mla_prefill_ext.testing.recorder import CaseRecorder
from mla_prefill_ext.testing.report import CheckResult

T = TypeVar("T")


def guarded(rec: CaseRecorder, props: Iterable[str], check: Callable[[], T]) -> T | None:
    """``check()``; if what the backend returned defeats the comparison itself, fail its ``props``."""
    try:
        return check()
    except Exception as e:
        rec.fail_unrecorded(
            props, f"could not be checked on what the backend returned: {type(e).__name__}: {e}"
        )
        return None


def check_case(
    cls: type[MLAPrefillBackend],
    case: ConformanceCase,
    device: torch.device,
    seed: int,
    kv_lora_rank: int,
    convention: CallingConvention,
) -> list[CheckResult]:
    """Every property on ``case``, in the report's order of families."""
    rec = CaseRecorder(case.label)
    driver = BackendDriver(cls, case, device, seed, kv_lora_rank, convention)
    problem = driver.problem(NEW_LENS, CONTEXT_LENS, NUM_CHUNKS)
    pristine = inputs.snapshot(problem)
    try:
        backend = driver.new_backend()
    except Exception as e:
        rec.add(
            "runs", FAIL, f"constructing {cls.__name__}(**{driver.kwargs}) raised {type(e).__name__}: {e}"
        )
        rec.skip_rest("not evaluated: the backend could not be constructed")
        return rec.results
    new_inputs, plain_inputs = problem.clone(), problem.clone()
    main = driver.step(backend, new_inputs, with_lse=True, plain=plain_inputs)
    if main.error:
        rec.add("runs", FAIL, main.error)
        rec.skip_rest("not evaluated: the step raised")
        return rec.results
    rec.add("runs", PASS, "constructed; prepare_metadata, new tokens (with and without LSE), chunks ran")
    ctx = CaseContext.of(driver, problem, backend, main)
    guarded(rec, inputs.PROPS, lambda: inputs.check_inputs(rec, pristine, new_inputs, plain_inputs))
    # Which results the value checks can use; none when the structure could not be checked.
    usable = (
        guarded(rec, structure.PROPS, lambda: structure.check_structure(ctx, rec)) or structure.NOTHING_USABLE
    )
    guarded(rec, ["causal"], lambda: probes.check_causal(ctx, rec))
    guarded(rec, ["varlen.isolation"], lambda: probes.check_isolation(ctx, rec))
    guarded(rec, values.PROPS, lambda: values.check_scale_and_values(ctx, rec, usable))
    guarded(rec, ["metadata.restep"], lambda: restep.check_restep(ctx, rec))
    return rec.results
