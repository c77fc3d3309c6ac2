"""End-to-end parity with stock vLLM 0.20.2 on the tiny DeepSeek-V2 (random weights).

Each scenario is one engine lifetime (tests/gpu/scenarios.py). With MLA_GPU_RESULTS
pointing at a folder that ``python -m tests.gpu.scenarios`` filled, the tests read
the results from there; otherwise they run the scenarios they need, one by one.
"""

from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path

import pytest

from tests.gpu import scenarios

pytestmark = pytest.mark.gpu

RESULTS = Path(os.environ.get("MLA_GPU_RESULTS") or tempfile.mkdtemp(prefix="mla-gpu-"))


@functools.cache
def result(name: str) -> dict:
    data = scenarios.load(RESULTS, name)
    if data is None:
        import torch

        if scenarios.SCENARIOS[name].gpus > torch.cuda.device_count():
            pytest.skip(f"{name} needs {scenarios.SCENARIOS[name].gpus} GPUs")
        scenarios.run_all([name], RESULTS, [str(i) for i in range(torch.cuda.device_count())], bench=False)
        data = scenarios.load(RESULTS, name)
    assert data is not None, f"scenario {name} wrote no result (see {RESULTS / (name + '.log')})"
    return data


def log_of(name: str) -> str:
    return (RESULTS / f"{name}.log").read_text(errors="replace")


def outputs(name: str) -> list[dict]:
    data = result(name)
    assert data["ok"], data.get("error")
    return data["results"]["batch"] + data["results"]["prefix_hit"]


def max_logprob_diff(a: list[dict], b: list[dict]) -> float:
    return max(
        abs(x - y)
        for ra, rb in zip(a, b, strict=True)
        for x, y in zip(ra["logprobs"], rb["logprobs"], strict=True)
    )


def assert_same_tokens(shim: str, stock: str) -> float:
    a, b = outputs(shim), outputs(stock)
    for i, (ra, rb) in enumerate(zip(a, b, strict=True)):
        assert ra["tokens"] == rb["tokens"], f"{shim} vs {stock}: prompt {i} differs"
    diff = max_logprob_diff(a, b)
    print(f"{shim} vs {stock}: tokens identical, max |logprob diff| = {diff:.3g}")
    return diff


def test_context_paths_are_exercised():
    out = outputs("stock")
    runner = scenarios_runner()
    assert max(r["prompt_len"] for r in out) > runner.MAX_NUM_BATCHED_TOKENS  # chunked prefill
    assert out[-1]["num_cached_tokens"] >= runner.PREFIX_SHARED - 64  # prefix-cache hit


def scenarios_runner():
    from tests.gpu import engine_runner

    return engine_runner


@pytest.mark.parametrize(("shim", "stock"), [("shim-fa", "stock"), ("shim-fa-eager", "stock-eager")])
def test_flash_attn_is_identical_to_stock(shim, stock):
    assert assert_same_tokens(shim, stock) == 0.0
    assert "Using FLASH_ATTN MLA prefill backend (from MLA_PREFILL_BACKEND" in log_of(shim)


@pytest.mark.parametrize(("shim", "stock"), [("shim-fi", "stock"), ("shim-fi-eager", "stock-eager")])
def test_flashinfer_gives_stock_tokens(shim, stock):
    assert_same_tokens(shim, stock)
    source = "additional_config" if shim == "shim-fi" else "MLA_PREFILL_BACKEND"
    assert f"Using FLASHINFER MLA prefill backend (from {source}" in log_of(shim)


def test_stock_runs_unpatched():
    assert "MLA prefill backend" not in log_of("stock")


def test_custom_backend_runs_in_spawned_engine_process():
    data = result("custom-spawn")
    calls = data.get("custom_calls")
    assert calls and calls["lines"] > 0, "the CUSTOM backend was never called"
    assert data["pid"] not in calls["pids"], "it ran in the user's process, not the engine's"
    assert {"new_tokens", "context_chunk"} <= set(calls["kinds"])
    assert "Using CUSTOM MLA prefill backend (from MLA_PREFILL_BACKEND" in log_of("custom-spawn")
    assert_same_tokens("custom-spawn", "stock-eager")


def test_invalid_explicit_choice_fails_at_startup():
    data = result("invalid-explicit")
    assert not data["ok"]
    assert "MLA prefill backend TRTLLM_RAGGED (from MLA_PREFILL_BACKEND) cannot serve" in log_of(
        "invalid-explicit"
    )


@pytest.mark.parametrize("shim", ["shim-fa-tp2", "shim-fi-tp2", "custom-tp2"])
def test_tensor_parallel_gives_stock_tokens(shim):
    diff = assert_same_tokens(shim, "stock-tp2")
    if shim == "shim-fa-tp2":
        assert diff == 0.0


def test_custom_backend_runs_in_both_tp_workers():
    calls = result("custom-tp2")["custom_calls"]
    assert len(calls["pids"]) == 2, calls
