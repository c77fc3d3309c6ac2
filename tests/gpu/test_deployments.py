"""Deployments on the GPU host: a Ray cluster started beforehand, and an installed backend package.

Reads the results of ``python -m scripts.gpu_harness.session multi`` / ``single`` from
``MLA_GPU_RESULTS`` (skipped where a scenario was not run). The Ray cluster was
started from an environment with none of the add-on's variables, so only what vLLM
copies to its Ray workers reaches them, as on a second node.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from scripts.gpu_harness import scenarios, verdict
from tests.gpu import recorded_runs

pytestmark = pytest.mark.gpu

RESULTS_DIRS = [Path(p) for p in (os.environ.get("MLA_GPU_RESULTS") or "").split(os.pathsep) if p]


def _found(name: str) -> tuple[Path, dict]:
    """The last recorded run of a scenario across the result folders."""
    found = [(d, data) for d in RESULTS_DIRS if (data := scenarios.load(d, name)) is not None]
    if not found:
        pytest.skip(f"scenario {name} was not run (results in {RESULTS_DIRS})")
    return found[-1]


def result(name: str) -> dict:
    return _found(name)[1]


def outputs(name: str) -> list[dict]:
    data = result(name)
    assert data["ok"], data.get("error")
    return [r for key in ("batch", "prefix_hit", "chunks") for r in data["results"].get(key, [])]


def worker_pids(name: str, text: str) -> set[int]:
    return recorded_runs.worker_pids_in(scenarios.log_text(_found(name)[0], name), text)


def test_registered_custom_backend_runs_in_both_ray_workers():
    data = result("custom-ray")
    calls = data.get("custom_calls")
    assert calls and calls["lines"] > 0, "the CUSTOM backend was never called in a Ray worker"
    assert len(calls["pids"]) == 2 and data["pid"] not in calls["pids"], calls
    assert worker_pids("custom-ray", "Using CUSTOM MLA prefill backend (from MLA_PREFILL_BACKEND") == set(
        calls["pids"]
    )
    v = verdict.identical(outputs("custom-ray"), outputs("stock-ray"), label="custom-ray vs stock-ray")
    assert v.passed, str(v)


def test_backend_choice_reaches_both_ray_workers():
    pids = worker_pids("fi-ray", "Using FLASHINFER MLA prefill backend (from MLA_PREFILL_BACKEND")
    assert len(pids) == 2, pids
    v = verdict.bf16_noise(outputs("fi-ray"), outputs("stock-ray"), label="fi-ray vs stock-ray")
    assert v.passed, str(v)


def test_disable_switch_reaches_both_ray_workers():
    """stock-ray sets MLA_PREFILL_EXT_DISABLE=1 in the driver only: both workers run vLLM's own prefill."""
    result("stock-ray")
    # vLLM's own line (info_once: Ray forwarded it from at least one worker on the H200 run)...
    assert worker_pids("stock-ray", "Using FlashAttention prefill for MLA")
    # ...and no worker built an add-on backend, where custom-ray and fi-ray show one per worker.
    assert not worker_pids("stock-ray", "MLA prefill backend (")
    log = scenarios.log_text(_found("stock-ray")[0], "stock-ray")
    assert (
        "MLA_PREFILL_EXT_DISABLE"
        in log.split("Copying the following environment variables to workers")[1][:1000]
    )


def test_previous_release_missed_the_ray_workers():
    """The same CUSTOM run with the add-on before this change: the workers never saw the choice."""
    data = result("ray-old-custom")
    calls = data.get("custom_calls") or {"lines": 0, "pids": []}
    print("previous release, CUSTOM on Ray:", calls, data.get("error"))
    assert calls["lines"] == 0, "the previous release reached the Ray workers after all"
    assert worker_pids("ray-old-custom", "Using FLASH_ATTN MLA prefill backend (auto-selected")


def test_installed_package_is_selected_by_its_claim():
    data = result("example-auto")
    calls = data.get("custom_calls")
    assert calls and calls["lines"] > 0 and data["pid"] not in calls["pids"], calls
    log = scenarios.log_text(_found("example-auto")[0], "example-auto")
    assert "Using EXAMPLE MLA prefill backend (auto-selected" in log
    assert "EXAMPLE joined automatic selection by its claim" in log
    # It delegates to FLASH_ATTN on Hopper: the same kernel as stock.
    v = verdict.identical(
        outputs("example-auto"), outputs("stock-eager"), label="example-auto vs stock-eager"
    )
    assert v.passed, str(v)
