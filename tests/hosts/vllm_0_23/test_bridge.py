"""The bridge on the installed vLLM 0.23+: selection through vLLM's own selector and registry.

Runs against the real vLLM of the environment (0.25.1, 0.33.0 and 0.34.0 in the test matrix);
skipped on vLLM 0.20, where the patch serves. Only the device facts a test needs are
patched (``host.gpu_view``), and vLLM's own classes stay real.
"""

from __future__ import annotations

import importlib
import logging
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from mla_prefill_ext import versions
from mla_prefill_ext.testing import vllm_host as host

pytestmark = pytest.mark.vllm_bridge

ROOT = Path(__file__).resolve().parents[3]


def config(model_dir: Path | None = None, **kwargs: Any) -> Any:
    if model_dir is not None:
        return host.make_vllm_config(model_dir, **kwargs)
    from vllm.config import DeviceConfig, VllmConfig

    return VllmConfig(device_config=DeviceConfig(device="cpu"), **kwargs)


def native_config(model_dir: Path, name: str) -> Any:
    from vllm.config import AttentionConfig

    return config(model_dir, attention_config=AttentionConfig(mla_prefill_backend=name))


@pytest.mark.parametrize("capability", [None, (9, 0)])
def test_the_env_variable_alone_makes_vllms_selector_return_the_addon_backend(
    bridged, clean_selection, model_dirs, capability
):
    from mla_prefill_ext.backends.torch_sdpa import TorchSDPAPrefillBackend

    clean_selection.setenv("MLA_PREFILL_BACKEND", "torch_sdpa")  # any case, as on 0.20
    with host.gpu_view(capability):
        cls = bridged.selector.get_mla_prefill_backend(config(model_dirs["plain"]))
    assert issubclass(cls, bridged.base)  # vLLM's own MLAPrefillBackend
    assert cls._addon_class is TorchSDPAPrefillBackend
    assert cls.get_name() == "TORCH_SDPA"
    assert (
        f"{cls.__module__}.{cls.__qualname__}" == "mla_prefill_ext.hosts.vllm_0_23.adapter_classes.TORCH_SDPA"
    )
    assert pickle.loads(pickle.dumps(cls)) is cls


def test_the_layer_module_and_the_package_call_the_same_selection(bridged, clean_selection, model_dirs):
    """vLLM's MLA layer and the prefill package imported get_mla_prefill_backend by name."""
    import importlib

    clean_selection.setenv("MLA_PREFILL_BACKEND", "TORCH_SDPA")
    cfg = config(model_dirs["plain"])
    layer_module = importlib.import_module("vllm.model_executor.layers.attention.mla_attention")
    package = importlib.import_module("vllm.v1.attention.backends.mla.prefill")
    with host.gpu_view(None):
        picks = {m.get_mla_prefill_backend(cfg) for m in (bridged.selector, layer_module, package)}
    assert len(picks) == 1 and next(iter(picks)).get_name() == "TORCH_SDPA"


def stock_outcome(selector_module: Any, cfg: Any) -> tuple[str, Any]:
    try:
        return "class", selector_module.get_mla_prefill_backend(cfg)
    except Exception as e:
        return type(e).__name__, str(e)


@pytest.mark.parametrize("capability", [None, (9, 0), (10, 0)])
def test_a_native_choice_without_an_addon_choice_is_untouched(
    bridged, clean_selection, model_dirs, capability
):
    """attention_config.mla_prefill_backend=FLASH_ATTN gives what vLLM gives without the add-on."""
    import mla_prefill_ext

    cfg = native_config(model_dirs["plain"], "FLASH_ATTN")
    with host.gpu_view(capability):
        bridged_outcome = stock_outcome(bridged.selector, cfg)
        mla_prefill_ext.deactivate()
        try:
            assert not isinstance(
                bridged.selector.get_mla_prefill_backend, __import__("wrapt").FunctionWrapper
            )
            stock = stock_outcome(bridged.selector, cfg)
        finally:
            mla_prefill_ext.activate()
    assert bridged_outcome == stock
    if stock[0] == "class":
        assert stock[1].__module__.startswith("vllm.")  # vLLM's own FLASH_ATTN


@pytest.mark.parametrize("name", ["FLASH_ATTN", "FLASHINFER"])
def test_vllms_selector_serves_the_backend_attention_config_names(bridged, clean_selection, model_dirs, name):
    """What the bridge hands to vLLM untouched (shape.py does not inspect it): vLLM's selector serves the
    member attention_config.mla_prefill_backend names, or refuses it by name. Under a GPU's view: vLLM
    ignores the choice where it knows no device capability (0.23-0.31) and on a CPU platform (0.29+)."""
    with host.gpu_view((9, 0)):
        kind, outcome = stock_outcome(bridged.selector, native_config(model_dirs["plain"], name))
    if kind == "class":
        assert outcome.get_name() == name and outcome.__module__.startswith("vllm."), outcome
    else:  # its module does not import here, or it does not serve this device
        assert kind == "ValueError" and outcome.startswith(f"Selected MLA prefill backend {name} "), outcome


def test_an_invalid_overrides_variable_stops_a_native_choice_too(bridged, clean_selection, model_dirs):
    """vLLM's own attention_config choice does not run past a broken MLA_PREFILL_BACKEND_OVERRIDES."""
    from mla_prefill_ext import settings

    clean_selection.setenv(settings.OVERRIDES_ENV, "{CUSTOM: my_sdpa.MySDPABackend}")
    with host.gpu_view((9, 0)), pytest.raises(RuntimeError) as info:
        bridged.selector.get_mla_prefill_backend(native_config(model_dirs["plain"], "FLASH_ATTN"))
    assert str(info.value).startswith(
        f"{settings.OVERRIDES_ENV}='{{CUSTOM: my_sdpa.MySDPABackend}}' cannot be used"
    )
    assert settings.OVERRIDES_EXAMPLE in str(info.value)


def test_the_addon_choice_wins_over_a_different_native_one_in_one_info_line(
    bridged, clean_selection, model_dirs, info_log
):
    clean_selection.setenv("MLA_PREFILL_BACKEND", "TORCH_SDPA")
    cfg = native_config(model_dirs["plain"], "FLASH_ATTN")
    with host.gpu_view((9, 0)):
        for _ in range(3):  # every MLA layer asks
            assert bridged.selector.get_mla_prefill_backend(cfg).get_name() == "TORCH_SDPA"
    lines = [r.getMessage() for r in info_log if "takes precedence" in r.getMessage()]
    assert len(lines) == 1
    assert (
        "MLA_PREFILL_BACKEND=TORCH_SDPA takes precedence over attention_config.mla_prefill_backend=FLASH_ATTN"
        in (lines[0])
    )
    assert all(r.levelno == logging.INFO for r in info_log if "takes precedence" in r.getMessage())


def test_additional_config_selects_alone(bridged, clean_selection, model_dirs):
    cfg = config(model_dirs["plain"], additional_config={"mla_prefill_backend": "TORCH_SDPA"})
    with host.gpu_view(None):
        assert bridged.selector.get_mla_prefill_backend(cfg).get_name() == "TORCH_SDPA"


def test_an_explicit_choice_that_cannot_serve_is_one_clear_error(bridged, clean_selection, model_dirs):
    """FLASHINFER needs a GPU: the add-on's reasons, the vLLM version, nothing from vLLM's selector."""
    from mla_prefill_ext.hosts.core.refusal import ChoiceRefusedError

    clean_selection.setenv("MLA_PREFILL_BACKEND", "FLASHINFER")
    with host.gpu_view(None), pytest.raises(ChoiceRefusedError) as info:
        bridged.selector.get_mla_prefill_backend(config(model_dirs["plain"]))
    # Not a ValueError: vLLM 0.33's MLA layer catches that for sparse-MLA layers and runs on without
    # a dense prefill backend, dropping the choice (mla_attention.py, MLAAttention.__init__).
    assert not isinstance(info.value, ValueError) and isinstance(info.value.__cause__, ValueError)
    message = str(info.value)
    assert f"vLLM {versions.installed_vllm_version()}" in message
    assert "FLASHINFER (from MLA_PREFILL_BACKEND) cannot serve" in message and "needs a GPU" in message
    assert "unset MLA_PREFILL_BACKEND" in message
    tb = info.tb
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    assert not any(f.endswith("prefill/selector.py") for f in frames[1:])  # raised by the add-on


def test_an_unknown_name_lists_the_valid_ones(bridged, clean_selection, model_dirs):
    clean_selection.setenv("MLA_PREFILL_BACKEND", "NO_SUCH")
    with (
        host.gpu_view(None),
        pytest.raises(RuntimeError, match=r"Unknown MLA prefill backend: 'NO_SUCH'.*TORCH_SDPA"),
    ):
        bridged.selector.get_mla_prefill_backend(config(model_dirs["plain"]))


def test_custom_registered_by_call_is_vllms_custom_too(bridged, clean_selection, model_dirs):
    from mla_prefill_ext import MLAPrefillBackendEnum, register_mla_prefill_backend

    register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, "custom_backends.WrappedSDPABackend")
    custom = bridged.enum.CUSTOM
    with host.gpu_view((9, 0)):
        # vLLM's own knob reaches it (registered in vLLM's registry by the next selection)...
        cls = bridged.selector.get_mla_prefill_backend(native_config(model_dirs["plain"], "CUSTOM"))
        assert custom.get_path() == "mla_prefill_ext.hosts.vllm_0_23.adapter_classes.CUSTOM"
        assert cls._addon_class.__name__ == "WrappedSDPABackend"
        # ...and so does the add-on's.
        clean_selection.setenv("MLA_PREFILL_BACKEND", "custom")
        assert bridged.selector.get_mla_prefill_backend(config(model_dirs["plain"])) is cls
    MLAPrefillBackendEnum.CUSTOM.clear_override()
    from mla_prefill_ext.hosts.vllm_0_23 import vllm_registry_sync as registration

    registration.sync(bridged)
    assert not custom.is_overridden()  # unregistered with the add-on: vLLM's CUSTOM is free again


def test_registration_into_vllm_is_idempotent(bridged, clean_selection):
    from mla_prefill_ext import register_mla_prefill_backend
    from mla_prefill_ext.hosts.vllm_0_23 import vllm_registry_sync as registration

    register_mla_prefill_backend("BRIDGED_SDPA", "custom_backends.WrappedSDPABackend")
    for _ in range(3):
        registration.sync(bridged, force=True)
    members = bridged.enum.__members__
    if bridged.string_names:  # vLLM 0.33+: a member of vLLM's own enum
        assert (
            members["BRIDGED_SDPA"].get_path()
            == "mla_prefill_ext.hosts.vllm_0_23.adapter_classes.BRIDGED_SDPA"
        )
        assert (
            members["TORCH_SDPA"].get_path() == "mla_prefill_ext.hosts.vllm_0_23.adapter_classes.TORCH_SDPA"
        )
    else:  # before 0.33 vLLM registers no new names: reached through the add-on's choice
        assert "BRIDGED_SDPA" not in members and "TORCH_SDPA" not in members
    for native in ("FLASH_ATTN", "FLASHINFER", "TRTLLM_RAGGED"):
        assert members[native].get_path().startswith("vllm.")  # vLLM's own backends untouched


def test_a_name_vllm_cannot_reach_or_that_is_vllms_own_gets_one_warning(bridged, clean_selection, addon_log):
    from mla_prefill_ext import register_mla_prefill_backend
    from mla_prefill_ext.hosts.vllm_0_23 import vllm_registry_sync as registration

    native = next(
        n
        for n in registration.native_names(bridged)
        if n not in ("FLASH_ATTN", "FLASHINFER", "TRTLLM_RAGGED")
    )
    register_mla_prefill_backend(native, "custom_backends.WrappedSDPABackend")
    register_mla_prefill_backend("lower_sdpa", "custom_backends.WrappedSDPABackend")
    for _ in range(2):
        registration.sync(bridged, force=True)
    messages = [r.getMessage() for r in addon_log if r.levelno == logging.WARNING]
    collision = [
        m
        for m in messages
        if f"has the name of vLLM {versions.installed_vllm_version()}'s own backend {native}" in m
    ]
    assert len(collision) == 1 and f"MLA_PREFILL_BACKEND={native}" in collision[0]
    assert bridged.enum.__members__[native].get_path().startswith("vllm.")
    lower = [m for m in messages if "'lower_sdpa'" in m]
    if bridged.string_names:
        assert len(lower) == 1 and "LOWER_SDPA" in lower[0] and "upper-cases" in lower[0]
    assert "lower_sdpa" not in bridged.enum.__members__


def test_an_installed_backend_package_is_selectable_by_its_name(bridged, clean_selection, site, model_dirs):
    from entry_point_packages import fake_backend, install

    from mla_prefill_ext import registry

    install(
        site,
        "fakepkg-bridged",
        {"FAKE_BRIDGED": "fakepkg_bridged:FakeBridgedBackend"},
        {"fakepkg_bridged": fake_backend("FAKE_BRIDGED")},
    )
    registry.discover_installed(refresh=True)
    clean_selection.setenv("MLA_PREFILL_BACKEND", "FAKE_BRIDGED")
    with host.gpu_view(None):
        cls = bridged.selector.get_mla_prefill_backend(config(model_dirs["plain"]))
    assert cls.get_name() == "FAKE_BRIDGED" and cls._addon_class.__module__ == "fakepkg_bridged"
    if bridged.string_names:  # and through vLLM's own knob, by the same name
        clean_selection.delenv("MLA_PREFILL_BACKEND")
        with host.gpu_view(None):
            assert (
                bridged.selector.get_mla_prefill_backend(native_config(model_dirs["plain"], "FAKE_BRIDGED"))
                is cls
            )


# Automatic selection: vLLM's own, with claims and the portable fallback.


def test_automatic_selection_falls_back_to_torch_sdpa_where_vllm_finds_none(
    bridged, clean_selection, model_dirs, addon_log
):
    """On this CPU box vLLM's FLASH_ATTN is not importable: at capability 9.0 vLLM finds nothing."""
    with host.gpu_view((9, 0)):
        cls = bridged.selector.get_mla_prefill_backend(config(model_dirs["plain"]))
    assert cls.get_name() == "TORCH_SDPA" and issubclass(cls, bridged.base)
    assert any("portable TORCH_SDPA serves it" in r.getMessage() for r in addon_log)


def test_a_claim_goes_before_the_backend_it_names_when_vllm_would_pick_that_one(
    bridged, clean_selection, site, model_dirs
):
    from entry_point_packages import fake_backend, install

    from mla_prefill_ext import registry

    claim = 'AutoSelectClaim(("9.x",), before="FLASH_ATTN")'
    install(
        site,
        "fakepkg-claim",
        {"FAKE_CLAIM": "fakepkg_claim:FakeClaimBackend"},
        {"fakepkg_claim": fake_backend("FAKE_CLAIM", claim)},
    )
    registry.discover_installed(refresh=True)
    cfg = config(model_dirs["plain"])
    get = bridged.selector.get_mla_prefill_backend
    try:
        # vLLM finds nothing at 9.0 here (its FLASH_ATTN cannot load on a CPU box): the claim serves.
        with host.gpu_view((9, 0)):
            assert get(cfg).get_name() == "FAKE_CLAIM"
        # A valid FLASH_ATTN, registered through vLLM's own API: vLLM picks it, the claim goes first.
        bridged.registry.register_mla_prefill_backend(
            bridged.enum.FLASH_ATTN, "vllm_native_backend.NativeFlashAttnStandIn"
        )
        bridged.selector._auto_select_mla_prefill_backend.cache_clear()
        with host.gpu_view((9, 0)):
            assert get(cfg).get_name() == "FAKE_CLAIM"
        # A device the claim does not name: vLLM's own pick.
        with host.gpu_view((8, 0)):
            assert get(cfg).__name__ == "NativeFlashAttnStandIn"
    finally:
        bridged.enum.FLASH_ATTN.clear_override()


def test_a_claim_before_a_backend_vllm_does_not_pick_waits(bridged, clean_selection, site, model_dirs):
    """A claim before FLASHINFER at 9.0, where vLLM picks FLASH_ATTN: vLLM's pick stays."""
    from entry_point_packages import fake_backend, install

    from mla_prefill_ext import registry

    claim = 'AutoSelectClaim(("9.x",), before="FLASHINFER")'
    install(
        site,
        "fakepkg-late",
        {"FAKE_LATE": "fakepkg_late:FakeLateBackend"},
        {"fakepkg_late": fake_backend("FAKE_LATE", claim)},
    )
    registry.discover_installed(refresh=True)
    bridged.registry.register_mla_prefill_backend(
        bridged.enum.FLASH_ATTN, "vllm_native_backend.NativeFlashAttnStandIn"
    )
    try:
        with host.gpu_view((9, 0)):
            assert bridged.selector.get_mla_prefill_backend(config(model_dirs["plain"])).__name__ == (
                "NativeFlashAttnStandIn"
            )
    finally:
        bridged.enum.FLASH_ATTN.clear_override()


# vLLM's own MLA layer, metadata builder and forward_mha, on the CPU, through an add-on backend.


def run_two_steps(cfg: Any, layer: Any) -> dict[str, Any]:
    """Two prefill steps through vLLM's builder and forward_mha; the second over cached context.

    As test_layer.two_steps_with_context, for the bridged vLLM: requests A and B prefill 37
    and 20 tokens; then A and B continue (9 and 5 tokens over their cached ones) and C
    starts (7). The builder's context workspace is lowered to 32 tokens, so the context
    takes several chunks (0.29+: one of them a continuation of A's split context). Returns
    each step's error relative to a float64 reference over each whole sequence.
    """
    from mla_layer_on_cpu import CHUNK_WORKSPACE, SeededRequests, cpu_step_kernels, make_builder, recording
    from vllm.config import set_current_vllm_config

    mla_module = importlib.import_module("vllm.model_executor.layers.attention.mla_attention")
    builder = make_builder(cfg, [layer], None)
    builder.chunked_prefill_workspace_size = CHUNK_WORKSPACE
    impl = layer.impl
    steps = [([37, 20], [0, 0]), ([9, 5, 7], [37, 20, 0])]
    inputs = SeededRequests(layer, [c + n for c, n in zip(steps[1][1], steps[1][0], strict=True)])
    impl.dcp_world_size = 1  # what MLAAttention.forward_impl sets before calling forward_mha

    result: dict[str, Any] = {"errors": []}
    for new_lens, ctx_lens in steps:
        batch = inputs.batch(new_lens, ctx_lens)
        with cpu_step_kernels(mla_module), host.gpu_view(None), set_current_vllm_config(cfg):
            metadata = builder.build(0, batch)
        chunked = metadata.prefill.chunked_context
        if chunked is not None:
            result["chunks"] = list(getattr(chunked, "chunks", None) or range(len(chunked.seq_tot)))
        q, kv_c, k_pe, output, expected = inputs.step(new_lens, ctx_lens, batch.slot_mapping)
        backend = metadata.prefill.prefill_backend
        with (
            cpu_step_kernels(mla_module),
            recording(type(backend.inner), "run_prefill_context_chunk") as ran,
        ):
            impl.forward_mha(q, kv_c, k_pe, inputs.cache, metadata, torch.ones(()), output=output)
        result["backend"] = backend
        result["chunk_calls"] = len(ran)
        assert torch.isfinite(output).all()
        result["errors"].append(((output.double() - expected).abs().max() / expected.abs().max()).item())
    return result


def build_layer(cfg: Any) -> Any:
    with host.gpu_view(None):
        return host.mla_layer(host.build_deepseek_attention(cfg))


def test_an_addon_backend_runs_through_vllms_own_forward_mha(bridged, clean_selection, model_dirs):
    """TORCH_SDPA, chosen by the environment alone, inside vLLM's layer, builder and forward_mha."""
    from mla_layer_on_cpu import TOLERANCE

    from mla_prefill_ext.backends.torch_sdpa import TorchSDPAPrefillBackend

    clean_selection.setenv("MLA_PREFILL_BACKEND", "TORCH_SDPA")
    cfg = host.make_vllm_config(model_dirs["yarn"])
    layer = build_layer(cfg)
    assert isinstance(layer.prefill_backend, bridged.base)
    assert type(layer.prefill_backend.inner) is TorchSDPAPrefillBackend
    assert layer.prefill_backend.scale == layer.scale  # the layer's scale, YaRN mscale included
    result = run_two_steps(cfg, layer)
    print("bridged TORCH_SDPA, two steps with context:", result["errors"], len(result["chunks"]))
    backend = result["backend"]
    # The builder's own instance: a clone of the layer's (0.25+), not the layer's.
    if bridged.has_clone:
        assert backend is not layer.prefill_backend and type(backend) is type(layer.prefill_backend)
    assert len(result["chunks"]) >= 2 and result["chunk_calls"] == len(result["chunks"])
    if bridged.chunk_api == "object":
        assert any(c.is_continuation for c in result["chunks"])  # A's context split across chunks
    assert max(result["errors"]) <= TOLERANCE, result["errors"]


@pytest.mark.parametrize("mutant", ["SdpaScaleOffBackend", "SdpaBase2LseBackend"])
def test_forward_mha_through_the_bridge_catches_a_wrong_backend(bridged, clean_selection, model_dirs, mutant):
    """The check above fails a backend with the scale 2% off or the LSE in base 2 (as CUSTOM)."""
    from mla_layer_on_cpu import TOLERANCE

    from mla_prefill_ext import MLAPrefillBackendEnum, register_mla_prefill_backend

    clean_selection.syspath_prepend(str(ROOT / "scripts" / "gpu_harness" / "doubles"))
    register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, f"mutant_backends.{mutant}")
    clean_selection.setenv("MLA_PREFILL_BACKEND", "CUSTOM")
    cfg = host.make_vllm_config(model_dirs["yarn"])
    layer = build_layer(cfg)
    assert type(layer.prefill_backend.inner).__name__ == mutant
    result = run_two_steps(cfg, layer)
    print(f"bridged {mutant}:", result["errors"])
    assert result["errors"][1] > TOLERANCE, result["errors"]


# Every vLLM process: the plugin hook registers there; a name vLLM's enum got unpickles by name.


def run_child(code: str, **env: str) -> str:
    """A fresh interpreter (as vLLM's spawned engine core), this checkout first on its path."""
    full = {**os.environ, **env, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "helpers")])}
    for name in ("MLA_PREFILL_BACKEND", "MLA_PREFILL_BACKEND_OVERRIDES", "MLA_PREFILL_EXT_DISABLE"):
        if name not in env:
            full.pop(name, None)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code).strip()],
        capture_output=True,
        text=True,
        env=full,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def test_a_registration_in_the_driver_reaches_a_fresh_process_through_the_plugin_hook(
    bridged, clean_selection
):
    """CUSTOM registered in this process only; the child runs vLLM's plugin loader, then vLLM's selector."""
    from mla_prefill_ext import MLAPrefillBackendEnum, register_mla_prefill_backend
    from mla_prefill_ext.registry import OVERRIDES_ENV

    register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, "custom_backends.WrappedSDPABackend")
    out = run_child(
        """
        import vllm.plugins
        vllm.plugins.load_general_plugins()  # what vLLM does in every process it starts
        from vllm.config import AttentionConfig, DeviceConfig, VllmConfig
        from vllm.v1.attention.backends.mla.prefill import selector
        cfg = VllmConfig(device_config=DeviceConfig(device="cpu"),
                         attention_config=AttentionConfig(mla_prefill_backend="CUSTOM"))
        cls = selector.get_mla_prefill_backend(cfg)
        print("CHILD", cls.__module__, cls.__qualname__, cls._addon_class.__name__)
        """,
        **{OVERRIDES_ENV: os.environ[OVERRIDES_ENV]},
    )
    assert "CHILD mla_prefill_ext.hosts.vllm_0_23.adapter_classes CUSTOM WrappedSDPABackend" in out


def test_the_env_variable_alone_selects_in_a_fresh_process(bridged):
    out = run_child(
        """
        import vllm.plugins
        vllm.plugins.load_general_plugins()
        from vllm.config import DeviceConfig, VllmConfig
        from vllm.v1.attention.backends.mla.prefill import selector
        cls = selector.get_mla_prefill_backend(VllmConfig(device_config=DeviceConfig(device="cpu")))
        print("CHILD", cls.get_name(), cls.__mro__[2].__module__)
        """,
        MLA_PREFILL_BACKEND="TORCH_SDPA",
    )
    assert f"CHILD TORCH_SDPA {bridged.base.__module__}" in out


def test_a_config_naming_an_addon_backend_unpickles_in_a_fresh_process(bridged, clean_selection, tmp_path):
    """vLLM 0.33+: a spawned engine core unpickles its configuration before plugins load there."""
    if not bridged.string_names:
        pytest.skip(f"vLLM {versions.installed_vllm_version()} takes no new names in its registry")
    from vllm.config import AttentionConfig

    from mla_prefill_ext.hosts.vllm_0_23 import vllm_registry_sync as registration

    registration.sync(bridged, force=True)
    attention = AttentionConfig(mla_prefill_backend="TORCH_SDPA")
    assert attention.mla_prefill_backend is bridged.enum.TORCH_SDPA
    blob = tmp_path / "attention.pickle"
    blob.write_bytes(pickle.dumps(attention))
    out = run_child(
        f"""
        import pickle, sys
        attention = pickle.loads(open({str(blob)!r}, "rb").read())
        member = attention.mla_prefill_backend
        loaded = "mla_prefill_ext.hosts.vllm_0_23.bridge" in sys.modules
        print("CHILD", member.name, member.get_path(), loaded)
        """
    )
    assert "CHILD TORCH_SDPA mla_prefill_ext.hosts.vllm_0_23.adapter_classes.TORCH_SDPA False" in out


# The conformance suite through the installed vLLM's calling convention.


def test_conformance_runs_through_the_installed_vllms_calling_convention(bridged, clean_selection):
    from mla_prefill_ext.testing import run_conformance
    from mla_prefill_ext.testing.conventions.bridged import BridgedConvention, installed_vllm_convention

    convention = installed_vllm_convention()
    assert isinstance(convention, BridgedConvention) and convention.shape.chunk_api == bridged.chunk_api
    report = run_conformance("TORCH_SDPA", dtype="bfloat16")
    assert report.ok, report.format()
    # The same suite through the same convention catches a base-2 LSE and attention across sequences.
    clean_selection.syspath_prepend(str(ROOT / "tests" / "helpers"))
    for mutant, prop in (("Base2LSE", "lse.natural_log"), ("CrossSequence", "varlen.isolation")):
        report = run_conformance(f"conformance_mutants.{mutant}", dtype="bfloat16")
        assert prop in report.failed_properties, report.format()


# A vLLM whose MLA prefill API the bridge does not know: nothing bridged, an explicit choice refused.


def test_an_api_shape_the_bridge_does_not_know_is_refused_in_one_message(
    bridged, clean_selection, model_dirs
):
    import mla_prefill_ext
    from mla_prefill_ext.hosts import vllm_0_23 as bridge
    from mla_prefill_ext.hosts.vllm_0_23 import shape as shape_module

    mla_prefill_ext.deactivate()
    found = shape_module._FOUND
    shape_module._FOUND = (
        None,
        ["vllm...base.MLAPrefillBackend.run_prefill_context_chunk takes ['self', 'x']"],
    )
    try:
        clean_selection.setenv("MLA_PREFILL_BACKEND", "TORCH_SDPA")
        with pytest.raises(RuntimeError) as info:
            mla_prefill_ext.activate()  # the environment's choice fails at start
        message = str(info.value)
        version = versions.installed_vllm_version()
        assert (
            f"cannot honour MLA_PREFILL_BACKEND=TORCH_SDPA: vLLM {version}: vLLM's MLA prefill API" in message
        )
        assert "run_prefill_context_chunk takes ['self', 'x']" in message
        clean_selection.delenv("MLA_PREFILL_BACKEND")
        mla_prefill_ext.activate()
        assert not bridge.is_instrumented() and bridge.state().problem is not None
        cfg = config(model_dirs["plain"], additional_config={"mla_prefill_backend": "TORCH_SDPA"})
        with host.gpu_view(None), pytest.raises(RuntimeError, match="cannot honour additional_config"):
            bridged.selector.get_mla_prefill_backend(cfg)  # the engine's choice fails at its first layer
        with host.gpu_view(None):  # no add-on choice: vLLM selects as without the add-on
            assert stock_outcome(bridged.selector, config(model_dirs["plain"]))[0] in ("class", "ImportError")
    finally:
        mla_prefill_ext.deactivate()
        shape_module._FOUND = found
        mla_prefill_ext.activate()
    assert bridge.is_instrumented()


def test_a_registration_that_fails_leaves_only_the_guard(bridged, clean_selection, model_dirs, monkeypatch):
    """The bridge's registration lands with its wrappers or not at all (the core's instrumentor)."""
    import wrapt

    import mla_prefill_ext
    from mla_prefill_ext.hosts import vllm_0_23 as bridge
    from mla_prefill_ext.hosts.vllm_0_23 import vllm_registry_sync

    selector = bridged.selector
    mla_prefill_ext.deactivate()

    def refuse(shape: Any, force: bool = False) -> None:
        raise ValueError("the registry is closed")

    monkeypatch.setattr(vllm_registry_sync, "sync", refuse)
    try:
        mla_prefill_ext.activate()
        assert not bridge.is_instrumented()
        assert bridge.state().problem.endswith("bridging failed (ValueError: the registry is closed)")
        # vLLM's automatic selection is unwrapped again; get_mla_prefill_backend carries only the guard.
        assert not isinstance(selector._auto_select_mla_prefill_backend, wrapt.FunctionWrapper)
        assert [path for path, _ in bridge.state().handles].count("get_mla_prefill_backend") >= 1
        cfg = config(model_dirs["plain"], additional_config={"mla_prefill_backend": "TORCH_SDPA"})
        with host.gpu_view(None), pytest.raises(RuntimeError, match="cannot honour additional_config"):
            selector.get_mla_prefill_backend(cfg)
    finally:
        mla_prefill_ext.deactivate()
        monkeypatch.undo()
        mla_prefill_ext.activate()
    assert bridge.is_instrumented()


def test_the_inspection_names_what_changed():
    from mla_prefill_ext.hosts.vllm_0_23 import shape

    class ChunkBySomethingElse:
        def run_prefill_context_chunk(self, piece, q, k, v):  # type: ignore[no-untyped-def]
            ...

    problems: list[str] = []
    assert shape._chunk_api(ChunkBySomethingElse, problems) == ""
    assert "takes ['self', 'piece', 'q', 'k', 'v']" in problems[0] and "chunk_idx" in problems[0]
    found, problems = shape.inspect_vllm()
    assert found is not None and problems == []
