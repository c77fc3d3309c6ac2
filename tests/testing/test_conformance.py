"""The conformance suite: built-in backends pass it, and each broken variant fails it by name."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import conformance_mutants as mutants
import pytest
import torch

from mla_prefill_ext.backends.base import AutoSelectClaim
from mla_prefill_ext.registry import MLAPrefillBackendEnum
from mla_prefill_ext.testing import PROPERTIES, assert_conformant, run_conformance

pytestmark = pytest.mark.usefixtures("clean_selection")

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_PACKAGE = REPO / "examples" / "mla_prefill_example_backend"
BUILTINS = [m.name for m in MLAPrefillBackendEnum if m.is_builtin and m.value is not None]
SMALL = {"dims": [(64, 32, 64)], "num_heads": [2]}  # one small case: mutants fail on any
# What a bug's own failure brings with it: the merged result is wrong too (that is the point).
CONSEQUENCES = {"merge.whole_sequence"}


@pytest.mark.parametrize("name", BUILTINS)
def test_builtin_backends_conform_on_cpu(name: str) -> None:
    """Every built-in backend that can serve on a CPU passes; the others are refused, not run."""
    report = run_conformance(name, device="cpu", dtype=[torch.float32, torch.bfloat16])
    if not report.ran:
        assert report.skipped_cases and not report.results
        pytest.skip(f"{name} cannot serve on a CPU: {next(iter(report.skipped_cases.values()))}")
    assert report.ok, report.format()
    # R1 and non-R1 dims, 16 heads and 1, float32 and bfloat16: every property checked and passed.
    assert len(report.cases) == 8 and not report.skipped_cases
    for prop in PROPERTIES:
        assert report.status_of(prop) == "pass", (prop, report.format(verbose=True))


@pytest.mark.gpu
@pytest.mark.parametrize("name", BUILTINS)
def test_builtin_backends_conform_on_gpu(name: str) -> None:
    report = run_conformance(name, device="cuda")
    if not report.ran:
        pytest.skip(f"{name} cannot serve here: {next(iter(report.skipped_cases.values()))}")
    assert report.ok, report.format()


@pytest.mark.parametrize("mutant", mutants.MUTANTS, ids=lambda m: m.__name__)
def test_each_mutant_fails_under_its_own_property(mutant: type[mutants._Mutant]) -> None:
    report = run_conformance(mutant, device="cpu", dtype=torch.float32, **SMALL)
    assert report.ran and not report.ok
    assert mutant.FAILS in report.failed_properties, report.format()
    assert set(report.failed_properties) <= {mutant.FAILS, *CONSEQUENCES}, report.format()
    text = report.format()
    assert f"{mutant.FAILS}: " in text and "RESULT: FAIL" in text


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_reports_say_what_is_wrong(dtype: torch.dtype) -> None:
    """The messages name the measured error and the cause, in float32 and in bfloat16."""

    def failure(mutant: type[mutants._Mutant]) -> tuple[str, float | None, float | None]:
        report = run_conformance(mutant, device="cpu", dtype=dtype, **SMALL)
        (result,) = [r for r in report.failures if r.property == mutant.FAILS]
        return result.message, result.measured, result.tolerance

    msg, measured, tol = failure(mutants.WrongScale)
    assert "1.0200 x self.scale" in msg and measured > tol
    msg, _, _ = failure(mutants.DefaultScale)
    assert "= 1/sqrt(qk_head_dim), the default scale: self.scale is ignored" in msg
    msg, measured, tol = failure(mutants.Base2LSE)
    assert msg.startswith("max |lse - ref| = ") and "the LSE is in base 2" in msg
    assert measured > 0.3 and tol <= 2e-3  # a base-2 LSE is off by lse * 0.44
    msg, _, _ = failure(mutants.TransposedLSE)
    assert "LSE shape [25, 2], expected [num_heads, tokens] = [2, 25] (transposed" in msg
    msg, _, _ = failure(mutants.PaddedOutput)
    assert "last dim 96, expected v_head_dim 64 (the qk head dim: V padded" in msg
    msg, measured, _ = failure(mutants.MutatesInput)
    assert msg.startswith("after one step the backend had written to k:") and measured > 0
    msg, _, _ = failure(mutants.NonCausal)
    assert "request 0's new tokens perturbed, its first half must not change" in msg


def test_report_as_json_and_assert_conformant() -> None:
    report = run_conformance(mutants.Base2LSE, device="cpu", dtype="float32", **SMALL)
    data = json.loads(json.dumps(report.to_dict(), allow_nan=False))
    assert data["ok"] is False and data["backend"] == "MUTANT"
    assert data["failed_properties"] == ["lse.natural_log", "merge.whole_sequence"]
    assert data["properties"]["lse.natural_log"]["status"] == "fail"
    assert data["properties"]["scale"]["status"] == "pass"
    assert data["tolerances"] == {"float32": {"output_rel": 2e-05, "lse_abs": 1e-4}}
    (lse,) = [r for r in data["results"] if r["property"] == "lse.natural_log"]
    assert lse["case"] == "float32, qk 64+32 v 64, 2 heads" and lse["tolerance"] == 1e-4
    assert lse["measured"] > 2.0
    with pytest.raises(AssertionError, match=r"lse\.natural_log: float32, qk 64\+32 v 64, 2 heads: max"):
        assert_conformant(mutants.Base2LSE, device="cpu", dtype="float32", **SMALL)
    # A class path resolves too (as the CLI's --backend may give one).
    path = "mla_prefill_ext.backends.torch_sdpa:TorchSDPAPrefillBackend"
    assert assert_conformant(path, device="cpu", dtype="float32", **SMALL).backend == "TORCH_SDPA"


def test_cases_the_backend_refuses_are_skipped_and_never_run() -> None:
    mutants.R1Only.built.clear()
    report = run_conformance(mutants.R1Only, device="cpu", dtype="float32", num_heads=[2])
    assert report.ok, report.format()
    assert report.skipped_cases == {
        "float32, qk 64+32 v 64, 2 heads": "model does not have DeepSeek-R1 MLA dimensions "
        "(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)"
    }
    assert set(mutants.R1Only.built) == {(128, 64, 128)}
    assert "SKIP  float32, qk 64+32 v 64, 2 heads: model does not have" in report.format()


def test_a_backend_that_serves_nothing_here_is_not_conformant() -> None:
    report = run_conformance("FLASH_ATTN", device="cpu", dtype="bfloat16", **SMALL)
    assert not report.ran and not report.ok and not report.results
    assert "needs a GPU" in report.skipped_cases["bfloat16, qk 64+32 v 64, 2 heads"]
    assert "nothing was checked" in report.format()


def _has_setuptools(major: int) -> bool:
    """Whether this environment has setuptools >= ``major`` (what the example's build needs)."""
    try:
        from importlib.metadata import version

        return int(version("setuptools").split(".")[0]) >= major
    except (ImportError, ValueError):
        return False


def test_example_backend_package_installs_and_conforms(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pip-installs examples/mla_prefill_example_backend into a folder of its own (not the venv)."""
    src = tmp_path / "src"  # a copy: setuptools builds in the source tree
    shutil.copytree(EXAMPLE_PACKAGE, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    target = tmp_path / "site"
    # Offline hosts (the GPU host has no index): build with this environment's setuptools.
    isolation = ["--no-build-isolation"] if _has_setuptools(77) else []
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            *isolation,
            "--target",
            str(target),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr

    monkeypatch.syspath_prepend(str(target))
    counts = tmp_path / "calls.txt"
    monkeypatch.setenv("MLA_PREFILL_EXAMPLE_COUNT_FILE", str(counts))
    sys.modules.pop("mla_prefill_example_backend", None)
    try:
        found = entry_points(group="mla_prefill_ext.backends").select(name="EXAMPLE")
        (ep,) = [e for e in found if Path(e.dist.locate_file("")).resolve() == target.resolve()]
        assert ep.value == "mla_prefill_example_backend:ExamplePrefillBackend"
        cls = ep.load()
        assert Path(sys.modules[cls.__module__].__file__).is_relative_to(target)
        assert cls.get_name() == "EXAMPLE"
        assert cls.auto_select_claim == AutoSelectClaim(("9.x", "cpu"), before="FLASH_ATTN")
        report = assert_conformant(cls, device="cpu", dtype=[torch.float32, torch.bfloat16])
        assert len(report.cases) == 8 and not report.skipped_cases
    finally:
        sys.modules.pop("mla_prefill_example_backend", None)
    lines = counts.read_text().splitlines()
    kinds = {line.split()[1] for line in lines}
    assert kinds == {"prepare_metadata", "new_tokens", "context_chunk"}
    assert {line.split()[0] for line in lines} == {str(os.getpid())}
