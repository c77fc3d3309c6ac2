"""``info``, the doctor (mla_prefill_ext/cli/info.py): the report, its findings, its verdict."""

from __future__ import annotations

from typing import Any

import pytest
from cli_runs import CLAIM_CLASS, SUPPORTED, assert_no_traceback, cuda_here

SLOW_RUNS: dict[str, tuple[list[str], dict[str, str]]] = {
    # A user with several problems at once (info imports vLLM's MLA module: the costly runs).
    "info_unsupported_vllm": (
        ["info"],
        {
            "MLA_TEST_VLLM_VERSION": "0.21.0",
            "MLA_PREFILL_BACKEND": "FLASH_ATTN",
            "MLA_PREFILL_BACKEND_OVERRIDES": '{"CUSTOM": oops',
        },
    ),
    # An installed backend package that claims a place in automatic selection here.
    "info_claim": (["info"], {}),
    # The shared-prefix path turned off, and its switch given a value that is not one.
    "info_shared_off": (["info"], {"MLA_PREFILL_SHARED_PREFIX": "0"}),
    "info_shared_invalid": (["info"], {"MLA_PREFILL_SHARED_PREFIX": "maybe"}),
    "info_gather_invalid": (["info"], {"MLA_PREFILL_SHARED_PREFIX_GATHER_MS": "soon"}),
    # A malformed overrides variable on a supported vLLM (the registry, the choice and the
    # registrations each see it).
    "info_bad_overrides": (["info"], {"MLA_PREFILL_BACKEND_OVERRIDES": '{"CUSTOM": oops'}),
}
SLOW_RUN_PATHS: dict[str, list[str]] = {"info_claim": ["claim_packages"]}


@pytest.mark.vllm_patch  # info's report of the patch
def test_info_on_an_unsupported_vllm_reports_the_refusal(slow: dict[str, Any]) -> None:
    proc = slow["info_unsupported_vllm"]
    assert proc.returncode == 1, proc.stdout + proc.stderr[-4000:]
    assert_no_traceback(proc)
    out = proc.stdout
    assert f"vLLM 0.21.0: NOT supported, mode: none (supported: {SUPPORTED})" in out
    assert "add-on: not active (see the findings)" in out
    assert "backend choice: FLASH_ATTN (from MLA_PREFILL_BACKEND)" in out
    findings = [line for line in out.splitlines() if line.startswith("  PROBLEM  ") and "." in line]
    assert any(f.startswith("  PROBLEM  vLLM 0.21.0 is not supported") for f in findings)
    assert any(
        f.startswith("  PROBLEM  mla-prefill-ext cannot honour MLA_PREFILL_BACKEND=FLASH_ATTN")
        for f in findings
    )
    assert any(
        f.startswith("""  PROBLEM  MLA_PREFILL_BACKEND_OVERRIDES='{"CUSTOM": oops' cannot be used""")
        for f in findings
    )
    assert all(f.endswith(".") for f in findings)  # findings are sentences
    verdict = out.rstrip().splitlines()[-1]
    assert verdict.startswith("verdict: ") and verdict.endswith(" problems found (see the findings).")
    assert "shim" not in out.lower()
    assert "(wrapped)" not in out  # targets say what the add-on does with them: "wraps" or "reads"
    assert "  ok       wraps  MLAAttention.__init__" in out


def test_info_reports_a_malformed_overrides_variable_once_with_one_example(slow: dict[str, Any]) -> None:
    """One finding, nothing on stderr, and the example every message about the variable gives."""
    from mla_prefill_ext.settings import OVERRIDES_EXAMPLE

    proc = slow["info_bad_overrides"]
    assert proc.returncode == 1, proc.stdout + proc.stderr[-4000:]
    assert_no_traceback(proc)
    said = [
        line for line in (proc.stdout + proc.stderr).splitlines() if "MLA_PREFILL_BACKEND_OVERRIDES" in line
    ]
    said.remove("""  MLA_PREFILL_BACKEND_OVERRIDES={"CUSTOM": oops""")  # the environment section's value
    assert len(said) == 1, said
    (finding,) = said
    assert finding.startswith(
        """  PROBLEM  MLA_PREFILL_BACKEND_OVERRIDES='{"CUSTOM": oops' cannot be used: """
    )
    assert "no MLA prefill backend can be selected (an engine stops at start) until it is fixed" in finding
    assert finding.endswith(f"Write it as MLA_PREFILL_BACKEND_OVERRIDES='{OVERRIDES_EXAMPLE}'.")
    assert "verdict: 1 problem found (see the findings)." in proc.stdout


@pytest.mark.vllm_patch  # info's report of the patch
def test_info_shows_the_platform_and_each_backends_claim(slow: dict[str, Any]) -> None:
    proc = slow["info_claim"]
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert_no_traceback(proc)
    lines = proc.stdout.splitlines()
    (platform_line,) = [line for line in lines if line.startswith("platform: ")]
    assert platform_line.endswith(": the add-on serves MLA prefill here"), platform_line
    if not cuda_here():
        assert platform_line in (
            "platform: CPU: the add-on serves MLA prefill here",
            "platform: none (vLLM detected no GPU platform): the add-on serves MLA prefill here",
        )
    where = "does not apply on this device" if cuda_here() else "applies on this device"
    assert (
        f"  ok       DEMO_CLAIM (entry point of package demo-claim): {CLAIM_CLASS}; "
        f"claim: cpu; before FLASH_ATTN ({where})"
    ) in lines
    assert (
        "  ok       TORCH_SDPA (built-in): mla_prefill_ext.backends.torch_sdpa.TorchSDPAPrefillBackend"
        in lines
    )
    if not cuda_here():
        assert any(
            line.endswith(": DEMO_CLAIM would serve (it joined automatic selection by its claim)")
            for line in lines
        )
    assert lines[-1] == "verdict: ok: the add-on is active and vLLM's MLA layer is patched."


def _problems(proc: Any) -> list[str]:
    """The PROBLEM lines of an ``info`` run that failed as it should (exit 1, no traceback)."""
    assert proc.returncode == 1, proc.stdout
    assert_no_traceback(proc)
    return [line for line in proc.stdout.splitlines() if line.startswith("  PROBLEM")]


def _needs_here() -> list[object]:
    from mla_prefill_ext.hosts.core.shared_prefix import needs

    here = needs.runners_here()
    return [n for n in needs.NEEDS if n.runner == needs.ANY or n.runner in here]


def test_info_says_whether_the_shared_prefix_path_is_on_and_why(slow: dict[str, Any]) -> None:
    on = slow["info_claim"].stdout.splitlines()
    off = slow["info_shared_off"]
    invalid = slow["info_shared_invalid"]
    lines = [line for line in on if line.startswith("shared-prefix path:")]
    from mla_prefill_ext import versions

    if versions.installed_vllm_version() in versions.TESTED:  # served on the runners vLLM picks here
        assert lines and lines[0].startswith("shared-prefix path: on: requests sharing a cached prefix"), on
        assert lines[0].endswith(
            "an idle engine core takes a burst of requests over a shared prefix into one step, waiting up to "
            "100 ms while they arrive (MLA_PREFILL_SHARED_PREFIX_GATHER_MS=0 turns it off; not with data "
            "parallelism)"
        ), lines
        assert "the engine core reuses a shared prefix's block hashes (MLA models;" in lines[0], lines
        assert "the shared-prefix path is off" not in on[-1], on[-1]
        # Each vLLM internal it reads, with its outcome: none fails on a runner vLLM picks here.
        table = on[on.index(lines[0]) + 2 : on.index(lines[0]) + 2 + len(_needs_here())]
        problems = [row for row in table if "PROBLEM" in row]
        assert len(table) == len(_needs_here()), table
        # vLLM 0.25 may run a model on its V2 runner, whose builders get no req_idx: that row, said.
        line = versions.release(versions.installed_vllm_version())[:2]
        expected = ["plan, V2: vllm.v1.attention.backend.CommonAttentionMetadata"] if line == (0, 25) else []
        assert [next((e for e in expected if e in row), row) for row in problems] == expected, problems
    else:
        assert lines and lines[0].startswith("shared-prefix path: off: "), on
        assert "the shared-prefix path is off (see its line)" in on[-1], on[-1]
    assert off.returncode == 0, off.stdout + off.stderr[-2000:]
    assert "shared-prefix path: off: turned off by MLA_PREFILL_SHARED_PREFIX" in off.stdout.splitlines()
    # Refused when vLLM's MLA module loads (an engine stops at start), named once.
    assert _problems(invalid) == [
        "  PROBLEM  mla-prefill-ext: MLA_PREFILL_SHARED_PREFIX='maybe' is not a switch: use 1/true/on "
        "or 0/false/off."
    ]
    # The gathering's window: an MLA model's engine core stops at start with it.
    assert _problems(slow["info_gather_invalid"]) == [
        "  PROBLEM  MLA_PREFILL_SHARED_PREFIX_GATHER_MS='soon' is not a window in ms: use a number from 0 "
        "(off) to 1000; an engine core of an MLA model stops at start with it."
    ]
