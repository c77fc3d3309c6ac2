"""Shared-prefix parity with stock vLLM on the tiny DeepSeek-V2 (sharp-attention weights), issue 27.

The ``*-shared*`` scenarios (scripts/gpu_harness/scenarios.py) run the runner's ``shared`` prompt set:
16 short extends, 8 long extends and 8 requests with private context, all over one cached prefix,
each set in one call. The add-on with its shared-prefix path on (eager, compiled, context in
several passes) and off must stay within bf16 noise of EVERY stock lifetime (stock vLLM is not
bit-reproducible across lifetimes everywhere, docs/gpu-verification.md); two deliberately wrong
shared paths (a segment gathering blocks that are not its prefix, a segment left out of the merge)
must fail the same verdict against every one. With MLA_GPU_RESULTS pointing at a folder that
``python -m scripts.gpu_harness.scenarios --only ...`` filled, the tests read the results from there.

What the runner adds for these scenarios (the prompt set, the shared-context wrapper) is checked
on the CPU in tests/gpu_harness/test_shared_scenarios.py.
"""

from __future__ import annotations

import pytest

from scripts.gpu_harness import engine_runner, scenarios
from tests.gpu.recorded_runs import check, log_of, result

pytestmark = pytest.mark.gpu

STOCK = ["stock-shared", "stock-shared-2", "stock-shared-3"]
MUTANTS = ["mutant-shared-other-prefix", "mutant-shared-drop-lse"]
ADDON = ["shim-fa-shared", "shim-fa-shared-chunks", "shim-fa-shared-compiled"]  # path on, recorded
BLOCK_SLACK = 64  # the largest page size of the MLA backends: a prefix's last partial block is recomputed

# (candidate, reference): every candidate against every stock lifetime.
PARITY = [
    *[(c, s) for c in ("shim-fa-shared", "shim-fa-shared-off", "shim-fa-shared-chunks") for s in STOCK],
    ("shim-fa-shared-chunks", "stock-shared-chunks"),
    ("shim-fa-shared-compiled", "stock-shared-compiled"),
]


def _ok(name: str) -> dict:
    data = result(name)
    assert data["ok"], data.get("error")
    return data


@pytest.mark.parametrize("name", scenarios.SHARED_SCENARIOS)
def test_the_prefix_is_served_from_the_cache(name):
    data = _ok(name)
    assert data["weights"] == "sharp", "parity must run on the sharp checkpoint"
    sets = engine_runner.shared_prompt_sets()
    for key in engine_runner.SHARED_SETS:
        records = data["results"][key]
        assert [r["prompt_len"] for r in records] == [len(p) for p in sets[key]], key
        cached = engine_runner.shared_cached_tokens(key)
        short = [r["num_cached_tokens"] for r in records if r["num_cached_tokens"] < cached - BLOCK_SLACK]
        assert not short, f"{key}: {short} cached tokens, expected >= {cached - BLOCK_SLACK}"
        assert all(len(r["top2"]) == len(r["tokens"]) for r in records)


@pytest.mark.parametrize(("candidate", "reference"), PARITY, ids=[f"{c}-vs-{r}" for c, r in PARITY])
def test_parity_with_every_stock_run(candidate, reference):
    v = check("bf16_noise", candidate, reference)
    assert v.passed, str(v)


@pytest.mark.parametrize("reference", STOCK)
@pytest.mark.parametrize("mutant", MUTANTS)
def test_a_wrong_shared_path_fails_the_same_check(mutant, reference):
    """Mutation proof: the verdict above tells a wrong shared path from stock."""
    v = check("bf16_noise", mutant, reference)
    print(f"{mutant} (expected to FAIL):\n{v}")
    assert not v.passed, f"the verdict cannot tell {mutant} from {reference}: {v}"


@pytest.mark.parametrize("name", [*ADDON, *MUTANTS])
def test_the_shared_path_ran_in_the_engine_with_the_whole_prefix_shared(name):
    """Evidence written from inside the engine process by the runner's shared-context wrapper."""
    data = _ok(name)
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


@pytest.mark.parametrize("name", ["shim-fa-shared-chunks", "stock-shared-chunks"])
def test_chunk_scenarios_take_several_passes(name):
    data = _ok(name)
    chunks = data["context_chunks"]
    assert chunks["ran_in_engine_process"], chunks
    assert chunks["max_chunk_tokens"] <= scenarios.CONTEXT_CHUNK_TOKENS, chunks
    if name.startswith("shim"):
        ev = data["shared_context"]
        # The 6144-token segment in 2048-row passes; private contexts in passes of their own.
        assert ev["max_segment_passes"] >= 2 and ev["max_private_passes"] >= 2, ev


def test_turned_off_no_step_takes_the_shared_path():
    data = _ok("shim-fa-shared-off")
    assert data["shared_context"]["calls"] == 0, data["shared_context"]
    assert "off (turned off by MLA_PREFILL_SHARED_PREFIX)" in log_of("shim-fa-shared-off")


@pytest.mark.parametrize("name", [*STOCK, "stock-shared-chunks", "stock-shared-compiled"])
def test_stock_runs_unpatched(name):
    _ok(name)
    assert "MLA prefill backend" not in log_of(name)
