"""Shared fixtures. Tests run against the real vLLM 0.20.2 installed beside the package."""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# The shared helpers (tests/helpers/) import by bare module name, here and in the processes tests start.
sys.path.insert(0, str(Path(__file__).parent / "helpers"))
# Quiet vLLM's import-time chatter; the add-on's own lines are WARNING and up in these tests.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from logs import LogRecords

from mla_prefill_ext.testing import vllm_host as host


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _skip_other_modes(items)
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU host: see docs/gpu-verification.md)")
    # The engine verdicts only read recorded results: with MLA_GPU_RESULTS they replay anywhere.
    replay = (
        {
            "test_engine.py",
            "test_deployments.py",
            "test_bridge_engine.py",
            "test_shared_prefix.py",
            "test_shared_prefix_decode.py",
            "test_shared_prefix_tp2.py",
        }
        if os.environ.get("MLA_GPU_RESULTS")
        else set()
    )
    for item in items:
        if "gpu" in item.keywords and item.path.name not in replay:
            item.add_marker(skip)


def _skip_other_modes(items: list[pytest.Item]) -> None:
    """``vllm_patch`` tests run where the add-on patches vLLM (0.20), ``vllm_bridge`` where it bridges."""
    from mla_prefill_ext import versions

    mode = versions.decide()
    where = f"vLLM {mode.vllm_version} is served by the {mode.mode} mode"
    skips = {
        "vllm_patch": pytest.mark.skip(reason=f"about the vLLM 0.20 patch; {where}"),
        "vllm_bridge": pytest.mark.skip(reason=f"about the vLLM 0.23+ bridge; {where}"),
    }
    wanted = {versions.PATCH: "vllm_patch", versions.BRIDGE: "vllm_bridge"}.get(mode.mode)
    for item in items:
        for marker, skip in skips.items():
            if marker != wanted and marker in item.keywords:
                item.add_marker(skip)


@pytest.fixture
def flash_attn_kernels() -> None:
    """Skips a test whose expectations need FLASH_ATTN's kernel module to import here.

    On a CPU box vLLM 0.20.2's wheel has one that imports; 0.25.1's, 0.33.0's and 0.34.0's need CUDA
    libraries.
    """
    from mla_prefill_ext.backends.flash_attn import FlashAttnPrefillBackend

    if not FlashAttnPrefillBackend.is_available():
        pytest.skip("FLASH_ATTN's kernel module (vllm.vllm_flash_attn or flash-attn) does not import here")


@pytest.fixture
def shim() -> Any:
    """The add-on activated in this process and vLLM's MLA module patched (vLLM 0.20 only)."""
    import mla_prefill_ext
    from mla_prefill_ext import versions
    from mla_prefill_ext.hosts import vllm_0_20 as patches

    mode = versions.decide()
    if mode.mode != versions.PATCH:
        pytest.skip(f"about the vLLM 0.20 patch; vLLM {mode.vllm_version} is served by the {mode.mode} mode")

    mla_prefill_ext.activate()
    module = importlib.import_module(patches.MLA_MODULE)
    assert patches.is_instrumented(), patches.state().skipped_reason
    return module


@pytest.fixture
def clean_selection(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """No backend choice, registration or cached selection, before and after the test."""
    from mla_prefill_ext import selector
    from mla_prefill_ext.registry import OVERRIDES_ENV, MLAPrefillBackendEnum

    def reset() -> None:
        from mla_prefill_ext import _logging, registry

        for member in list(MLAPrefillBackendEnum):
            member.clear_override()
        registry._ENTRY_POINTS.clear()
        registry._DISCOVERED = None
        _logging.forget_logged()
        selector.clear_cache()

    monkeypatch.delenv(selector.BACKEND_ENV, raising=False)
    monkeypatch.delenv(OVERRIDES_ENV, raising=False)
    reset()
    yield monkeypatch
    reset()


@pytest.fixture
def r1(model_dirs: dict[str, Path]) -> Path:
    """A model folder (config.json only) with DeepSeek-R1's MLA dims."""
    return model_dirs["plain"]


@pytest.fixture
def non_r1(model_dirs: dict[str, Path]) -> Path:
    """A model folder with MLA dims other than R1's (qk 64+32, v 64)."""
    return model_dirs["non_r1"]


@pytest.fixture
def site(tmp_path: Path, clean_selection: pytest.MonkeyPatch) -> Iterator[Path]:
    """A folder first on sys.path to install backend packages into; their modules unloaded after."""
    clean_selection.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [n for n in sys.modules if n.startswith("fakepkg_")]:
        del sys.modules[name]


@pytest.fixture
def addon_log() -> Iterator[list[logging.LogRecord]]:
    """Records of the add-on's logger (vLLM's loggers do not propagate to caplog's root)."""
    handler = LogRecords()
    logger = logging.getLogger("vllm.mla_prefill_ext")
    logger.addHandler(handler)
    yield handler.records
    logger.removeHandler(handler)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "plain": host.write_model_dir(root / "tiny-deepseek-v2"),
        "yarn": host.write_model_dir(root / "tiny-deepseek-v3-yarn", rope_scaling=host.YARN_ROPE_SCALING),
        "non_r1": host.write_model_dir(
            root / "tiny-mla-non-r1", qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64
        ),
    }


@pytest.fixture
def paused_parts() -> Iterator[Any]:
    """The benchmarks' ``pause`` of the shared-prefix path's parts; every part resumed after the test."""
    from scripts.bench import path_parts

    yield path_parts.pause
    path_parts.pause(())
