"""Shared-prefix parity with stock vLLM on the tiny DeepSeek-V2 (sharp-attention weights), issue 27.

The ``*-shared*`` scenarios (scripts/gpu_harness/scenarios.py) run the runner's ``shared`` prompt set:
16 short extends, 8 long extends and 8 requests with private context, all over one cached prefix,
each set in one call. The add-on with its shared-prefix path on (eager, compiled, context in
several passes) must stay within bf16 noise of EVERY stock lifetime that serves the short extends
where the path routes them, on vLLM's prefill path (``stock-shared-prefill*``: stock with its decode
threshold at 1, as with an MLA decode backend whose threshold is 1); with the path off, of every
plain stock lifetime (stock vLLM is not bit-reproducible across lifetimes everywhere,
docs/gpu-verification.md). vLLM's absorbed decode path and its prefill path are two computations
of the same attention; on the sharp checkpoint they differ beyond bf16 noise (stock against stock:
docs/gpu-verification.md), so a candidate that moves requests from one to the other is compared with
the one it moved them to. Two deliberately wrong shared paths (a segment gathering blocks that are
not its prefix, a segment left out of the merge) must fail the same verdict against every one.
With MLA_GPU_RESULTS pointing at a folder that
``python -m scripts.gpu_harness.scenarios --only ...`` filled, the tests read the results from there.

What the runner adds for these scenarios (the prompt set, the shared-context wrapper) is checked
on the CPU in tests/gpu_harness/test_shared_scenarios.py.
"""

from __future__ import annotations

import pytest

from scripts.gpu_harness import engine_runner, scenarios, verdict
from tests.gpu.recorded_runs import (
    BLOCK_SLACK,
    assert_shared_prefix_served,
    assert_unpatched,
    check,
    lifetime_judge,
    log_of,
    ran,
    stock_calibrations,
)

pytestmark = pytest.mark.gpu

STOCK = list(scenarios.SHARED_STOCK)
STOCK_PREFILL = list(scenarios.SHARED_STOCK_PREFILL)  # short extends on vLLM's prefill path
# A segment over other blocks, a segment left out of the merge (gross), the segment's scale 2% off (subtle).
MUTANTS = ["mutant-shared-other-prefix", "mutant-shared-drop-lse", "mutant-shared-segment-scale"]
ADDON = ["shim-fa-shared", "shim-fa-shared-2", "shim-fa-shared-chunks", "shim-fa-shared-compiled"]  # path on

# (candidate, reference): every candidate against every stock lifetime that serves its requests on
# the same vLLM path.
ON = ("shim-fa-shared", "shim-fa-shared-2", "shim-fa-shared-chunks")
PARITY = [
    *[(c, s) for c in ON for s in STOCK_PREFILL],
    *[("shim-fa-shared-off", s) for s in STOCK],
    ("shim-fa-shared-chunks", "stock-shared-prefill-chunks"),
    ("shim-fa-shared-compiled", "stock-shared-prefill-compiled"),
]
PREFILL_REFERENCES = [*STOCK_PREFILL, "stock-shared-prefill-chunks", "stock-shared-prefill-compiled"]


def _group(reference: str) -> tuple[str, ...]:
    """The stock lifetimes that calibrate a reference's spread: the same vLLM path for short extends
    (eager lifetimes, also for the compiled and chunked references: their own spread is not measured)."""
    return tuple(STOCK_PREFILL if reference.startswith("stock-shared-prefill") else STOCK)


def _lifetime_judge(reference: str):
    return lifetime_judge(stock_calibrations(_group(reference)))


@pytest.mark.parametrize("name", scenarios.SHARED_SCENARIOS)
def test_the_prefix_is_served_from_the_cache(name):
    assert_shared_prefix_served(ran(name))


@pytest.mark.parametrize("group", [STOCK, STOCK_PREFILL], ids=["decode-path", "prefill-path"])
def test_stocks_own_spread_on_this_set_is_measured_and_bounded(group):
    """Stock's lifetimes against each other: the bound the candidates are held to, printed; capped so
    that a stock run gone wrong cannot widen it without limit."""
    spread = stock_calibrations(tuple(group))
    for v in spread:
        print(f"stock against stock: {v.label}: max |logprob diff| {v.max_diff:.4g}, {len(v.flips)} flip(s)")
    bound = verdict.lifetime_bound(spread)
    print(f"lifetime bound for {group}: {bound:.4g}")
    lifetime_judge(spread)  # within the cap


@pytest.mark.parametrize(("candidate", "reference"), PARITY, ids=[f"{c}-vs-{r}" for c, r in PARITY])
def test_parity_with_every_stock_run(candidate, reference):
    v = check("lifetime_noise", candidate, reference, judge=_lifetime_judge(reference))
    print(v)
    assert v.passed, str(v)


@pytest.mark.parametrize("reference", [*STOCK_PREFILL, *STOCK])
@pytest.mark.parametrize("mutant", MUTANTS)
def test_a_wrong_shared_path_fails_the_same_check(mutant, reference):
    """Mutation proof: the verdict above tells a wrong shared path from stock."""
    v = check("lifetime_noise", mutant, reference, judge=_lifetime_judge(reference))
    print(f"{mutant} (expected to FAIL):\n{v}")
    assert not v.passed, f"the verdict cannot tell {mutant} from {reference}: {v}"


@pytest.mark.parametrize("name", [*ADDON, *MUTANTS])
def test_the_shared_path_ran_in_the_engine_with_the_whole_prefix_shared(name):
    """Evidence written from inside the engine process by the runner's shared-context wrapper."""
    data = ran(name)
    ev = data["shared_context"]
    print(name, "shared context:", ev)
    assert ev["ran_in_engine_process"], ev
    assert ev["calls_with_segments"] > 0, ev
    assert ev["max_segment_tokens"] >= engine_runner.SHARED_PREFIX - BLOCK_SLACK, ev
    assert ev["max_members"] >= 2, ev
    # The short extends were routed to the prefill path and shared their prefix there.
    assert ev["max_short_extend_members"] >= 2, ev
    if name in MUTANTS:
        assert ev["modes"] == [data["args"]["shared_mutant"]], ev


@pytest.mark.parametrize("name", PREFILL_REFERENCES)
def test_the_prefill_path_references_ran_with_the_lowered_threshold_in_the_engine(name):
    data = ran(name)
    ev = data["decode_threshold"]
    assert ev["ran_in_engine_process"], ev
    assert ev["thresholds"] == [1] and max(ev["stock_thresholds"]) > 1, ev  # FLASH_ATTN_MLA: 512


@pytest.mark.parametrize("name", ["shim-fa-shared-chunks", "stock-shared-prefill-chunks"])
def test_chunk_scenarios_take_several_passes(name):
    data = ran(name)
    chunks = data["context_chunks"]
    assert chunks["ran_in_engine_process"], chunks
    assert chunks["max_chunk_tokens"] <= scenarios.CONTEXT_CHUNK_TOKENS, chunks
    if name.startswith("shim"):
        ev = data["shared_context"]
        # The 6144-token segment in 2048-row passes; private contexts in passes of their own.
        assert ev["max_segment_passes"] >= 2 and ev["max_private_passes"] >= 2, ev


def test_turned_off_no_step_takes_the_shared_path():
    data = ran("shim-fa-shared-off")
    assert data["shared_context"]["calls"] == 0, data["shared_context"]
    assert "off (turned off by MLA_PREFILL_SHARED_PREFIX)" in log_of("shim-fa-shared-off")


@pytest.mark.parametrize("name", [*STOCK, *PREFILL_REFERENCES])
def test_stock_runs_unpatched(name):
    ran(name)
    assert_unpatched(log_of(name))
