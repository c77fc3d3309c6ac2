"""A name registered by call is found in any case through the enum too, as through MLA_PREFILL_BACKEND."""

from __future__ import annotations

import uuid

import pytest

from mla_prefill_ext import registry
from mla_prefill_ext.registry import MLAPrefillBackendEnum, register_mla_prefill_backend

TORCH_SDPA_PATH = "mla_prefill_ext.backends.torch_sdpa.TorchSDPAPrefillBackend"
pytestmark = pytest.mark.usefixtures("clean_selection")


def test_enum_lookup_of_a_lower_case_registration_in_any_case():
    name = f"my_lower_{uuid.uuid4().hex[:8]}"  # members stay for the process: a fresh name
    register_mla_prefill_backend(name, TORCH_SDPA_PATH)
    member = MLAPrefillBackendEnum[name]
    assert MLAPrefillBackendEnum[name.upper()] is member
    assert registry.lookup(name.upper()) is member  # as MLA_PREFILL_BACKEND resolves it
    assert MLAPrefillBackendEnum["torch_sdpa"] is MLAPrefillBackendEnum.TORCH_SDPA


def test_enum_lookup_of_an_unknown_name_still_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"Unknown MLA prefill backend: 'NO_SUCH_NAME'.*TORCH_SDPA"):
        MLAPrefillBackendEnum["NO_SUCH_NAME"]
