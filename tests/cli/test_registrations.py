"""What ``info`` reports of the registry (mla_prefill_ext/cli/registrations.py): every backend, the
installed packages, their claims, and claims at one place (also in ``select``)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from cli_runs import CLAIM_CLASS, assert_no_traceback, cuda_here

SLOW_RUNS: dict[str, tuple[list[str], dict[str, str]]] = {
    "info_bad_settings": (
        ["info", "--json"],
        {
            "MLA_PREFILL_BACKEND": "nonsense",
            "MLA_PREFILL_BACKEND_OVERRIDES": json.dumps(
                {"CUSTOM": "readme_backend.MyPrefill", "MINE": "Foo", "1BAD": "a.B", "OTHER": 3}
            ),
        },
    ),
    # Two installed packages claiming the same place.
    "info_rivals_json": (["info", "--json"], {}),
    "select_rivals": (["select", "--capability", "cpu"], {}),
}
# Extra PYTHONPATH entries per run: installed packages (in the harness).
SLOW_RUN_PATHS: dict[str, list[str]] = {
    "info_bad_settings": ["packages", "claim_packages"],  # this user also installed packages
    "info_rivals_json": ["rival_packages"],
    "select_rivals": ["rival_packages"],
}


@pytest.mark.vllm_patch  # info's report of the patch
def test_info_reports_bad_settings_and_tries_every_registration(slow: dict[str, Any]) -> None:
    proc = slow["info_bad_settings"]
    assert proc.returncode == 1, proc.stdout + proc.stderr[-4000:]
    assert_no_traceback(proc)
    report = json.loads(proc.stdout)
    assert report["verdict"] == "problem" and report["exit_code"] == 1
    assert report["vllm_supported"] and report["patched"]
    assert report["choice"]["requested"] == "nonsense" and report["choice"]["source"] == "MLA_PREFILL_BACKEND"
    backends = {b["name"]: b for b in report["backends"]}
    assert backends["TORCH_SDPA"]["loads"] is True
    assert backends["CUSTOM"]["loads"] is False
    assert (
        "does not implement get_name, run_prefill_context_chunk, run_prefill_new_tokens"
        in (backends["CUSTOM"]["error"])
    )
    # Registrations in this process come from the environment variable, not from a call.
    assert backends["CUSTOM"]["kind"] == "registered in MLA_PREFILL_BACKEND_OVERRIDES"
    assert backends["MINE"]["loads"] is False
    assert "'Foo' is not of the form 'package.module.ClassName'" in backends["MINE"]["error"]
    messages = [f["message"] for f in report["findings"]]
    assert messages[0].startswith("MLA_PREFILL_BACKEND is set to 'nonsense', which is not a backend name;")
    # The variable's bad entries, in its one finding (the registry's log line does not repeat it).
    (overrides,) = [m for m in messages if m.startswith("MLA_PREFILL_BACKEND_OVERRIDES=")]
    assert "'1BAD' is not a backend name (an identifier such as MY_PREFILL)" in overrides
    assert "the class path of 'OTHER' is not a non-empty string" in overrides
    assert "MLA_PREFILL_BACKEND_OVERRIDES" not in proc.stderr
    packages = {p["name"]: p for p in report["backend_packages"]}
    assert set(packages) == {"DEMO_BAD", "DEMO_CLAIM"}
    assert packages["DEMO_BAD"]["distribution"] == "demo-backends" and packages["DEMO_BAD"]["problem"]
    assert packages["DEMO_CLAIM"]["problem"] is None
    # Each backend's claim on automatic selection, and whether it applies on this device.
    assert backends["DEMO_CLAIM"]["class_path"] == CLAIM_CLASS and backends["DEMO_CLAIM"]["loads"]
    assert backends["DEMO_CLAIM"]["claim"] == {
        "capabilities": ["cpu"],
        "before": "FLASH_ATTN",
        "applies_here": not cuda_here(),
        "ignored": None,
        "error": None,
    }
    assert backends["TORCH_SDPA"]["claim"] is None
    # Where the add-on takes over vLLM's MLA prefill: CUDA, CPU and no platform.
    assert report["platform"]["served"] is True and report["platform"]["reason"] is None
    assert report["platform"]["name"] in ("CUDA", "CPU", "none")
    assert any(
        m.startswith("The mla_prefill_ext.backends entry point DEMO_BAD = 'nodots' of package demo-backends")
        for m in messages
    )
    assert len(messages) == 5  # the variable's two bad entries in one finding
    assert all(m.endswith(".") for m in messages)


def test_info_reports_packages_that_claim_the_same_place(slow: dict[str, Any]) -> None:
    """Two installed packages claim the same place: info names both, which comes first and why."""
    proc = slow["info_rivals_json"]
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert_no_traceback(proc)
    report = json.loads(proc.stdout)
    place = "FLASH_ATTN" if cuda_here() else "TORCH_SDPA"  # FLASH_ATTN is in every GPU's list
    assert report["competing_claims"] == [{"before": place, "order": ["RIVAL_ALPHA", "RIVAL_ZED"]}]
    if report["mode"] == "bridge":  # vLLM 0.23+: vLLM's own automatic selection decides (the bridge's lines)
        assert report["choice"]["vllm_decides"] and report["bridge"]["instrumented"]
    else:
        assert report["choice"]["selected_here"] == "RIVAL_ALPHA" and report["choice"]["selected_by_claim"]
    notes = [f["message"] for f in report["findings"] if f["level"] == "note"]
    assert (
        "RIVAL_ALPHA (entry point of package zzz-rival) and RIVAL_ZED (entry point of package "
        f"aaa-rival) claim the same place in automatic selection on this device, before {place}; "
        "claims at one place are tried in the alphabetical order of the backends' names: RIVAL_ALPHA "
        "comes first and serves every model it accepts, RIVAL_ZED serves only models RIVAL_ALPHA refuses."
    ) in notes
    assert report["verdict"] == "ok"  # two packages may claim one place: a note, not a problem

    lines = slow["select_rivals"].stdout.splitlines()
    assert lines[1:3] == [
        "automatic order: RIVAL_ALPHA (claim: cpu, 7.x, 8.x, 9.x, 10.x, 12.x; before FLASH_ATTN) > "
        "RIVAL_ZED (claim: cpu, 7.x, 8.x, 9.x, 10.x, 12.x; before FLASH_ATTN) > TORCH_SDPA",
        "note: RIVAL_ALPHA (entry point of package zzz-rival) and RIVAL_ZED (entry point of package "
        "aaa-rival) claim the same place in automatic selection without a GPU, before TORCH_SDPA; "
        "claims at one place are tried in the alphabetical order of the backends' names: RIVAL_ALPHA "
        "comes first and serves every model it accepts, RIVAL_ZED serves only models RIVAL_ALPHA refuses.",
    ]
