"""End-to-end parity with stock vLLM 0.20.2 on the tiny DeepSeek-V2 (sharp-attention weights).

Each scenario is one engine lifetime (scripts/gpu_harness/scenarios.py). With MLA_GPU_RESULTS
pointing at a folder that ``python -m scripts.gpu_harness.scenarios`` filled, the tests read
the results from there; otherwise they run the scenarios they need, one by one.

Every comparison is a verdict (scripts/gpu_harness/verdict.py): ``identical`` where the same
kernel runs on both sides (the add-on's FLASH_ATTN, the CUSTOM counting backend that
delegates to it), ``bf16_noise`` for FLASHINFER. The mutation scenarios prove that
these verdicts can fail: a backend with the softmax scale 2% off, and one returning a
base-2 LSE, must each fail ``bf16_noise`` against stock.
"""

from __future__ import annotations

import pytest

from scripts.gpu_harness import engine_runner, scenarios
from tests.gpu.recorded_runs import MIN_CONTEXT_CHUNKS, check, log_of, outputs, result

pytestmark = pytest.mark.gpu


def test_context_paths_are_exercised():
    out = outputs("stock")
    assert max(r["prompt_len"] for r in out) > engine_runner.MAX_NUM_BATCHED_TOKENS  # chunked prefill
    assert out[-1]["num_cached_tokens"] >= engine_runner.PREFIX_SHARED - 64  # prefix-cache hit
    assert all(len(r["top2"]) == len(r["tokens"]) for r in out)  # top-2 logprobs recorded
    data = result("stock")
    assert data["weights"] == "sharp", "parity must run on the sharp checkpoint"


# (candidate, reference, verdict): the whole parity matrix.
PARITY = [
    ("shim-fa", "stock", "identical"),
    ("shim-fa-eager", "stock-eager", "identical"),
    ("custom-spawn", "stock-eager", "identical"),  # the counting backend runs FLASH_ATTN
    ("shim-fi", "stock", "bf16_noise"),
    ("shim-fi-eager", "stock-eager", "bf16_noise"),
    ("shim-fa-chunks", "stock-chunks", "identical"),
    ("shim-fi-chunks", "stock-chunks", "bf16_noise"),
    ("shim-fa-tp2", "stock-tp2", "identical"),
    ("custom-tp2", "stock-tp2", "identical"),
    ("shim-fi-tp2", "stock-tp2", "bf16_noise"),
]


@pytest.mark.parametrize(("candidate", "reference", "kind"), PARITY, ids=[p[0] for p in PARITY])
def test_parity_with_stock(candidate, reference, kind):
    v = check(kind, candidate, reference)
    assert v.passed, str(v)


@pytest.mark.parametrize(
    ("name", "backend", "source"),
    [
        ("shim-fa", "FLASH_ATTN", "MLA_PREFILL_BACKEND"),
        ("shim-fa-eager", "FLASH_ATTN", "MLA_PREFILL_BACKEND"),
        ("shim-fi", "FLASHINFER", "additional_config"),
        ("shim-fi-eager", "FLASHINFER", "MLA_PREFILL_BACKEND"),
        ("shim-fa-chunks", "FLASH_ATTN", "MLA_PREFILL_BACKEND"),
        ("shim-fi-chunks", "FLASHINFER", "MLA_PREFILL_BACKEND"),
        ("mutant-scale", "CUSTOM", "MLA_PREFILL_BACKEND"),
        ("mutant-lse2", "CUSTOM", "MLA_PREFILL_BACKEND"),
    ],
)
def test_the_chosen_backend_is_in_force(name, backend, source):
    result(name)
    assert f"Using {backend} MLA prefill backend (from {source}" in log_of(name)


@pytest.mark.parametrize("name", ["stock", "stock-chunks"])
def test_stock_runs_unpatched(name):
    result(name)
    assert "MLA prefill backend" not in log_of(name)


CHUNK_SCENARIOS = ["stock-chunks", "shim-fa-chunks", "shim-fi-chunks", "mutant-scale", "mutant-lse2"]


@pytest.mark.parametrize("name", CHUNK_SCENARIOS)
def test_chunk_scenarios_merge_several_context_chunks_in_one_step(name):
    """Evidence written from inside the engine process by the runner's builder wrapper."""
    data = result(name)
    assert data["ok"], data.get("error")
    ev = data["context_chunks"]
    print(name, "context chunks:", ev)
    assert ev["ran_in_engine_process"], ev
    assert data["pid"] not in ev["pids"]
    assert ev["max_chunks_per_step"] >= MIN_CONTEXT_CHUNKS, ev
    assert ev["max_chunk_tokens"] <= scenarios.CONTEXT_CHUNK_TOKENS, ev
    records = data["results"]["chunks"]
    # The second prompt reuses the first's 8192 cached tokens (prefix caching is on).
    assert records[1]["num_cached_tokens"] >= engine_runner.CHUNKS_PREFIX - 64, records[1]


@pytest.mark.parametrize("mutant", ["mutant-scale", "mutant-lse2"])
def test_mutant_backend_fails_the_bf16_noise_verdict(mutant):
    """Mutation proof: a wrong backend must not pass as bf16 noise."""
    v = check("bf16_noise", mutant, "stock-chunks")
    print(f"{mutant} (expected to FAIL):\n{v}")
    assert not v.passed, f"the verdict cannot tell {mutant} from stock: {v}"


def test_custom_backend_runs_in_spawned_engine_process():
    data = result("custom-spawn")
    calls = data.get("custom_calls")
    assert calls and calls["lines"] > 0, "the CUSTOM backend was never called"
    assert data["pid"] not in calls["pids"], "it ran in the user's process, not the engine's"
    assert {"new_tokens", "context_chunk"} <= set(calls["kinds"])
    assert "Using CUSTOM MLA prefill backend (from MLA_PREFILL_BACKEND" in log_of("custom-spawn")


def test_invalid_explicit_choice_fails_at_startup():
    data = result("invalid-explicit")
    assert not data["ok"]
    assert "MLA prefill backend TRTLLM_RAGGED (from MLA_PREFILL_BACKEND) cannot serve" in log_of(
        "invalid-explicit"
    )


def test_custom_backend_runs_in_both_tp_workers():
    calls = result("custom-tp2")["custom_calls"]
    assert len(calls["pids"]) == 2, calls
