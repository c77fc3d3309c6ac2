"""Deployments: settings reach every process, platforms keep their own prefill, per-builder step state.

All with vLLM 0.20.2's real objects on CPU (mla_prefill_ext/testing/vllm_host.py: the device facts patched).
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from mla_layer_on_cpu import build_layer, make_builder
from platform_views import PLATFORMS, platform_view

from mla_prefill_ext import activation, settings
from mla_prefill_ext.testing import vllm_host as host

pytestmark = pytest.mark.vllm_patch  # the patch of vLLM 0.20 (skipped where the add-on bridges)

SETTINGS = {settings.BACKEND_ENV, settings.OVERRIDES_ENV, settings.DISABLE_ENV}


# --- Settings reach Ray workers through vLLM's own copy list -------------------------------------


def test_vllm_copies_every_setting_to_ray_workers(clean_selection):
    from vllm.ray.ray_env import get_env_vars_to_copy

    from mla_prefill_ext import MLAPrefillBackendEnum, register_mla_prefill_backend

    clean_selection.delenv(settings.RAY_COPY_LIST_ENV, raising=False)
    assert not SETTINGS & get_env_vars_to_copy()  # vLLM alone would not copy them
    clean_selection.setenv(settings.BACKEND_ENV, "CUSTOM")
    register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, "custom_backends.CountingBackend")
    activation.activate()
    copied = get_env_vars_to_copy(destination="workers")
    assert SETTINGS <= copied
    # What the Ray executor then sends each worker (vllm/v1/executor/ray_executor.py):
    import os

    sent = {name: os.environ[name] for name in copied if name in os.environ}
    assert sent[settings.BACKEND_ENV] == "CUSTOM"
    assert "custom_backends.CountingBackend" in sent[settings.OVERRIDES_ENV]


def test_the_disable_switch_reaches_ray_workers_too():
    """Disabled in the driver: the add-on does nothing there, but vLLM still copies the switch."""
    from child_python import run_python

    result = run_python(
        """
        import mla_prefill_ext
        mla_prefill_ext.activate()
        from vllm.ray.ray_env import get_env_vars_to_copy
        print("ACTIVE", mla_prefill_ext.activation.is_active())
        print("COPIED", "MLA_PREFILL_EXT_DISABLE" in get_env_vars_to_copy())
        """,
        MLA_PREFILL_EXT_DISABLE="1",
    )
    assert result.returncode == 0, result.stderr
    assert "ACTIVE False" in result.stdout and "COPIED True" in result.stdout


# --- A process whose settings differ from the engine's stamp refuses (test_engine_config.py) --


def test_layer_build_refuses_when_settings_did_not_arrive(shim, clean_selection, model_dirs):
    cfg = host.make_vllm_config(
        model_dirs["plain"],
        additional_config={settings.STAMP_KEY: {**settings.snapshot(), settings.BACKEND_ENV: "TORCH_SDPA"}},
    )
    with pytest.raises(RuntimeError, match="Set MLA_PREFILL_BACKEND='TORCH_SDPA'"):
        build_layer(cfg, (9, 0))


# --- Where vLLM keeps its own prefill, layer by layer (the decisions: test_scope.py) -------------------


@pytest.fixture
def stock_flash_attn(shim, monkeypatch) -> None:
    """A platform whose vLLM build ships FlashAttention (the CPU box has none): stock init then runs."""
    monkeypatch.setattr(shim, "flash_attn_varlen_func", lambda *a, **k: None)


@pytest.mark.parametrize("name", ["rocm-mi300", "xpu"])
def test_stock_prefill_stays_on_other_platforms(
    shim, clean_selection, model_dirs, stock_flash_attn, name, addon_log, monkeypatch
):
    import logging

    from mla_prefill_ext import _logging

    monkeypatch.setattr(_logging, "_LOGGED", set())
    addon_logger = logging.getLogger("vllm.mla_prefill_ext")
    level = addon_logger.level
    addon_logger.setLevel(logging.INFO)  # the line is INFO; these tests run vLLM at WARNING
    cfg = host.make_vllm_config(model_dirs["plain"])
    stack = platform_view(name)
    for p in stack:
        p.start()
    try:
        layer = build_layer(cfg, PLATFORMS[name][1])
        # The legacy choice functions answer as stock there.
        assert shim.use_flashinfer_prefill() is False
    finally:
        for p in reversed(stack):
            p.stop()
    assert layer.prefill_backend is None
    impl = layer.impl
    assert "has its own MLA prefill kernels" in impl._mla_prefill_stock_reason
    assert "prefill_backend" not in vars(impl)
    assert impl._run_prefill_new_tokens.__func__ is type(impl)._run_prefill_new_tokens_fa  # vLLM's own
    addon_logger.setLevel(level)
    infos = [r.getMessage() for r in addon_log]
    assert any("leaves vLLM's own MLA prefill in place" in m for m in infos), infos


def test_explicit_choice_is_honoured_on_rocm(shim, clean_selection, model_dirs, stock_flash_attn):
    from mla_prefill_ext.backends.torch_sdpa import TorchSDPAPrefillBackend

    clean_selection.setenv(settings.BACKEND_ENV, "TORCH_SDPA")
    stack = platform_view("rocm-mi300")
    for p in stack:
        p.start()
    try:
        layer = build_layer(host.make_vllm_config(model_dirs["plain"]), (9, 4))
    finally:
        for p in reversed(stack):
            p.stop()
    assert isinstance(layer.prefill_backend, TorchSDPAPrefillBackend)
    assert layer.impl.prefill_backend is layer.prefill_backend


def test_explicit_choice_that_cannot_serve_on_xpu_is_refused(
    shim, clean_selection, model_dirs, stock_flash_attn
):
    clean_selection.setenv(settings.BACKEND_ENV, "FLASH_ATTN")
    stack = platform_view("xpu")
    for p in stack:
        p.start()
    try:
        with pytest.raises(ValueError, match=r"FLASH_ATTN \(from MLA_PREFILL_BACKEND\) cannot serve"):
            build_layer(host.make_vllm_config(model_dirs["plain"]), None)
    finally:
        for p in reversed(stack):
            p.stop()


# --- Per-builder step state: dual-batch overlap, one preparation per step, workspaces at start ----


def test_micro_batch_builders_keep_their_own_step(shim, clean_selection, model_dirs):
    from vllm.config import set_current_vllm_config

    cfg = host.make_vllm_config(model_dirs["plain"])
    layers = [build_layer(cfg, None, f"model.layers.{i}.self_attn") for i in range(2)]
    ubatch = [make_builder(cfg, layers, None), make_builder(cfg, layers, None)]  # as enable_dbo makes them
    runners = [b._mla_prefill_runners for b in ubatch]
    assert all(len(r) == 1 for r in runners)  # both layers share one parameter set
    (r0,), (r1,) = (list(r.values()) for r in runners)
    assert r0 is not r1 and r0 is not layers[0].prefill_backend

    with host.gpu_view(None), set_current_vllm_config(cfg):
        m0 = ubatch[0].build(0, host.prefill_batch([5, 3]))
        m1 = ubatch[1].build(0, host.prefill_batch([7]))
    # Both micro-batches were built before either ran (as DBO does): neither overwrote the other.
    assert r0._prefill_metadata is m0.prefill and r1._prefill_metadata is m1.prefill

    heads, qk, v_dim = 4, 192, 128
    gen = torch.Generator().manual_seed(0)
    for m, tokens in ((m0, 8), (m1, 7), (m0, 8)):  # interleaved, as the two micro-batch threads run
        q, k = (torch.randn(tokens, heads, qk, generator=gen) for _ in range(2))
        v = torch.randn(tokens, heads, v_dim, generator=gen)
        with mock.patch.object(type(r0), "prepare_metadata") as prepare:
            for layer in layers:
                out = layer.impl._run_prefill_new_tokens(m.prefill, q, k, v, False)
                assert out.shape == (tokens, heads, v_dim)
        prepare.assert_not_called()  # no re-preparation when switching micro-batches


def test_prepared_once_per_step_whatever_the_number_of_layers(shim, clean_selection, model_dirs):
    from vllm.config import set_current_vllm_config

    cfg = host.make_vllm_config(model_dirs["plain"])
    layers = [build_layer(cfg, None, f"model.layers.{i}.self_attn") for i in range(4)]
    builder = make_builder(cfg, layers, None)
    (runner,) = builder._mla_prefill_runners.values()
    with (
        mock.patch.object(type(runner), "prepare_metadata", autospec=True) as prepare,
        host.gpu_view(None),
        set_current_vllm_config(cfg),
    ):
        builder.build(0, host.prefill_batch([5, 3]))
    assert prepare.call_count == 1
    for layer in layers:  # the layers' own instances are templates: never prepared
        assert layer.prefill_backend._prefill_metadata is None


def test_step_metadata_carries_host_offsets(shim, clean_selection, model_dirs):
    from vllm.config import set_current_vllm_config

    cfg = host.make_vllm_config(model_dirs["plain"])
    layer = build_layer(cfg, None)
    builder = make_builder(cfg, [layer], None)
    with host.gpu_view(None), set_current_vllm_config(cfg):
        m = builder.build(0, host.prefill_batch([5, 11, 3]))
    host_loc = m.prefill.query_start_loc_cpu
    assert host_loc.device.type == "cpu" and host_loc.tolist() == [0, 5, 16, 19]


def test_flashinfer_workspace_is_reserved_when_the_builder_is_created(shim, clean_selection, model_dirs):
    clean_selection.setenv(settings.BACKEND_ENV, "FLASHINFER")
    clean_selection.setenv("VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE", str(1 << 20))
    cfg = host.make_vllm_config(model_dirs["plain"])
    layers = [build_layer(cfg, (9, 0), f"model.layers.{i}.self_attn") for i in range(2)]
    assert all(layer.prefill_backend._workspace is None for layer in layers)  # templates: no memory
    builders = [make_builder(cfg, layers, (9, 0)) for _ in range(2)]
    workspaces = [next(iter(b._mla_prefill_runners.values()))._workspace for b in builders]
    assert all(w is not None and w.numel() == 1 << 20 and w.dtype == torch.uint8 for w in workspaces)
    assert workspaces[0] is not workspaces[1]  # one per builder, as vLLM 0.20 allocates its own


# --- activate() is all or nothing ---------------------------------------------------------------


def test_failed_activation_can_be_retried(clean_selection, monkeypatch):
    from mla_prefill_ext import versions

    activation.deactivate()
    try:
        clean_selection.setenv(settings.BACKEND_ENV, "FLASH_ATTN")
        monkeypatch.setattr(versions, "installed_vllm_version", lambda: "0.21.0")
        for _ in range(2):  # the second call must not silently succeed
            with pytest.raises(RuntimeError, match="cannot honour MLA_PREFILL_BACKEND=FLASH_ATTN"):
                activation.activate()
            assert not activation.is_active()
    finally:
        monkeypatch.undo()
        activation.deactivate()
        activation.activate()
        assert activation.is_active()
