"""The bridge on vLLM 0.25.1, end to end on a GPU: the add-on's backends inside vLLM's own selector.

Run by scripts/gpu_bridge_suite.sh on a GPU host with vLLM 0.25.1 installed (vLLM 0.33 needs a
PyTorch the GPU host does not have: the CPU suite is its proof). The scenarios are those of
the 0.20 suite (scripts/gpu_harness/scenarios.py); ``stock`` is vLLM 0.25.1 with the add-on disabled,
so its MLA prefill is vLLM's own FLASH_ATTN backend. The verdicts:

* the add-on's FLASH_ATTN, chosen by ``MLA_PREFILL_BACKEND`` alone, gives vLLM's own
  FLASH_ATTN's tokens and logprobs bit for bit (same kernel), with and without 4 context
  chunks per step;
* FLASHINFER (``additional_config``; vLLM 0.25 has no FlashInfer prefill on SM90) stays
  within bf16 noise (the FA3 family's bound);
* TORCH_SDPA (PyTorch's flash kernel, an FA2) is no further from stock than vLLM's own FA2
  prefill is (``stock-fa2-eager``, the same engine on FlashAttention 2: the calibration),
  with headroom (verdict.family_noise);
* the scale-2% and base-2-LSE mutants (``CUSTOM``) fail both verdicts;
* ``CUSTOM`` registered only in the user's process runs in the spawned engine core.
"""

from __future__ import annotations

import functools

import pytest

from scripts.gpu_harness import verdict
from tests.gpu.recorded_runs import check, log_of, result

pytestmark = pytest.mark.gpu

VLLM = "0.25"


@pytest.fixture(autouse=True, scope="module")
def bridged_vllm() -> None:
    from mla_prefill_ext import versions

    version = versions.installed_vllm_version() or ""
    if not version.startswith(VLLM):
        pytest.skip(f"the bridge's GPU run is for vLLM {VLLM}.x (installed: {version or 'none'})")


PARITY = [
    ("shim-fa", "stock", "identical"),
    ("shim-fa-chunks", "stock-chunks", "identical"),
    ("custom-spawn", "stock-eager", "identical"),  # the counting backend runs the add-on's FLASH_ATTN
    ("shim-fi", "stock", "bf16_noise"),
    ("shim-fi-chunks", "stock-chunks", "bf16_noise"),
]


@pytest.mark.parametrize(("candidate", "reference", "kind"), PARITY, ids=[p[0] for p in PARITY])
def test_parity_with_vllms_own_flash_attn(candidate, reference, kind):
    v = check(kind, candidate, reference)
    print(v)
    assert v.passed, str(v)


def fa2_calibration() -> verdict.Verdict:
    """vLLM's own prefill on FA2 against its FA3, the engine otherwise the same: how far a kernel of
    the FA2 family parts from stock on these weights (its verdict at the FA3 family's bound, which
    it does not meet)."""
    fa2 = result("stock-fa2-eager")
    assert fa2["ok"], fa2.get("error")
    # The engine really ran vLLM's FA2 library (FA3 stays loaded: vLLM's MLA decode on SM90).
    assert all("_vllm_fa2_C" in libraries for libraries in fa2["flash_attn_libraries"])
    return check("bf16_noise", "stock-fa2-eager", "stock-eager")


# TORCH_SDPA compiled is judged against compiled stock with the bound of the eager calibration.
FAMILY = [("shim-sdpa-eager", "stock-eager"), ("shim-sdpa", "stock")]


@pytest.mark.parametrize(("candidate", "reference"), FAMILY, ids=[f[0] for f in FAMILY])
def test_torch_sdpa_is_no_further_from_stock_than_vllms_own_fa2(candidate, reference):
    calibration = fa2_calibration()
    print(f"calibration: {calibration}\nbound: {verdict.kernel_family_bound(calibration):.4g}")
    v = check(
        "family_noise",
        candidate,
        reference,
        judge=functools.partial(verdict.family_noise, calibration=calibration),
    )
    print(v)
    assert v.passed, str(v)


@pytest.mark.parametrize("mutant", ["mutant-scale", "mutant-lse2"])
def test_mutant_backend_fails_the_kernel_family_verdict(mutant):
    """The wider bound still tells a wrong backend from a kernel of another family."""
    judge = functools.partial(verdict.family_noise, calibration=fa2_calibration())
    v = check("family_noise", mutant, "stock-chunks", judge=judge)
    print(f"{mutant} (expected to FAIL):\n{v}")
    assert not v.passed, f"the kernel-family verdict cannot tell {mutant} from stock: {v}"


@pytest.mark.parametrize(
    ("name", "backend", "source"),
    [
        ("shim-fa", "FLASH_ATTN", "MLA_PREFILL_BACKEND"),
        ("shim-fa-chunks", "FLASH_ATTN", "MLA_PREFILL_BACKEND"),
        ("shim-fi", "FLASHINFER", "additional_config"),
        ("shim-sdpa", "TORCH_SDPA", "MLA_PREFILL_BACKEND"),
        ("shim-sdpa-eager", "TORCH_SDPA", "MLA_PREFILL_BACKEND"),
        ("custom-spawn", "CUSTOM", "MLA_PREFILL_BACKEND"),
        ("mutant-scale", "CUSTOM", "MLA_PREFILL_BACKEND"),
        ("mutant-lse2", "CUSTOM", "MLA_PREFILL_BACKEND"),
    ],
)
def test_the_addon_backend_is_in_force_through_vllms_selector(name, backend, source):
    """The engine process logged the add-on's choice, made inside vLLM 0.25.1's own selector."""
    data = result(name)
    assert data["ok"], data.get("error")
    assert f"Using {backend} MLA prefill backend (mla-prefill-ext, from {source}" in log_of(name)
    assert "through vLLM 0.25" in log_of(name)


@pytest.mark.parametrize("name", ["stock", "stock-chunks", "stock-eager"])
def test_stock_is_vllms_own_prefill(name):
    data = result(name)
    assert data["ok"], data.get("error")
    assert "mla-prefill-ext" not in log_of(name)


@pytest.mark.parametrize("mutant", ["mutant-scale", "mutant-lse2"])
def test_mutant_backend_fails_the_bf16_noise_verdict(mutant):
    v = check("bf16_noise", mutant, "stock-chunks")
    print(f"{mutant} (expected to FAIL):\n{v}")
    assert not v.passed, f"the verdict cannot tell {mutant} from stock: {v}"


def test_custom_registered_in_the_driver_runs_in_the_spawned_engine_core():
    data = result("custom-spawn")
    calls = data.get("custom_calls")
    assert calls and calls["lines"] > 0, "the CUSTOM backend was never called"
    assert data["pid"] not in calls["pids"], "it ran in the user's process, not the engine's"
    assert {"new_tokens", "context_chunk"} <= set(calls["kinds"])


def test_context_chunks_were_merged_in_the_engine():
    for name in ("stock-chunks", "shim-fa-chunks", "shim-fi-chunks", "mutant-scale", "mutant-lse2"):
        ev = result(name)["context_chunks"]
        assert ev["ran_in_engine_process"] and ev["max_chunks_per_step"] >= 3, (name, ev)
