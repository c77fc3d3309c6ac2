"""The shared values: one selector config wherever it is imported from, the typed automatic source."""

from __future__ import annotations

import json

import torch

import mla_prefill_ext
from mla_prefill_ext import selector
from mla_prefill_ext import value_types as types
from mla_prefill_ext.backends import base
from mla_prefill_ext.backends.torch_sdpa import TorchSDPAPrefillBackend
from mla_prefill_ext.selector import Selection
from mla_prefill_ext.value_types import AUTOMATIC, R1_MLA_DIMS, MLADims, MLAPrefillSelectorConfig


def test_one_selector_config_under_every_name():
    assert mla_prefill_ext.MLAPrefillSelectorConfig is MLAPrefillSelectorConfig
    assert selector.MLAPrefillSelectorConfig is MLAPrefillSelectorConfig
    assert base.R1_MLA_DIMS is R1_MLA_DIMS


def test_r1_dims_compare_as_a_plain_tuple():
    assert R1_MLA_DIMS == (128, 64, 128) and isinstance(R1_MLA_DIMS, MLADims)
    assert R1_MLA_DIMS.v_head_dim == 128


def test_automatic_reads_as_before_in_text_and_json():
    assert str(AUTOMATIC) == f"{AUTOMATIC}" == "automatic"
    assert f"{AUTOMATIC:>10}" == " automatic"
    assert json.dumps({"source": AUTOMATIC}) == '{"source": "automatic"}'
    assert AUTOMATIC == "automatic"  # callers that still compare with the old string keep working


def test_selection_is_automatic_by_identity_only():
    config = MLAPrefillSelectorConfig(torch.bfloat16, True)
    auto = Selection(TorchSDPAPrefillBackend, "TORCH_SDPA", AUTOMATIC, None, config)
    assert auto.is_automatic
    # A setting's name that happens to spell the word is still a setting.
    named = Selection(TorchSDPAPrefillBackend, "TORCH_SDPA", "automatic", None, config)
    assert not named.is_automatic
    assert types.Automatic("automatic") is AUTOMATIC
