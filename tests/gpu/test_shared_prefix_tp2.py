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
import re
from pathlib import Path

import pytest

from scripts.gpu_harness import engine_runner, scenarios, verdict

pytestmark = pytest.mark.gpu

RESULTS_DIRS = [Path(p) for p in (os.environ.get("MLA_GPU_RESULTS") or "").split(os.pathsep) if p]
STOCK = ("stock-shared-tp2", "stock-shared-ray")  # short extends on vLLM's decode path
# ... on its prefill path: three lifetimes, as on one GPU
STOCK_PREFILL = ("stock-shared-prefill-tp2", "stock-shared-prefill-tp2-2", "stock-shared-prefill-tp2-3")
ON = ("shim-fa-shared-tp2", "shim-fa-shared-ray")
OFF = ("shim-fa-shared-off-tp2", "shim-fa-shared-off-ray")
MUTANT = "mutant-shared-segment-scale-tp2"
PARITY = [*[(c, s) for c in ON for s in STOCK_PREFILL], *[(c, s) for c in OFF for s in STOCK]]
LIFETIME_SPREAD_CAP = 0.25  # as on one GPU (tests/gpu/test_shared_prefix.py)
BLOCK_SLACK = 64
WORKER_LINE = re.compile(r"\((?:RayWorkerWrapper|RayWorkerProc|Worker_TP\d+) pid=(\d+)[^)]*\)(.*)")
ON_LINE = "MLA shared-prefix prefill (mla-prefill-ext): on ("
OFF_LINE = "MLA shared-prefix prefill (mla-prefill-ext): off (turned off by MLA_PREFILL_SHARED_PREFIX"
FIRST_SHARED_STEP = "MLA shared-prefix prefill (mla-prefill-ext): the first step with a shared prefix"


def runs(name: str) -> list[tuple[Path, dict]]:
    found = [(d, data) for d in RESULTS_DIRS if (data := scenarios.load(d, name)) is not None]
    if not found:
        pytest.skip(f"scenario {name} was not run (results in {RESULTS_DIRS or 'MLA_GPU_RESULTS unset'})")
    return found


def completed(name: str) -> list[tuple[Path, dict]]:
    done = [(d, data) for d, data in runs(name) if data.get("ok")]
    assert done, f"no completed run of {name}: {runs(name)[-1][1].get('error')}"
    return done


def log_of(name: str) -> str:
    return scenarios.log_text(completed(name)[-1][0], name)


def worker_pids(name: str, text: str) -> set[int]:
    """The worker processes (Ray actors or vLLM's TP workers) whose log lines contain ``text``."""
    return {int(m.group(1)) for m in WORKER_LINE.finditer(log_of(name)) if text in m.group(2)}


@functools.cache
def calibrations(group: tuple[str, ...]) -> list[verdict.Verdict]:
    lifetimes = [(f"{n} ({d.name})", engine_runner.records(data)) for n in group for d, data in completed(n)]
    assert len(lifetimes) >= 2, f"stock's spread needs two lifetimes of {group}, found {len(lifetimes)}"
    return verdict.lifetime_calibrations(lifetimes)


def judge(reference: str) -> list[verdict.Verdict]:
    spread = calibrations(STOCK_PREFILL if reference in STOCK_PREFILL else STOCK)
    bound = verdict.lifetime_bound(spread)
    assert bound <= LIFETIME_SPREAD_CAP, (
        f"stock's own TP=2 spread gives {bound:.3g}, above {LIFETIME_SPREAD_CAP}"
    )
    return spread


def compare(candidate: str, reference: str) -> verdict.Verdict:
    """The candidate's every completed run against the reference's runs: each must match one of them."""
    spread = judge(reference)
    worst = []
    for cd, c in completed(candidate):
        tried = [
            verdict.lifetime_noise(
                engine_runner.records(c),
                engine_runner.records(r),
                spread,
                label=f"{candidate} ({cd.name}) vs {reference} ({rd.name})",
            )
            for rd, r in completed(reference)
        ]
        passing = [v for v in tried if v.passed]
        worst.append(passing[0] if passing else min(tried, key=lambda v: v.max_diff))
    failed = [v for v in worst if not v.passed]
    return failed[0] if failed else worst[0]


@pytest.mark.parametrize("name", [*STOCK, *STOCK_PREFILL, *ON, *OFF, MUTANT])
def test_the_prefix_is_served_from_the_cache(name):
    data = completed(name)[-1][1]
    assert data["weights"] == "sharp" and data["args"]["tp"] == 2, data["args"]
    sets = engine_runner.shared_prompt_sets()
    for key in engine_runner.SHARED_SETS:
        records = data["results"][key]
        assert [r["prompt_len"] for r in records] == [len(p) for p in sets[key]], key
        cached = engine_runner.shared_cached_tokens(key)
        assert all(r["num_cached_tokens"] >= cached - BLOCK_SLACK for r in records), key


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
    assert bound <= LIFETIME_SPREAD_CAP


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
    assert ev["max_segment_tokens"] >= engine_runner.SHARED_PREFIX - BLOCK_SLACK, ev
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
    off = worker_pids("shim-fa-shared-off-ray", OFF_LINE)
    assert len(off) == 2, off
    assert not worker_pids("shim-fa-shared-off-ray", FIRST_SHARED_STEP)
    assert not worker_pids("shim-fa-shared-off-ray", ON_LINE)
    assert completed("shim-fa-shared-off-tp2")[-1][1]["shared_context"]["calls"] == 0
    assert OFF_LINE in log_of("shim-fa-shared-off-tp2")


@pytest.mark.parametrize("name", [*STOCK, *STOCK_PREFILL])
def test_stock_runs_unpatched(name):
    log = log_of(name)
    # The add-on names itself in every line it logs; vLLM 0.25+ logs its own "Using X MLA prefill backend."
    assert "mla-prefill-ext" not in log and "MLA prefill backend (" not in log
