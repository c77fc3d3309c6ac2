"""A class path that does not load: the error says where the path came from and to fix it there."""

from __future__ import annotations

import json

import pytest
import torch
from entry_point_packages import install

from mla_prefill_ext import registry, selector, settings
from mla_prefill_ext.registry import MLAPrefillBackendEnum, register_mla_prefill_backend
from mla_prefill_ext.selector import MLAPrefillSelectorConfig

R1_BF16 = MLAPrefillSelectorConfig(torch.bfloat16, True)
TYPO = "mla_prefill_ext.backends.torch_sdpa.TorchSDPAPrefillBakend"
NOT_A_BACKEND = "mla_prefill_ext.settings.Choice"
CHOICE = selector.Choice("CUSTOM", settings.BACKEND_ENV, True)
pytestmark = pytest.mark.usefixtures("clean_selection")


def selection_error(choice: selector.Choice = CHOICE) -> str:
    with pytest.raises(ValueError) as info:
        selector.select(None, R1_BF16, choice)
    return str(info.value)


@pytest.mark.parametrize("path", [TYPO, NOT_A_BACKEND, "nowhere_pkg.NoBackend"])
def test_a_path_from_the_overrides_variable_says_to_correct_it_there(clean_selection, path):
    clean_selection.setenv(settings.OVERRIDES_ENV, json.dumps({"CUSTOM": path}))
    registry._apply_environment()
    message = selection_error()
    assert f"The class path comes from {settings.OVERRIDES_ENV}: correct its entry 'CUSTOM' there" in message
    assert message.endswith("Or choose another backend or unset MLA_PREFILL_BACKEND.")


def test_a_path_registered_by_call_says_to_correct_the_call():
    register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, TYPO)
    message = selection_error()
    assert "has no attribute 'TorchSDPAPrefillBakend'" in message
    assert "registered by call: correct the one given to register_mla_prefill_backend for CUSTOM" in message
    assert settings.OVERRIDES_ENV not in message


def test_a_path_from_an_entry_point_names_the_package(site):
    install(site, "fakepkg-typo", {"FAKE_TYPO": "mla_prefill_ext.backends.torch_sdpa:TorchSDPAPrefillBakend"})
    registry.discover_installed(refresh=True)
    message = selection_error(selector.Choice("FAKE_TYPO", settings.BACKEND_ENV, True))
    assert "the entry point 'FAKE_TYPO' of the installed package fakepkg-typo" in message
    assert "reinstall it, or uninstall fakepkg-typo" in message


def test_a_builtin_that_does_not_load_keeps_its_advice(clean_selection):
    # The unregistered placeholder: how to register it, then the usual advice.
    message = selection_error()
    assert "must be registered before use" in message
    assert message.endswith("Choose another backend or unset MLA_PREFILL_BACKEND.")
