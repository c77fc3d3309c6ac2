"""``check`` (mla_prefill_ext/cli/check.py): one prefill against the reference, and ``--conformance``."""

from __future__ import annotations

import json
from typing import Any

import pytest
from cli_runs import CLAIM_CLASS, HELPERS, assert_no_traceback, cli_env, cuda_here, run

SLOW_RUNS: dict[str, tuple[list[str], dict[str, str]]] = {
    "check_abstract": (
        ["check", "--backend", "CUSTOM", "--repeat", "1"],
        {"MLA_PREFILL_BACKEND_OVERRIDES": '{"CUSTOM": "readme_backend.MyPrefill"}'},
    ),
    "check_unknown_backend": (["check", "--backend", "nope", "--json"], {}),
    "check_broken": (
        ["check", "--backend", "BROKEN", "--repeat", "1", "--json"],
        {"MLA_PREFILL_BACKEND_OVERRIDES": '{"BROKEN": "broken_backend.Broken"}'},
    ),
    # The conformance suite (a few seconds per dtype on a CPU: one run takes every dtype).
    "conformance_sdpa": (["check", "--backend", "TORCH_SDPA", "--conformance"], {}),
    "conformance_mutant": (
        ["check", "--backend", "custom", "--conformance", "--dtype", "bfloat16"],
        {"MLA_PREFILL_BACKEND_OVERRIDES": '{"CUSTOM": "conformance_mutants.Base2LSE"}'},
    ),
    "conformance_claim_json": (["check", "--conformance", "--dtype", "bfloat16", "--json"], {}),
}
# Extra PYTHONPATH entries per run: an installed package (in the harness), the mutants (tests/helpers/).
SLOW_RUN_PATHS: dict[str, list[str]] = {
    "conformance_mutant": [str(HELPERS)],
    "conformance_claim_json": ["claim_packages"],
}


def test_check_on_cuda_without_a_gpu_is_a_usage_error() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    proc = run("check", "--device", "cuda", env=cli_env())
    assert proc.returncode == 2
    assert proc.stderr.startswith("usage: mla-prefill-ext check")
    assert "argument --device: cuda was asked for, but PyTorch sees no CUDA GPU here" in proc.stderr
    assert_no_traceback(proc)


def test_check_never_crashes_on_a_backend_that_cannot_run(slow: dict[str, Any]) -> None:
    proc = slow["check_abstract"]
    assert proc.returncode == 1, proc.stdout + proc.stderr[-4000:]
    assert_no_traceback(proc)
    assert proc.stdout.startswith(
        "FAIL: MLA prefill backend CUSTOM (from --backend) cannot be loaded: 'readme_backend.MyPrefill' "
        "cannot be instantiated: it does not implement get_name, run_prefill_context_chunk, "
        "run_prefill_new_tokens"
    )

    proc = slow["check_unknown_backend"]  # with --json: the usage error is JSON on stdout too
    assert proc.returncode == 2, proc.stdout + proc.stderr[-4000:]
    assert_no_traceback(proc)
    assert "usage: mla-prefill-ext check" in proc.stderr
    message = "argument --backend: Unknown MLA prefill backend: 'nope'. Valid options are: FLASH_ATTN"
    assert message in proc.stderr
    report = json.loads(proc.stdout)
    assert report["error"].startswith(message) and report["exit_code"] == 2
    assert report["usage"].startswith("usage: mla-prefill-ext check")

    proc = slow["check_broken"]
    assert proc.returncode == 1, proc.stdout + proc.stderr[-4000:]
    assert_no_traceback(proc)
    report = json.loads(proc.stdout)
    assert report["ok"] is False and report["backend"] == "BROKEN"
    assert report["dtype"] == "bfloat16"  # the plain check's default (--conformance: every dtype)
    assert report["error"] == "backend BROKEN failed: RuntimeError: kernel exploded (at broken_backend.py:11)"


# check --conformance: the conformance suite (mla_prefill_ext.testing)


def property_lines(out: str) -> dict[str, str]:
    """``{property: PASS|FAIL|SKIP}`` from the report's properties section."""
    from mla_prefill_ext.testing import PROPERTIES

    found = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] in ("PASS", "FAIL", "SKIP") and parts[1] in PROPERTIES:
            found[parts[1]] = parts[0]
    return found


def test_check_conformance_reports_every_property(slow: dict[str, Any]) -> None:
    from mla_prefill_ext.testing import PROPERTIES

    proc = slow["conformance_sdpa"]
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert_no_traceback(proc)
    out = proc.stdout
    assert out.startswith(
        "backend under test: TORCH_SDPA (from --backend)\n"
        "MLA prefill conformance: TORCH_SDPA (mla_prefill_ext.backends.torch_sdpa.TorchSDPAPrefillBackend)\n"
    )
    # Every dtype by default: 3 dtypes x 2 MLA head dims x 2 head counts.
    assert "cases: 12 run, 0 skipped" in out
    for dtype in ("bfloat16", "float16", "float32"):
        assert f"  run   {dtype}, qk 128+64 v 128, 16 heads" in out
    assert property_lines(out) == dict.fromkeys(PROPERTIES, "PASS")
    assert "\nRESULT: PASS\n" in out


def test_check_conformance_json_on_the_backend_selected_here(slow: dict[str, Any]) -> None:
    """Without --backend: the backend the selector picks here (the installed one, by its claim)."""
    from mla_prefill_ext.testing import PROPERTIES

    proc = slow["conformance_claim_json"]
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert_no_traceback(proc)
    report = json.loads(proc.stdout)
    assert report["ok"] is True and report["mode"] == "conformance"
    expected = "DEMO_CLAIM" if not cuda_here() else report["backend"]
    assert report["backend"] == expected and report["source"] == "automatic"
    if not cuda_here():
        assert report["class"] == CLAIM_CLASS and report["get_name"] == "DEMO_CLAIM"
    assert report["dtypes"] == ["bfloat16"] and {c["dtype"] for c in report["cases"]} == {"bfloat16"}
    assert report["seed"] == 0 and report["failed_properties"] == []
    assert {p: v["status"] for p, v in report["properties"].items()} == dict.fromkeys(PROPERTIES, "pass")


def test_check_conformance_names_the_property_a_wrong_backend_fails(slow: dict[str, Any]) -> None:
    from conformance_mutants import Base2LSE

    proc = slow["conformance_mutant"]
    assert proc.returncode == 1, proc.stdout + proc.stderr[-4000:]
    assert_no_traceback(proc)
    out = proc.stdout
    assert out.startswith(
        "backend under test: CUSTOM (from --backend; its get_name() is MUTANT)\n"
        "MLA prefill conformance: MUTANT (conformance_mutants.Base2LSE)\n"
    )
    statuses = property_lines(out)
    assert statuses[Base2LSE.FAILS] == "FAIL"
    assert statuses["scale"] == statuses["causal"] == "PASS"  # one bug, reported under its own name
    result = next(line for line in out.splitlines() if line.startswith("RESULT: "))
    assert result.startswith("RESULT: FAIL (") and Base2LSE.FAILS in result
