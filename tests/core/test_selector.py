"""Backend selection: precedence, automatic priorities per device, errors, cache."""

from __future__ import annotations

import contextlib
import logging
import uuid
from pathlib import Path
from typing import Any
from unittest import mock

import custom_backends
import pytest
import torch
import vllm.platforms
from logs import warnings_in
from platform_views import device
from vllm.platforms.interface import DeviceCapability
from vllm_configs import config

from mla_prefill_ext import selector
from mla_prefill_ext.backends.flash_attn import FlashAttnPrefillBackend
from mla_prefill_ext.backends.flashinfer import FlashInferPrefillBackend
from mla_prefill_ext.backends.torch_sdpa import TorchSDPAPrefillBackend
from mla_prefill_ext.backends.trtllm_ragged import TrtllmRaggedPrefillBackend
from mla_prefill_ext.hosts.vllm_0_20 import legacy_flags
from mla_prefill_ext.registry import MLAPrefillBackendEnum, register_mla_prefill_backend
from mla_prefill_ext.selector import MLAPrefillSelectorConfig

E = MLAPrefillBackendEnum
ADDITIONAL = "additional_config['mla_prefill_backend']"
LEGACY_TRTLLM = legacy_flags.TRTLLM_SOURCE
LEGACY_FLASHINFER = legacy_flags.FLASHINFER_SOURCE
R1_BF16 = MLAPrefillSelectorConfig(torch.bfloat16, True)
pytestmark = pytest.mark.usefixtures("clean_selection")
Records = list[logging.LogRecord]


# Automatic priorities


@pytest.mark.parametrize(
    ("capability", "expected"),
    [
        (None, [E.TORCH_SDPA]),
        ((8, 0), [E.FLASH_ATTN, E.TORCH_SDPA]),
        ((9, 0), [E.FLASH_ATTN, E.FLASHINFER, E.TORCH_SDPA]),
        ((10, 0), [E.FLASH_ATTN, E.TRTLLM_RAGGED, E.FLASHINFER, E.TORCH_SDPA]),
    ],
)
def test_priorities(capability: tuple[int, int] | None, expected: list[MLAPrefillBackendEnum]) -> None:
    cap = None if capability is None else DeviceCapability(*capability)
    assert selector.mla_prefill_backend_priorities(cap) == expected


@pytest.mark.parametrize(
    ("capability", "expected"),
    [
        (None, TorchSDPAPrefillBackend),
        ((8, 0), FlashAttnPrefillBackend),
        ((9, 0), FlashAttnPrefillBackend),
        ((10, 0), FlashAttnPrefillBackend),
    ],
)
@pytest.mark.usefixtures("flash_attn_kernels")
def test_automatic_selection_per_device(r1: Path, capability: tuple[int, int] | None, expected: type) -> None:
    cfg = config(r1)
    with device(capability):
        selection = selector.selection_for(cfg)
    assert selection.backend is expected
    assert selection.source == "automatic"
    assert selection.rejected == {}
    assert selection.config == R1_BF16


def test_current_device_capability_is_the_platforms() -> None:
    with device((9, 0)):
        assert selector.current_device_capability() == DeviceCapability(9, 0)
    with device(None):
        assert selector.current_device_capability() is None


def test_platform_without_device_facts_counts_as_no_gpu() -> None:
    def no_facts(cls: Any, device_id: int = 0) -> None:
        raise NotImplementedError

    with mock.patch.object(
        type(vllm.platforms.current_platform), "get_device_capability", classmethod(no_facts)
    ):
        assert selector.current_device_capability() is None


@pytest.mark.parametrize(
    ("capability", "unavailable", "model", "expected"),
    [
        ((9, 0), [FlashAttnPrefillBackend], "plain", "FLASHINFER"),
        ((9, 0), [FlashAttnPrefillBackend], "non_r1", "TORCH_SDPA"),
        ((10, 0), [FlashAttnPrefillBackend], "plain", "TRTLLM_RAGGED"),
        ((10, 0), [FlashAttnPrefillBackend, TrtllmRaggedPrefillBackend], "plain", "FLASHINFER"),
        ((10, 0), [FlashAttnPrefillBackend], "non_r1", "TORCH_SDPA"),
        ((8, 0), [FlashAttnPrefillBackend], "plain", "TORCH_SDPA"),
    ],
)
def test_automatic_walks_the_priorities_in_order(
    model_dirs: dict[str, Path],
    capability: tuple[int, int],
    unavailable: list[type],
    model: str,
    expected: str,
) -> None:
    cfg = config(model_dirs[model])
    with contextlib.ExitStack() as stack:
        for cls in unavailable:
            stack.enter_context(mock.patch.object(cls, "is_available", classmethod(lambda cls: False)))
        stack.enter_context(device(capability))
        selection = selector.selection_for(cfg)
    assert selection.name == expected
    priorities = [m.name for m in selector.mla_prefill_backend_priorities(DeviceCapability(*capability))]
    assert list(selection.rejected) == priorities[: priorities.index(expected)]


# Precedence


@pytest.mark.parametrize(
    ("additional", "env", "attention", "expected", "source"),
    [
        ("FLASHINFER", "TORCH_SDPA", {"use_trtllm_ragged_deepseek_prefill": True}, "FLASHINFER", ADDITIONAL),
        (
            None,
            "TORCH_SDPA",
            {"use_trtllm_ragged_deepseek_prefill": True},
            "TORCH_SDPA",
            "MLA_PREFILL_BACKEND",
        ),
        (None, None, {"use_trtllm_ragged_deepseek_prefill": True}, "TRTLLM_RAGGED", LEGACY_TRTLLM),
        (
            None,
            None,
            {"use_trtllm_ragged_deepseek_prefill": True, "disable_flashinfer_prefill": False},
            "TRTLLM_RAGGED",
            LEGACY_TRTLLM,
        ),
        (None, None, {"disable_flashinfer_prefill": False}, "FLASHINFER", LEGACY_FLASHINFER),
        (None, None, {}, "FLASH_ATTN", "automatic"),
        # "auto" is a choice too: it stops the lower levels from applying.
        ("auto", "TORCH_SDPA", {}, "FLASH_ATTN", "automatic"),
        (None, "AUTO", {"use_trtllm_ragged_deepseek_prefill": True}, "FLASH_ATTN", "automatic"),
    ],
)
@pytest.mark.vllm_patch  # vLLM 0.20's legacy attention_config flags
def test_precedence(
    r1: Path,
    clean_selection: pytest.MonkeyPatch,
    additional: str | None,
    env: str | None,
    attention: dict[str, bool],
    expected: str,
    source: str,
) -> None:
    if env is not None:
        clean_selection.setenv(selector.BACKEND_ENV, env)
    cfg = config(r1, additional, **attention)
    with device((10, 0)):  # every built-in can serve R1 bf16 here
        # As the patched layer selects: the legacy flags are the 0.20 host's to read.
        selection = legacy_flags.selection_for(cfg)
        assert legacy_flags.backend_for(cfg) is E[expected].get_class()
    assert (selection.name, selection.source) == (expected, source)
    assert selection.rejected == {}


@pytest.mark.parametrize("value", ["torch_sdpa", "Torch_Sdpa", "  TORCH_SDPA  "])
def test_env_value_in_any_case(r1: Path, clean_selection: pytest.MonkeyPatch, value: str) -> None:
    clean_selection.setenv(selector.BACKEND_ENV, value)
    with device((9, 0)):
        assert selector.get_mla_prefill_backend(config(r1)) is TorchSDPAPrefillBackend


def test_additional_config_value_in_any_case(r1: Path) -> None:
    with device((9, 0)):
        selection = selector.selection_for(config(r1, "flashinfer"))
    assert (selection.name, selection.source) == ("FLASHINFER", ADDITIONAL)


def test_describe_requested(r1: Path, clean_selection: pytest.MonkeyPatch) -> None:
    assert selector.describe_requested(config(r1)) == {
        "requested": "AUTO",
        "source": "automatic",
        "MLA_PREFILL_BACKEND": None,
    }
    clean_selection.setenv(selector.BACKEND_ENV, "flash_attn")
    described = selector.describe_requested(config(r1))
    assert described["requested"] == "FLASH_ATTN"
    assert described["source"] == "MLA_PREFILL_BACKEND"


# Explicit choices fail loudly


def test_explicit_env_choice_that_cannot_serve_raises(r1: Path, clean_selection: pytest.MonkeyPatch) -> None:
    clean_selection.setenv(selector.BACKEND_ENV, "TRTLLM_RAGGED")
    with device((9, 0)), pytest.raises(ValueError) as info:
        selector.get_mla_prefill_backend(config(r1))
    message = str(info.value)
    assert "TRTLLM_RAGGED" in message
    assert "MLA_PREFILL_BACKEND" in message
    assert "compute capability 9.0 not supported" in message


def test_explicit_additional_config_choice_that_cannot_serve_raises(non_r1: Path) -> None:
    with device((9, 0)), pytest.raises(ValueError) as info:
        selector.get_mla_prefill_backend(config(non_r1, "FLASHINFER"))
    message = str(info.value)
    assert "FLASHINFER" in message
    assert ADDITIONAL in message
    assert "DeepSeek-R1 MLA dimensions" in message


def test_explicit_choice_lists_every_reason(non_r1: Path, clean_selection: pytest.MonkeyPatch) -> None:
    clean_selection.setenv(selector.BACKEND_ENV, "TRTLLM_RAGGED")
    with device((8, 0)), pytest.raises(ValueError) as info:
        selector.get_mla_prefill_backend(config(non_r1))
    message = str(info.value)
    assert "compute capability 8.0 not supported" in message
    assert "DeepSeek-R1 MLA dimensions" in message


def test_explicit_unknown_name_lists_valid_names(r1: Path, clean_selection: pytest.MonkeyPatch) -> None:
    clean_selection.setenv(selector.BACKEND_ENV, "NOPE")
    with pytest.raises(ValueError) as info:
        selector.get_mla_prefill_backend(config(r1))
    message = str(info.value)
    assert "NOPE" in message
    for name in ("FLASH_ATTN", "FLASHINFER", "TRTLLM_RAGGED", "TORCH_SDPA", "CUSTOM"):
        assert name in message


def test_explicit_unregistered_custom_says_how_to_register(r1: Path) -> None:
    with pytest.raises(ValueError, match="register_mla_prefill_backend") as info:
        selector.get_mla_prefill_backend(config(r1, "CUSTOM"))
    assert str(info.value).startswith(
        "MLA prefill backend CUSTOM (from additional_config['mla_prefill_backend']) cannot be loaded: "
        "must be registered before use: call register_mla_prefill_backend("
    )


def test_explicit_choice_whose_class_does_not_import_says_so() -> None:
    """A class path that does not import is not a device problem: no "cannot serve (no GPU, ...)"."""
    register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, "nowhere_pkg.NoBackend")
    choice = selector.Choice("CUSTOM", "MLA_PREFILL_BACKEND", True)
    with pytest.raises(ValueError) as info:
        selector.select(None, R1_BF16, choice)
    assert str(info.value) == (
        "MLA prefill backend CUSTOM (from MLA_PREFILL_BACKEND) cannot be loaded: cannot import "
        "'nowhere_pkg.NoBackend': No module named 'nowhere_pkg'. The class path was registered by call: "
        "correct the one given to register_mla_prefill_backend for CUSTOM. Or choose another backend or "
        "unset MLA_PREFILL_BACKEND."
    )


def test_automatic_with_nothing_valid_lists_every_backend() -> None:
    with pytest.raises(ValueError) as info:
        selector.select(DeviceCapability(10, 0), MLAPrefillSelectorConfig(torch.float64, True))
    message = str(info.value)
    assert message.startswith("No MLA prefill backend can serve")
    assert "dtype float64" in message
    for name in ("FLASH_ATTN", "TRTLLM_RAGGED", "FLASHINFER", "TORCH_SDPA"):
        assert f"{name}: dtype float64 not supported" in message


def test_automatic_with_nothing_valid_on_cpu() -> None:
    with pytest.raises(ValueError, match=r"no GPU.*TORCH_SDPA: dtype float64 not supported"):
        selector.select(None, MLAPrefillSelectorConfig(torch.float64, True))


# Cache


@pytest.mark.usefixtures("flash_attn_kernels")
def test_selection_is_cached(r1: Path) -> None:
    cfg = config(r1)
    with device((9, 0)), mock.patch.object(selector, "select", wraps=selector.select) as spy:
        first = selector.get_mla_prefill_backend(cfg)
        second = selector.get_mla_prefill_backend(cfg)
        assert first is second is FlashAttnPrefillBackend
        assert spy.call_count == 1
        selector.clear_cache()
        assert selector.get_mla_prefill_backend(cfg) is FlashAttnPrefillBackend
        assert spy.call_count == 2


@pytest.mark.usefixtures("flash_attn_kernels")
def test_cache_is_keyed_by_device(r1: Path) -> None:
    cfg = config(r1)
    with device((9, 0)):
        assert selector.get_mla_prefill_backend(cfg) is FlashAttnPrefillBackend
    with device(None):
        assert selector.get_mla_prefill_backend(cfg) is TorchSDPAPrefillBackend


def test_registration_clears_the_cache(r1: Path) -> None:
    cfg = config(r1)
    with device(None):
        assert selector.get_mla_prefill_backend(cfg) is TorchSDPAPrefillBackend
        register_mla_prefill_backend(E.TORCH_SDPA)(custom_backends.WrappedSDPABackend)
        assert selector.get_mla_prefill_backend(cfg) is custom_backends.WrappedSDPABackend


def test_clearing_an_override_clears_the_cache(r1: Path) -> None:
    # The inverse of a registration: a selection cached while the override was in
    # force must not outlive its removal either.
    cfg = config(r1)
    register_mla_prefill_backend(E.TORCH_SDPA)(custom_backends.WrappedSDPABackend)
    with device(None):
        assert selector.get_mla_prefill_backend(cfg) is custom_backends.WrappedSDPABackend
        E.TORCH_SDPA.clear_override()
        assert selector.get_mla_prefill_backend(cfg) is TorchSDPAPrefillBackend


# Registered backends are selectable


def test_registered_custom_backend_is_selectable(r1: Path) -> None:
    register_mla_prefill_backend(E.CUSTOM)(custom_backends.WrappedSDPABackend)
    with device((9, 0)):
        selection = selector.selection_for(config(r1, "custom"))
    assert selection.backend is custom_backends.WrappedSDPABackend
    assert (selection.name, selection.source) == ("CUSTOM", ADDITIONAL)


def test_new_upper_case_name_is_selectable_from_env(r1: Path, clean_selection: pytest.MonkeyPatch) -> None:
    name = f"MY_PREFILL_{uuid.uuid4().hex[:8].upper()}"
    register_mla_prefill_backend(name, "custom_backends.WrappedSDPABackend")
    clean_selection.setenv(selector.BACKEND_ENV, name.lower())
    with device((9, 0)):
        assert selector.get_mla_prefill_backend(config(r1)) is custom_backends.WrappedSDPABackend


def test_new_lower_case_name_is_selectable_by_its_own_spelling(
    r1: Path, clean_selection: pytest.MonkeyPatch
) -> None:
    # The registry accepts any identifier, so a name registered as spelled must select.
    name = f"my_prefill_{uuid.uuid4().hex[:8]}"
    register_mla_prefill_backend(name, "custom_backends.WrappedSDPABackend")
    clean_selection.setenv(selector.BACKEND_ENV, name)
    with device((9, 0)):
        assert selector.get_mla_prefill_backend(config(r1)) is custom_backends.WrappedSDPABackend


# The slow path on a GPU is announced


def test_torch_sdpa_chosen_automatically_on_a_gpu_warns(r1: Path, addon_log: Records) -> None:
    unavailable = classmethod(lambda cls: False)
    with (
        device((9, 0)),
        mock.patch.object(FlashAttnPrefillBackend, "is_available", unavailable),
        mock.patch.object(FlashInferPrefillBackend, "is_available", unavailable),
    ):
        assert selector.get_mla_prefill_backend(config(r1)) is TorchSDPAPrefillBackend
    (warning,) = warnings_in(addon_log)
    assert "TORCH_SDPA was chosen automatically on a GPU" in warning
    assert f"FLASH_ATTN: {FlashAttnPrefillBackend.unavailable_reason()}" in warning
    assert f"FLASHINFER: {FlashInferPrefillBackend.unavailable_reason()}" in warning


def test_torch_sdpa_by_failed_override_on_a_gpu_warns(r1: Path, addon_log: Records) -> None:
    # Overrides whose classes cannot load make the faster built-ins invalid, too.
    register_mla_prefill_backend(E.FLASH_ATTN, "custom_backends.NotABackend")
    register_mla_prefill_backend(E.FLASHINFER, "custom_backends.NoSuchBackend")
    with device((9, 0)):
        selection = selector.selection_for(config(r1))
    assert selection.name == "TORCH_SDPA"
    (warning,) = warnings_in(addon_log)
    assert "custom_backends.NotABackend" in warning
    assert "custom_backends.NoSuchBackend" in warning


def test_torch_sdpa_on_cpu_does_not_warn(r1: Path, addon_log: Records) -> None:
    with device(None):
        assert selector.get_mla_prefill_backend(config(r1)) is TorchSDPAPrefillBackend
    assert warnings_in(addon_log) == []


def test_torch_sdpa_chosen_explicitly_on_a_gpu_does_not_warn(
    r1: Path, clean_selection: pytest.MonkeyPatch, addon_log: Records
) -> None:
    clean_selection.setenv(selector.BACKEND_ENV, "TORCH_SDPA")
    with device((9, 0)):
        assert selector.get_mla_prefill_backend(config(r1)) is TorchSDPAPrefillBackend
    assert warnings_in(addon_log) == []


# The selector's model facts


def test_selector_config_is_hashable() -> None:
    a = MLAPrefillSelectorConfig(torch.bfloat16, True)
    b = MLAPrefillSelectorConfig.from_dims(torch.bfloat16, 128, 64, 128)
    assert a == b
    assert hash(a) == hash(b)
    assert {a: 1}[b] == 1
    assert a != MLAPrefillSelectorConfig(torch.float16, True)


@pytest.mark.parametrize(
    ("dims", "is_r1"),
    [((128, 64, 128), True), ((64, 32, 64), False), ((128, 64, 64), False), ((192, 64, 128), False)],
)
def test_from_dims_detects_r1(dims: tuple[int, int, int], is_r1: bool) -> None:
    assert MLAPrefillSelectorConfig.from_dims(torch.float16, *dims).is_r1_compatible is is_r1


def test_selector_config_from_a_real_vllm_config(r1: Path, non_r1: Path) -> None:
    assert selector.selector_config_for(config(r1)) == MLAPrefillSelectorConfig(torch.bfloat16, True)
    assert selector.selector_config_for(config(non_r1)) == MLAPrefillSelectorConfig(torch.bfloat16, False)
    assert selector.is_deepseek_r1_mla_compatible(config(r1))
    assert not selector.is_deepseek_r1_mla_compatible(config(non_r1))


@pytest.mark.usefixtures("flash_attn_kernels")
def test_a_registration_invalidates_cached_selections(r1: Path) -> None:
    """The cache is keyed on the registry's generation: no selection outlives a registration."""
    from mla_prefill_ext import register_mla_prefill_backend

    cfg = config(r1)
    with device((9, 0)):
        assert selector.get_mla_prefill_backend(cfg) is FlashAttnPrefillBackend
        register_mla_prefill_backend(
            MLAPrefillBackendEnum.FLASH_ATTN, "mla_prefill_ext.backends.torch_sdpa.TorchSDPAPrefillBackend"
        )
        assert selector.get_mla_prefill_backend(cfg).get_name() == "TORCH_SDPA"
        MLAPrefillBackendEnum.FLASH_ATTN.clear_override()
        assert selector.get_mla_prefill_backend(cfg) is FlashAttnPrefillBackend
