"""Shared-prefix decode rows: parity with stock vLLM on the tiny DeepSeek-V2 (sharp weights), issue 51.

The ``*-shared-decode`` scenarios (scripts/gpu_harness/scenarios.py) run the runner's ``shared_decode`` prompt
set, eager (decode rows are served only where vLLM runs attention in Python): 16 requests over one cached
2048-token prefix, each extending it past vLLM's decode threshold, then 128 greedy tokens each, so that every
decode step after their prefill holds one group of 16 rows over the prefix. With decode rows on
(``shim-fa-shared-decode``; the runner lowers their crossover to any two rows sharing a block, so that the
tiny model's steps are served) the add-on must stay within the spread of vLLM's own decodes of these rows:
two stock lifetimes (``stock-shared-decode``, ``-2``) and vLLM's FlashMLA decode (``stock-shared-decode-
flashmla``; stock's FA3 decode is bit-identical across lifetimes, so only another kernel of vLLM's shows how
far a reordered sum of the same attention lands), never below the bf16 bound; three deliberately wrong
decode rows (the
shared call over pages that are not the prefix, left out of the merge, at a softmax scale 2% off) must fail
the same verdict against each. The runner's evidence, written from inside the engine process, shows the
groups served. With MLA_GPU_RESULTS the tests replay recorded results on any machine (skipped where a
scenario was not run there); what the runner adds is checked on the CPU in
tests/gpu_harness/test_shared_decode_scenarios.py.
"""

from __future__ import annotations

import pytest

from scripts.gpu_harness import engine_runner, scenarios, verdict
from tests.gpu.recorded_runs import (
    BLOCK_SLACK,
    assert_unpatched,
    check,
    lifetime_judge,
    log_of,
    ran,
    stock_calibrations,
)

pytestmark = pytest.mark.gpu

STOCK = scenarios.SHARED_DECODE_STOCK
OTHER_KERNEL = scenarios.SHARED_DECODE_OTHER_KERNEL
CALIBRATION = (*STOCK, OTHER_KERNEL)  # vLLM's own decodes of these rows, each pair: the spread allowed
CANDIDATE = "shim-fa-shared-decode"
MUTANTS = [n for n in scenarios.DECODE_SCENARIOS if n.startswith("mutant-")]


@pytest.mark.parametrize("name", scenarios.DECODE_SCENARIOS)
def test_every_request_decodes_long_over_the_cached_prefix(name):
    data = ran(name)
    assert data["weights"] == "sharp", "parity must run on the sharp checkpoint"
    sets = engine_runner.shared_decode_prompt_sets()
    for key in engine_runner.SHARED_DECODE_SETS:
        records = data["results"][key]
        assert [r["prompt_len"] for r in records] == [len(p) for p in sets[key]], key
        assert all(len(r["tokens"]) == len(r["top2"]) == engine_runner.DECODE_MAX_TOKENS for r in records)
    cached = [r["num_cached_tokens"] for r in data["results"]["shared_decode"]]
    assert min(cached) >= engine_runner.DECODE_PREFIX - BLOCK_SLACK, cached


def test_stocks_own_spread_on_this_set_is_measured_and_bounded():
    spread = stock_calibrations(CALIBRATION)
    for v in spread:
        print(f"stock against stock: {v.label}: max |logprob diff| {v.max_diff:.4g}, {len(v.flips)} flip(s)")
    print(f"lifetime bound: {verdict.lifetime_bound(spread):.4g}")
    lifetime_judge(spread)  # within the cap


@pytest.mark.parametrize("reference", STOCK)
def test_decode_rows_on_match_every_stock_run(reference):
    v = check("lifetime_noise", CANDIDATE, reference, judge=lifetime_judge(stock_calibrations(CALIBRATION)))
    print(v)
    assert v.passed, str(v)


@pytest.mark.parametrize("reference", STOCK)
@pytest.mark.parametrize("mutant", MUTANTS)
def test_wrong_decode_rows_fail_the_same_check(mutant, reference):
    """Mutation proof: the verdict above tells wrong decode rows from stock."""
    v = check("lifetime_noise", mutant, reference, judge=lifetime_judge(stock_calibrations(CALIBRATION)))
    print(f"{mutant} (expected to FAIL):\n{v}")
    assert not v.passed, f"the verdict cannot tell {mutant} from {reference}: {v}"


@pytest.mark.parametrize("name", [CANDIDATE, *MUTANTS])
def test_decode_groups_were_served_in_the_engine_over_the_whole_prefix(name):
    """Evidence written from inside the engine process by the runner's shared-decode wrapper."""
    data = ran(name)
    ev = data["shared_decode"]
    print(name, "shared decode:", ev)
    assert ev["ran_in_engine_process"] and ev["calls_with_groups"] > 0, ev
    # All the requests decoding together, one group sharing exactly the cached prefix.
    assert ev["max_members"] == engine_runner.DECODE_REQUESTS, ev
    assert ev["max_prefix_tokens"] == engine_runner.DECODE_PREFIX, ev
    assert ev["modes"] == [data["args"]["shared_decode_mutant"] or "record"], ev
    assert "MLA shared-prefix decode (mla-prefill-ext): on" in log_of(name)


@pytest.mark.parametrize("name", CALIBRATION)
def test_stock_runs_unpatched(name):
    ran(name)
    assert_unpatched(log_of(name))


def test_the_other_kernel_is_vllms_flashmla():
    ran(OTHER_KERNEL)
    assert "FLASHMLA backend" in log_of(OTHER_KERNEL)
