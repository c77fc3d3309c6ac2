"""The add-on's names in vLLM's own registry (bridge/registration.py), on the installed vLLM 0.23+.

vLLM's real enum and registry; the add-on's registrations made through its public API.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Iterator
from typing import Any

import pytest

from mla_prefill_ext._logging import forget_logged
from mla_prefill_ext.hosts.vllm_0_23 import vllm_registry_sync as registration

pytestmark = pytest.mark.vllm_bridge

FOREIGN = "custom_backends.WrappedSDPABackend"  # a class registered through vLLM's own API


@pytest.fixture
def synced(bridged: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The bridge's shape; afterwards vLLM's CUSTOM is free again and the registries agree."""
    forget_logged()  # each test sees its own warnings
    yield bridged
    from mla_prefill_ext.registry import MLAPrefillBackendEnum

    MLAPrefillBackendEnum.CUSTOM.clear_override()
    registration.sync(bridged, force=True)
    if bridged.enum.CUSTOM.is_overridden():
        bridged.enum.CUSTOM.clear_override()


def test_the_class_path_vllm_holds_is_the_adapters():
    assert (
        registration.adapter_path("TORCH_SDPA")
        == "mla_prefill_ext.hosts.vllm_0_23.adapter_classes.TORCH_SDPA"
    )


def test_vllms_own_names_are_its_members_without_custom(synced):
    native = registration.native_names(synced)
    assert "CUSTOM" not in native and native
    assert set(native) <= set(synced.enum.__members__)
    assert not any(registration.is_ours(synced.enum.__members__[name]) for name in native)
    assert not registration.is_ours(synced.enum.CUSTOM)  # not registered: no path at all


def test_the_addons_custom_is_vllms_until_it_is_unregistered(synced):
    from mla_prefill_ext import MLAPrefillBackendEnum, register_mla_prefill_backend

    register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, "custom_backends.WrappedSDPABackend")
    registration.sync(synced)
    assert registration.is_ours(synced.enum.CUSTOM)
    assert synced.enum.CUSTOM.get_path() == registration.adapter_path("CUSTOM")
    registration.unregister(synced)
    assert not synced.enum.CUSTOM.is_overridden()


def test_nothing_changed_nothing_synced_unless_forced(synced):
    """A sync copies the add-on's registry when its generation moved (or when forced), not otherwise."""
    from mla_prefill_ext import MLAPrefillBackendEnum, register_mla_prefill_backend

    register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, "custom_backends.WrappedSDPABackend")
    registration.sync(synced)
    synced.enum.CUSTOM.clear_override()  # changed behind the add-on's back
    registration.sync(synced)
    assert not synced.enum.CUSTOM.is_overridden()  # the add-on's registry did not change
    registration.sync(synced, force=True)
    assert registration.is_ours(synced.enum.CUSTOM)


def test_a_custom_registered_through_vllm_stays_and_gets_one_warning(synced, addon_log):
    from mla_prefill_ext import MLAPrefillBackendEnum, register_mla_prefill_backend

    synced.registry.register_mla_prefill_backend(synced.enum.CUSTOM, FOREIGN)
    register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, "custom_backends.WrappedSDPABackend")
    for _ in range(2):
        registration.sync(synced, force=True)
    assert synced.enum.CUSTOM.get_path() == FOREIGN
    warnings = [r.getMessage() for r in addon_log if r.levelno == logging.WARNING]
    (warning,) = [w for w in warnings if "backend is registered through vLLM's own API" in w]
    assert f"({FOREIGN})" in warning and "Register only one of them" in warning
    registration.unregister(synced)
    assert synced.enum.CUSTOM.get_path() == FOREIGN  # not the add-on's to take back


def test_a_new_name_is_a_member_of_vllms_enum_that_pickles_by_name(synced):
    """vLLM 0.33+: registered by string; its member pickles by name (unpickled where it is not yet)."""
    from mla_prefill_ext import register_mla_prefill_backend

    if not synced.string_names:
        pytest.skip("this vLLM registers no new names: they are reached through the add-on's choice")
    register_mla_prefill_backend("REGISTRATION_SDPA", "custom_backends.WrappedSDPABackend")
    registration.sync(synced)
    member = synced.enum.__members__["REGISTRATION_SDPA"]
    assert registration.is_ours(member)
    assert "REGISTRATION_SDPA" not in registration.native_names(synced)
    function, args = member.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    assert (function, args) == (registration._restore_member, ("REGISTRATION_SDPA",))
    assert pickle.loads(pickle.dumps(member)) is member
