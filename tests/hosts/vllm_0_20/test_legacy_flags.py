"""vLLM 0.20's legacy prefill flags: read by the 0.20 host and handed to the selector as a choice."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from logs import warnings_in
from platform_views import device
from vllm_configs import config

from mla_prefill_ext import _logging, selector
from mla_prefill_ext.backends.flash_attn import FlashAttnPrefillBackend
from mla_prefill_ext.backends.flashinfer import FlashInferPrefillBackend
from mla_prefill_ext.backends.trtllm_ragged import TrtllmRaggedPrefillBackend
from mla_prefill_ext.hosts.vllm_0_20 import legacy_flags
from mla_prefill_ext.value_types import AUTOMATIC

LEGACY_TRTLLM = legacy_flags.TRTLLM_SOURCE
LEGACY_FLASHINFER = legacy_flags.FLASHINFER_SOURCE
pytestmark = [pytest.mark.usefixtures("clean_selection"), pytest.mark.vllm_patch]  # vLLM 0.20's flags
Records = list[logging.LogRecord]


def test_the_flags_as_a_choice(r1: Path, clean_selection: pytest.MonkeyPatch) -> None:
    trtllm = legacy_flags.legacy_choice(config(r1, use_trtllm_ragged_deepseek_prefill=True))
    assert (trtllm.name, trtllm.source, trtllm.explicit) == ("TRTLLM_RAGGED", LEGACY_TRTLLM, False)
    assert legacy_flags.legacy_choice(config(r1, disable_flashinfer_prefill=False)).name == "FLASHINFER"
    assert legacy_flags.legacy_choice(config(r1)) is None  # vLLM 0.20's defaults ask for nothing
    # A user's setting, "auto" included, silences the flags.
    assert legacy_flags.legacy_choice(config(r1, "auto", use_trtllm_ragged_deepseek_prefill=True)) is None
    clean_selection.setenv(selector.BACKEND_ENV, "flash_attn")
    assert legacy_flags.legacy_choice(config(r1, use_trtllm_ragged_deepseek_prefill=True)) is None


def test_the_selector_alone_reads_no_vllm_flags(r1: Path) -> None:
    cfg = config(r1, use_trtllm_ragged_deepseek_prefill=True)
    with device((10, 0)):
        assert selector.selection_for(cfg).source is AUTOMATIC
        assert legacy_flags.selection_for(cfg).source == LEGACY_TRTLLM


def test_legacy_trtllm_flag_when_valid(r1: Path, addon_log: Records) -> None:
    with device((10, 0)):
        selection = legacy_flags.selection_for(config(r1, use_trtllm_ragged_deepseek_prefill=True))
    assert selection.backend is TrtllmRaggedPrefillBackend
    assert selection.source == LEGACY_TRTLLM
    assert warnings_in(addon_log) == []


def test_legacy_trtllm_flag_when_invalid_warns_and_falls_back(r1: Path, addon_log: Records) -> None:
    with device((9, 0)):
        selection = legacy_flags.selection_for(config(r1, use_trtllm_ragged_deepseek_prefill=True))
    assert selection.backend is FlashAttnPrefillBackend
    assert selection.source is AUTOMATIC
    assert selection.rejected["TRTLLM_RAGGED"] == ["compute capability 9.0 not supported"]
    (warning,) = warnings_in(addon_log)
    assert "TRTLLM_RAGGED" in warning
    assert LEGACY_TRTLLM in warning
    assert "Falling back to automatic selection" in warning


def test_legacy_flashinfer_flag(r1: Path, non_r1: Path, addon_log: Records) -> None:
    with device((9, 0)):
        selection = legacy_flags.selection_for(config(r1, disable_flashinfer_prefill=False))
        assert selection.backend is FlashInferPrefillBackend
        assert selection.source == LEGACY_FLASHINFER
        assert warnings_in(addon_log) == []
        fallback = legacy_flags.selection_for(config(non_r1, disable_flashinfer_prefill=False))
    assert fallback.name == "FLASH_ATTN"
    assert "DeepSeek-R1 MLA dimensions" in fallback.rejected["FLASHINFER"][0]
    assert any("FLASHINFER" in w and "Falling back" in w for w in warnings_in(addon_log))


def test_cudnn_flag_warns_once_and_selects_automatically(r1: Path, addon_log: Records) -> None:
    _logging.forget_logged()  # another test may have used up the one warning
    cfg = config(r1, use_cudnn_prefill=True)
    with device((9, 0)):
        first = legacy_flags.selection_for(cfg)
        selector.clear_cache()
        second = legacy_flags.selection_for(cfg)
    assert first.name == second.name == "FLASH_ATTN"
    assert first.source is AUTOMATIC
    deprecations = [w for w in warnings_in(addon_log) if "use_cudnn_prefill is deprecated" in w]
    assert len(deprecations) == 1
    assert "MLA_PREFILL_BACKEND" in deprecations[0]


def test_cudnn_flag_is_silent_under_a_users_choice(r1: Path, addon_log: Records) -> None:
    _logging.forget_logged()
    with device((9, 0)):
        legacy_flags.selection_for(config(r1, "flash_attn", use_cudnn_prefill=True))
    assert not [w for w in warnings_in(addon_log) if "use_cudnn_prefill" in w]
