"""``select`` (mla_prefill_ext/cli/select.py): which backend would serve, the order, each candidate."""

from __future__ import annotations

import json
from typing import Any

import pytest
from cli_runs import assert_no_traceback, cuda_here

SLOW_RUNS: dict[str, tuple[list[str], dict[str, str]]] = {
    "select_abstract": (
        ["select", "--backend", "custom"],
        {"MLA_PREFILL_BACKEND_OVERRIDES": '{"CUSTOM": "readme_backend.MyPrefill"}'},
    ),
    # An installed backend package that claims a place in automatic selection here.
    "select_claim": (["select"], {}),
    "select_claim_json": (["select", "--capability", "cpu", "--json"], {}),
}
SLOW_RUN_PATHS: dict[str, list[str]] = {
    "select_claim": ["claim_packages"],
    "select_claim_json": ["claim_packages"],
}


def test_select_says_valid_only_for_a_backend_that_can_be_built(slow: dict[str, Any]) -> None:
    proc = slow["select_abstract"]
    assert proc.returncode == 1, proc.stdout + proc.stderr[-4000:]
    assert_no_traceback(proc)
    custom = next(line for line in proc.stdout.splitlines() if line.strip().startswith("CUSTOM"))
    assert "invalid: " in custom and "cannot be instantiated: it does not implement" in custom
    assert "selected: none" in proc.stdout


def test_select_marks_a_backend_that_joined_by_its_claim(slow: dict[str, Any]) -> None:
    report = json.loads(slow["select_claim_json"].stdout)  # --capability cpu: as on this machine
    assert report["automatic_order"] == ["DEMO_CLAIM", "TORCH_SDPA"]
    assert report["builtin_order"] == ["TORCH_SDPA"]
    assert report["claims"] == [
        {
            "name": "DEMO_CLAIM",
            "source": "entry point of package demo-claim",
            "capabilities": ["cpu"],
            "before": "FLASH_ATTN",
        }
    ]
    assert report["selected"] == "DEMO_CLAIM" and report["selected_by_claim"] is True
    assert {"name": "DEMO_CLAIM", "valid": True, "reasons": []} in report["candidates"]

    if cuda_here():
        pytest.skip("the human report below is for a machine without a GPU")
    proc = slow["select_claim"]
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert_no_traceback(proc)
    lines = proc.stdout.splitlines()
    assert "automatic order: DEMO_CLAIM (claim: cpu; before FLASH_ATTN) > TORCH_SDPA" in lines
    assert "requested: AUTO (automatic)" in lines
    assert "selected: DEMO_CLAIM (it joined automatic selection by its claim)" in lines
    assert "  DEMO_CLAIM     valid" in lines
