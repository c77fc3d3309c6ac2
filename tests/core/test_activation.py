"""Activation through vLLM's plugin loader, the all-or-none patch, and its symmetric removal."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterator
from importlib.metadata import entry_points
from typing import Any

import pytest
import wrapt
from child_python import run_python

import mla_prefill_ext
from mla_prefill_ext import activation
from mla_prefill_ext.hosts import vllm_0_20 as patches
from mla_prefill_ext.hosts.core.stock_guard import STOCK_GUARD
from mla_prefill_ext.hosts.vllm_0_20.targets import TARGETS

WRAPPED = [t.path for t in TARGETS if t.wrapped]


def resolve(module: Any, path: str) -> Any:
    obj = module
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def raw(module: Any, path: str) -> Any:
    """The attribute as stored on its owner (a wrapper shows as FunctionWrapper)."""
    owner_path, _, name = path.rpartition(".")
    owner = resolve(module, owner_path) if owner_path else module
    return owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)


def chain(obj: Any) -> list[Any]:
    """The wrappers around a function, outermost first (the patch's, then the shared-prefix path's on
    the builder's ``build``), and the function itself last."""
    out = [obj]
    while isinstance(out[-1], wrapt.FunctionWrapper):
        out.append(out[-1].__wrapped__)
    return out


def assert_only_the_guard(module: Any, missing: str | None = None) -> None:
    """Nothing patched; MLAAttention.__init__ carries only the explicit-choice guard."""
    for path in WRAPPED:
        if path == missing:
            continue
        attr = raw(module, path)
        if path == "MLAAttention.__init__":
            assert attr is STOCK_GUARD.handle, path
        else:
            assert not isinstance(attr, wrapt.FunctionWrapper), path


def messages(records: list[logging.LogRecord]) -> list[str]:
    return [r.getMessage() for r in records]


@pytest.fixture
def mla_module() -> Iterator[Any]:
    """The patched module; the patch is restored whatever the test did to it."""
    mla_prefill_ext.activate()
    module = importlib.import_module(patches.MLA_MODULE)
    yield module
    mla_prefill_ext.activate()
    assert patches.is_instrumented()


def test_entry_point_is_installed():
    eps = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert eps.get("mla_prefill_ext") == "mla_prefill_ext:activate"


@pytest.mark.vllm_patch
def test_wrappers_on_the_real_classes(mla_module):
    for path in WRAPPED:
        assert isinstance(raw(mla_module, path), wrapt.FunctionWrapper), path


@pytest.mark.vllm_patch
def test_deactivate_removes_every_wrapper_and_activate_restores(mla_module):
    originals = {path: chain(raw(mla_module, path))[-1] for path in WRAPPED}
    mla_prefill_ext.deactivate()
    assert not patches.is_instrumented() and not activation.is_active()
    for path in WRAPPED:
        assert raw(mla_module, path) is originals[path], path
    mla_prefill_ext.deactivate()  # idempotent
    mla_prefill_ext.activate()
    for path in WRAPPED:
        assert isinstance(raw(mla_module, path), wrapt.FunctionWrapper), path


@pytest.mark.vllm_patch
def test_activating_twice_wraps_once(mla_module):
    depth = {path: len(chain(raw(mla_module, path))) for path in WRAPPED}
    mla_prefill_ext.activate()
    mla_prefill_ext.activate()
    patches.instrument(mla_module)
    for path in WRAPPED:
        # One wrapper of the patch's on each target; the builder's build also the shared-prefix path's.
        assert len(chain(raw(mla_module, path))) == depth[path] == (3 if path.endswith(".build") else 2), path


@pytest.mark.vllm_patch
def test_missing_target_patches_nothing_and_says_why(mla_module, addon_log, monkeypatch):
    monkeypatch.delenv("MLA_PREFILL_BACKEND", raising=False)
    mla_prefill_ext.deactivate()
    saved = mla_module.use_cudnn_prefill
    del mla_module.use_cudnn_prefill  # a vLLM that changed under us
    try:
        mla_prefill_ext.activate()
        assert not patches.is_instrumented()
        assert_only_the_guard(mla_module, missing="use_cudnn_prefill")
        assert any(
            "not patching vLLM" in m and "use_cudnn_prefill not found" in m for m in messages(addon_log)
        )
        assert "use_cudnn_prefill not found" in patches.state().skipped_reason
    finally:
        mla_module.use_cudnn_prefill = saved
        mla_prefill_ext.deactivate()


@pytest.mark.vllm_patch
def test_changed_target_shape_patches_nothing(mla_module, monkeypatch):
    mla_prefill_ext.deactivate()
    cls = mla_module.MLACommonImpl
    original = cls.forward_mha

    def forward_mha(self, *args: Any, **kwargs: Any) -> None:  # another signature
        return None

    monkeypatch.setattr(cls, "forward_mha", forward_mha)
    mla_prefill_ext.activate()
    assert not patches.is_instrumented()
    assert "MLACommonImpl.forward_mha lacks parameters ['q'," in patches.state().skipped_reason
    monkeypatch.setattr(cls, "forward_mha", original)
    mla_prefill_ext.deactivate()


@pytest.mark.vllm_patch
def test_missing_target_with_explicit_choice_raises(mla_module, monkeypatch):
    monkeypatch.setenv("MLA_PREFILL_BACKEND", "FLASH_ATTN")
    mla_prefill_ext.deactivate()
    saved = mla_module.MLACommonMetadataBuilder.build
    monkeypatch.delattr(mla_module.MLACommonMetadataBuilder, "build")
    try:
        with pytest.raises(
            RuntimeError, match=r"cannot honour MLA_PREFILL_BACKEND=FLASH_ATTN.*build is no longer defined"
        ):
            mla_prefill_ext.activate()
        assert not patches.is_instrumented()
    finally:
        monkeypatch.setattr(mla_module.MLACommonMetadataBuilder, "build", saved)
        mla_prefill_ext.deactivate()
        monkeypatch.delenv("MLA_PREFILL_BACKEND")


@pytest.mark.vllm_patch
def test_unsupported_vllm_version_is_left_stock(mla_module, monkeypatch, addon_log):
    from mla_prefill_ext import versions

    monkeypatch.delenv("MLA_PREFILL_BACKEND", raising=False)
    mla_prefill_ext.deactivate()
    monkeypatch.setattr(versions, "installed_vllm_version", lambda: "0.21.0")
    try:
        mla_prefill_ext.activate()
        assert not patches.is_instrumented()
        assert_only_the_guard(mla_module)
        said = [m for m in messages(addon_log) if "vLLM 0.21.0 is not supported" in m]
        assert len(said) == 1, said  # one line, though activation and the import hook both saw it
        mla_prefill_ext.deactivate()
        monkeypatch.setenv("MLA_PREFILL_BACKEND", "TORCH_SDPA")
        with pytest.raises(RuntimeError, match=r"cannot honour MLA_PREFILL_BACKEND=TORCH_SDPA.*0\.21\.0"):
            mla_prefill_ext.activate()
        assert not activation.is_active()
    finally:
        monkeypatch.undo()
        mla_prefill_ext.deactivate()


@pytest.mark.parametrize(
    "version,supported",
    [
        ("0.20.0", True),
        ("0.20.2", True),
        ("0.20.3.dev4+gabc", True),
        ("0.19.1", False),
        ("0.21.0rc1", False),
        ("0.21.0", False),
    ],
)
def test_version_gate(version, supported):
    from mla_prefill_ext.versions import PATCH, unsupported_reason

    assert (unsupported_reason(PATCH, version) is None) is supported


# Import order and vLLM's own plugin loader need a fresh interpreter each.
LOAD_PLUGINS = "import vllm.plugins; vllm.plugins.load_general_plugins()"
IMPORT_MLA = "import importlib; importlib.import_module('vllm.model_executor.layers.attention.mla_attention')"
REPORT = (
    "import importlib, wrapt; from mla_prefill_ext.hosts import vllm_0_20 as patches; "
    "m = importlib.import_module(patches.MLA_MODULE); "
    "print('PATCHED', patches.is_instrumented(), "
    "isinstance(m.MLAAttention.__dict__['__init__'], wrapt.FunctionWrapper))"
)


def patch_report(*steps: str, **env: str) -> str:
    proc = run_python("\n".join([*steps, REPORT]), **env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.vllm_patch
def test_vllm_plugin_loader_activates_before_import():
    assert "PATCHED True True" in patch_report(LOAD_PLUGINS)


@pytest.mark.vllm_patch
def test_patch_modules_load_only_with_the_mla_module():
    """Activation alone (an API server, a model without MLA) loads none of the patch's modules."""
    loaded = (
        "import sys; H = 'mla_prefill_ext.hosts.'; "
        "print('LOADED', sorted(m for m in sys.modules if m.startswith(H) and m != H + 'vllm_0_20')); "
        "print('BRIDGE', sorted(m for m in sys.modules if m.startswith(H + 'vllm_0_23')))"
    )
    out = patch_report(LOAD_PLUGINS, loaded)
    assert "LOADED []" in out  # the version table is in versions, the MLA module's name in mla_layers
    assert "BRIDGE []" in out  # the other host never loads on vLLM 0.20
    assert "PATCHED True True" in out


def test_lazy_patch_names_resolve():
    for name in patches.__all__:
        assert getattr(patches, name) is not None
    assert patches.instrument == patches.mla.INSTRUMENTOR.instrument
    assert patches.targets.TARGETS == TARGETS  # submodules load by name too
    with pytest.raises(AttributeError, match="no attribute 'no_such_module'"):
        patches.no_such_module  # noqa: B018


@pytest.mark.vllm_patch
def test_activation_after_the_module_was_imported():
    assert "PATCHED True True" in patch_report(IMPORT_MLA, LOAD_PLUGINS)


def test_disable_env_keeps_it_inactive():
    assert "PATCHED False False" in patch_report(LOAD_PLUGINS, MLA_PREFILL_EXT_DISABLE="1")


@pytest.mark.vllm_patch
def test_stale_vllm_prefill_announcement_is_filtered(mla_module):
    logger = logging.getLogger(patches.MLA_MODULE)

    def passes(msg: str) -> bool:
        record = logger.makeRecord(logger.name, logging.INFO, __file__, 1, msg, (), None)
        return all(f.filter(record) for f in logger.filters)

    assert not passes("Using FlashAttention prefill for MLA")
    assert passes("FP8 prefill attention enabled: query data type is FP8")
    mla_prefill_ext.deactivate()
    assert passes("Using FlashAttention prefill for MLA")
