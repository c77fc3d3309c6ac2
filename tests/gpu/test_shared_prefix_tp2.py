"""Shared-prefix parity at TP=2 (issue 27): vLLM's multiprocessing executor and a Ray cluster started
beforehand, with the path on and off, against stock vLLM at TP=2 on the sharp checkpoint.

Reads ``python -m scripts.gpu_harness.session shared-multi`` results from ``MLA_GPU_RESULTS`` (skipped
where a scenario was not run). The judge is the single-GPU one (tests/gpu/test_shared_prefix.py):
within stock's own spread across lifetimes, here TP=2 lifetimes. The path on routes short extends to
vLLM's prefill path, so it is compared with stock's prefill-path lifetimes (``stock-shared-prefill-tp2*``,
the decode threshold lowered by a test-only wrapper that reaches forked workers); the path off with
stock as shipped (multiprocessing and Ray). Ray's workers are not forked from the runner, so for the
Ray runs their own log lines (prefixed with the worker's pid) say which path each rank took.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

from scripts.gpu_harness import engine_runner, scenarios, verdict
from tests.gpu import recorded_runs

pytestmark = pytest.mark.gpu

RESULTS_DIRS = [Path(p) for p in (os.environ.get("MLA_GPU_RESULTS") or "").split(os.pathsep) if p]
STOCK = ("stock-shared-tp2", "stock-shared-ray")  # short extends on vLLM's decode path
# ... on its prefill path. Three lifetimes, as on one GPU: the first TP=2 record had two, and the path on
# left their bound on one of them (docs/results/h200-2026-12-04-tp2-controls); a pass needs a run with three.
STOCK_PREFILL = ("stock-shared-prefill-tp2", "stock-shared-prefill-tp2-2", "stock-shared-prefill-tp2-3")
ON = ("shim-fa-shared-tp2", "shim-fa-shared-ray")
OFF = ("shim-fa-shared-off-tp2", "shim-fa-shared-off-ray")
MUTANT = "mutant-shared-segment-scale-tp2"
PARITY = [*[(c, s) for c in ON for s in STOCK_PREFILL], *[(c, s) for c in OFF for s in STOCK]]
ON_LINE = "MLA shared-prefix prefill (mla-prefill-ext): on ("
OFF_LINE = "MLA shared-prefix prefill (mla-prefill-ext): off (turned off by MLA_PREFILL_SHARED_PREFIX"
FIRST_SHARED_STEP = "MLA shared-prefix prefill (mla-prefill-ext): the first step with a shared prefix"


def recorded(name: str) -> bool:
    return any(scenarios.load(d, name) is not None for d in RESULTS_DIRS)


def completed(name: str) -> list[tuple[Path, dict]]:
    """The scenario's completed runs; skipped where it was not run (the Ray ones need a cluster started
    beforehand, so they are never run from here), failing where it ran and failed."""
    found = [(d, data) for d in RESULTS_DIRS if (data := scenarios.load(d, name)) is not None]
    if not found:
        pytest.skip(f"scenario {name} was not run (results in {RESULTS_DIRS or 'MLA_GPU_RESULTS unset'})")
    done = [(d, data) for d, data in found if data.get("ok")]
    assert done, f"no completed run of {name}: {found[-1][1].get('error')}"
    return done


def log_of(name: str) -> str:
    return scenarios.log_text(completed(name)[-1][0], name)


def worker_pids(name: str, text: str) -> set[int]:
    return recorded_runs.worker_pids_in(log_of(name), text)


@functools.cache
def calibrations(group: tuple[str, ...]) -> list[verdict.Verdict]:
    """Stock against stock over the group's lifetimes that were run (at least two): one lifetime lost
    with a lease does not turn the verdicts that need the group into skips."""
    present = [n for n in group if recorded(n)]
    lifetimes = [
        (f"{n} ({d.name})", engine_runner.records(data)) for n in present for d, data in completed(n)
    ]
    assert len(lifetimes) >= 2, f"stock's spread needs two lifetimes of {group}, found {len(lifetimes)}"
    return verdict.lifetime_calibrations(lifetimes)


def compare(candidate: str, reference: str) -> verdict.Verdict:
    """recorded_runs.check with stock's TP=2 lifetime spread as the bound (its runs are all recorded)."""
    completed(candidate)  # skip where not run, before check would try to run them
    completed(reference)
    spread = calibrations(STOCK_PREFILL if reference in STOCK_PREFILL else STOCK)
    return recorded_runs.check(
        "lifetime_noise", candidate, reference, judge=recorded_runs.lifetime_judge(spread)
    )


@pytest.mark.parametrize("name", [*STOCK, *STOCK_PREFILL, *ON, *OFF, MUTANT])
def test_the_prefix_is_served_from_the_cache(name):
    data = completed(name)[-1][1]
    assert data["args"]["tp"] == 2, data["args"]
    recorded_runs.assert_shared_prefix_served(data)


@pytest.mark.parametrize("group", [STOCK, STOCK_PREFILL], ids=["decode-path", "prefill-path"])
def test_stocks_own_tp2_spread_is_measured_and_bounded(group):
    spread = calibrations(group)
    for v in spread:
        print(
            f"stock against stock (TP=2): {v.label}: "
            f"max |logprob diff| {v.max_diff:.4g}, {len(v.flips)} flip(s)"
        )
    bound = verdict.lifetime_bound(spread)
    print(f"lifetime bound for {group}: {bound:.4g}")
    recorded_runs.lifetime_judge(spread)  # within the cap


@pytest.mark.parametrize(("candidate", "reference"), PARITY, ids=[f"{c}-vs-{r}" for c, r in PARITY])
def test_parity_with_every_tp2_stock_run(candidate, reference):
    v = compare(candidate, reference)
    print(v)
    assert v.passed, str(v)


@pytest.mark.parametrize("reference", [*STOCK_PREFILL, *STOCK])
def test_a_wrong_shared_path_fails_the_same_check_at_tp2(reference):
    v = compare(MUTANT, reference)
    print(f"{MUTANT} (expected to FAIL):\n{v}")
    assert not v.passed, f"the verdict cannot tell {MUTANT} from {reference}: {v}"


@pytest.mark.parametrize("name", ["shim-fa-shared-tp2", MUTANT])
def test_both_tp_workers_took_the_shared_path(name):
    """Evidence written from inside the engine's worker processes by the runner's shared-context wrapper."""
    ev = completed(name)[-1][1]["shared_context"]
    print(name, "shared context:", ev)
    assert ev["ran_in_engine_process"] and len(ev["pids"]) == 2, ev
    assert ev["calls_with_segments"] > 0 and ev["max_members"] >= 2, ev
    assert ev["max_segment_tokens"] >= engine_runner.SHARED_PREFIX - recorded_runs.BLOCK_SLACK, ev
    assert ev["max_short_extend_members"] >= 2, ev  # short extends routed to the prefill path


def test_both_ray_workers_took_the_shared_path():
    """The Ray cluster was started without the add-on's variables: each rank found the path on by itself
    and planned a shared step."""
    on = worker_pids("shim-fa-shared-ray", ON_LINE)
    assert len(on) == 2, on
    assert worker_pids("shim-fa-shared-ray", FIRST_SHARED_STEP) == on


def test_the_off_switch_reaches_every_worker():
    """MLA_PREFILL_SHARED_PREFIX=0 set in the driver only: both Ray ranks and both TP ranks say off and
    none plans a shared step."""
    for name in OFF:
        off = worker_pids(name, OFF_LINE)
        assert len(off) == 2, (name, off)
        assert not worker_pids(name, FIRST_SHARED_STEP) and not worker_pids(name, ON_LINE), name
    assert completed("shim-fa-shared-off-tp2")[-1][1]["shared_context"]["calls"] == 0


def test_ray_and_multiprocessing_give_the_same_tokens_with_the_path_on():
    """The executor changes nothing in the numbers: the path on under Ray is the path on under mp."""
    v = verdict.identical(
        engine_runner.records(completed("shim-fa-shared-ray")[-1][1]),
        engine_runner.records(completed("shim-fa-shared-tp2")[-1][1]),
        label="shim-fa-shared-ray vs shim-fa-shared-tp2",
    )
    print(v)
    assert v.passed, str(v)


@pytest.mark.parametrize("name", STOCK_PREFILL)
def test_the_prefill_path_references_lowered_the_threshold_on_both_ranks(name):
    ev = completed(name)[-1][1]["decode_threshold"]
    assert ev["ran_in_engine_process"] and len(ev["pids"]) == 2, ev
    assert ev["thresholds"] == [1] and max(ev["stock_thresholds"]) > 1, ev  # FLASH_ATTN_MLA: 512


@pytest.mark.parametrize("name", [*STOCK, *STOCK_PREFILL])
def test_stock_runs_unpatched(name):
    recorded_runs.assert_unpatched(log_of(name))
