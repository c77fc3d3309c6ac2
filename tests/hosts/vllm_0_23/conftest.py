"""The bridge's fixtures (vLLM 0.23+): the add-on activated, and its records down to INFO."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture
def bridged(clean_selection: pytest.MonkeyPatch) -> Iterator[Any]:
    """The add-on activated (bridge mode) with no choice or registration; the shape it found."""
    import mla_prefill_ext
    from mla_prefill_ext.hosts import vllm_0_23 as bridge
    from mla_prefill_ext.hosts.vllm_0_23 import selector_wrappers as selection

    mla_prefill_ext.activate()
    importlib.import_module(bridge.PREFILL_PACKAGE)  # the bridge lands when vLLM's selector is imported
    assert bridge.is_instrumented(), bridge.state().problem
    shape = bridge.state().shape
    shape.selector._auto_select_mla_prefill_backend.cache_clear()  # vLLM's own cache of its picks
    yield shape
    shape.selector._auto_select_mla_prefill_backend.cache_clear()
    selection.clear_caches()


@pytest.fixture
def info_log(addon_log: list[logging.LogRecord]) -> Iterator[list[logging.LogRecord]]:
    """The add-on's records down to INFO (the tests run vLLM's loggers at WARNING)."""
    logger = logging.getLogger("vllm.mla_prefill_ext")
    level = logger.level
    logger.setLevel(logging.INFO)
    yield addon_log
    logger.setLevel(level)
