"""``info`` on vLLM 0.23+: vLLM's own pick explained in words, and nothing of the add-on when it is off.

The rendering tests run everywhere; the ``vllm_bridge`` ones run ``info`` on the bridged vLLM of the
environment (0.25.1, 0.33.0, 0.34.0).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mla_prefill_ext.cli.info import ChoiceReport
from mla_prefill_ext.hosts.vllm_0_23 import report
from mla_prefill_ext.settings import DISABLE_ENV, ENV_VARS
from mla_prefill_ext.value_types import AUTOMATIC

FA_IMPORT_ERROR = (
    "ImportError: cannot import name 'compile_flash_attn_varlen_func_from_specs' from "
    "'vllm.v1.attention.backends.fa_utils'"
)


def choice_lines(disabled: bool) -> str:
    info = {"requested": "AUTO", "source": AUTOMATIC, "vllm_decides": True, "disabled": disabled}
    return "\n".join(ChoiceReport(info, []).text_lines())


def test_with_the_addon_off_vllm_decides_alone():
    off = choice_lines(disabled=True)
    assert "the add-on is off" in off and "no claims, no TORCH_SDPA fallback" in off
    assert "with the add-on's claims" not in off
    assert "with the add-on's claims and TORCH_SDPA fallback" in choice_lines(disabled=False)


def test_an_import_error_of_vllms_pick_is_put_in_words():
    no_gpu = report.explain_no_pick(FA_IMPORT_ERROR, None)
    assert no_gpu.startswith("vLLM's own automatic selection picks a backend whose module does not import")
    assert "expected on a machine without a GPU" in no_gpu and "MLA_PREFILL_BACKEND=TORCH_SDPA" in no_gpu
    assert "reinstall vLLM" in report.explain_no_pick(FA_IMPORT_ERROR, object())
    assert report.explain_no_pick("ValueError: no backend can serve", None) is None  # it says itself


def info(**env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    return subprocess.run(
        [sys.executable, "-m", "mla_prefill_ext", "info"],
        env={**environ, "VLLM_LOGGING_LEVEL": "ERROR", **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.vllm_bridge
def test_info_with_the_addon_disabled_describes_stock_vllm():
    done = info(**{DISABLE_ENV: "1"})
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert "claims and TORCH_SDPA fallback)" not in done.stdout
    assert f"bridge: not in place ({DISABLE_ENV} is set)" in done.stdout
    assert "the add-on is off: vLLM's attention_config.mla_prefill_backend" in done.stdout


@pytest.mark.vllm_bridge
def test_info_explains_vllms_pick_when_it_does_not_import():
    lines = info().stdout.splitlines()
    at = [i for i, line in enumerate(lines) if line.startswith("  vLLM's automatic pick here: none (")]
    if not at or "ImportError" not in lines[at[0]]:
        pytest.skip("vLLM's own automatic pick imports here (or says why not itself)")
    assert lines[at[0] + 1].startswith("    that is: vLLM's own automatic selection picks a backend")


# What vLLM 0.23+ and PyTorch log on a machine without a GPU beyond the quick start's list (README).
BRIDGE_CPU_LOG_LINES = (
    "Failed to import from vllm._C: ModuleNotFoundError(\"No module named 'vllm._C'\")",
    "torch._opaque_base is deprecated, use torch._custom_class_base instead",
    "register_opaque_type is deprecated, use register_custom_class instead",
    "typ='value' is deprecated, use typ='constant' instead",
)


@pytest.mark.vllm_bridge
def test_the_readme_explains_every_stderr_line_of_check_on_a_cpu():
    import torch
    from cli_runs import ROOT
    from cpu_log_lines import CPU_LOG_LINES

    if torch.cuda.is_available():
        pytest.skip("about a machine without a GPU")
    environ = {k: v for k, v in os.environ.items() if k not in ENV_VARS and k != "VLLM_LOGGING_LEVEL"}
    done = subprocess.run(
        [sys.executable, "-m", "mla_prefill_ext", "check", "--json", "--repeat", "1"],
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    readme = " ".join((ROOT / "README.md").read_text().split())
    known = (*CPU_LOG_LINES, *BRIDGE_CPU_LOG_LINES)
    assert all(" ".join(line.split()) in readme for line in known)
    for line in filter(str.strip, done.stderr.splitlines()):
        assert any(k in line for k in known), f"the README does not explain: {line}"
