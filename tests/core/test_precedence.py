"""Messages about the user's settings: an overridden choice, an invalid overrides variable, unknown names.

Each message names the setting it is about, so that the user knows what to change.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from vllm.config import AttentionConfig

from mla_prefill_ext import registry, selector, settings
from mla_prefill_ext._logging import forget_logged
from mla_prefill_ext.selector import MLAPrefillSelectorConfig
from mla_prefill_ext.testing import vllm_host as host

R1_BF16 = MLAPrefillSelectorConfig(torch.bfloat16, True)
NOT_JSON = "{CUSTOM: my_sdpa.MySDPABackend}"
pytestmark = pytest.mark.usefixtures("clean_selection")


def config(model_dir: Path, choice: str | None = None):
    additional = {} if choice is None else {"mla_prefill_backend": choice}
    return host.make_vllm_config(model_dir, additional_config=additional, attention_config=AttentionConfig())


def infos(records: list[logging.LogRecord]) -> list[str]:
    return [r.getMessage() for r in records if r.levelno == logging.INFO]


@pytest.fixture
def info_log(addon_log):
    logger = logging.getLogger("vllm.mla_prefill_ext")
    level = logger.level
    logger.setLevel(logging.INFO)
    forget_logged()  # the line is logged once per process
    yield addon_log
    logger.setLevel(level)


# Item 1: an explicit choice overridden by additional_config is one INFO line naming it


@pytest.mark.parametrize("in_config", ["TORCH_SDPA", "auto"])
def test_additional_config_overriding_the_environment_is_one_info_line(
    r1, clean_selection, info_log, in_config
):
    clean_selection.setenv(settings.BACKEND_ENV, "FLASH_ATTN")
    cfg = config(r1, in_config)
    assert selector.selection_for(cfg).name == "TORCH_SDPA"
    assert selector.selection_for(cfg).name == "TORCH_SDPA"
    lines = [m for m in infos(info_log) if "MLA_PREFILL_BACKEND='FLASH_ATTN'" in m]
    assert len(lines) == 1, infos(info_log)
    assert "ignored" in lines[0] and f"additional_config['mla_prefill_backend']='{in_config}'" in lines[0]


def test_no_line_when_both_agree_or_only_one_is_set(r1, clean_selection, info_log):
    clean_selection.setenv(settings.BACKEND_ENV, "torch_sdpa")
    selector.selection_for(config(r1, "TORCH_SDPA"))
    clean_selection.delenv(settings.BACKEND_ENV)
    selector.selection_for(config(r1, "TORCH_SDPA"))
    assert not [m for m in infos(info_log) if "ignored" in m]


# Item 2: an invalid MLA_PREFILL_BACKEND_OVERRIDES is refused, with the variable, the error and the form


def test_invalid_overrides_stop_selection_with_variable_error_and_example(r1, clean_selection):
    clean_selection.setenv(settings.OVERRIDES_ENV, NOT_JSON)
    for attempt in (
        lambda: selector.select(None, R1_BF16),
        lambda: selector.select(None, R1_BF16, selector.Choice("CUSTOM", settings.BACKEND_ENV, True)),
        lambda: selector.selection_for(config(r1)),
    ):
        with pytest.raises(ValueError) as info:
            attempt()
        message = str(info.value)
        assert message.startswith(f"{settings.OVERRIDES_ENV}='{NOT_JSON}' cannot be used")
        assert "Expecting property name" in message  # the parse error
        assert settings.OVERRIDES_EXAMPLE in message
        assert "must be registered before use" not in message


def test_an_override_entry_without_a_class_path_is_refused(clean_selection):
    clean_selection.setenv(settings.OVERRIDES_ENV, json.dumps({"CUSTOM": 3}))
    with pytest.raises(ValueError, match="the class path of 'CUSTOM' is not a non-empty string"):
        selector.select(None, R1_BF16)


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in settings.ENV_VARS}
    return subprocess.run(
        [sys.executable, "-m", "mla_prefill_ext", *args],
        env={**environ, "VLLM_LOGGING_LEVEL": "ERROR", **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    "command",
    [
        ["check", "--repeat", "1"],
        ["select"],
        # bench with a named backend never reaches the selector: it must refuse on its own.
        ["bench", "--backend", "CUSTOM", "--device", "cpu", "--dims", "8,4,8,2", "--shapes", "1x16"],
    ],
)
def test_check_select_and_bench_exit_non_zero_on_invalid_overrides(command):
    done = _cli(*command, **{settings.OVERRIDES_ENV: NOT_JSON})
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"{settings.OVERRIDES_ENV}='{NOT_JSON}' cannot be used" in done.stdout
    assert "PASS" not in done.stdout
    assert settings.OVERRIDES_ENV not in done.stderr  # said once, in the report: no log line repeats it


# Item 4: the engine-start error for an unknown name names where the name came from


@pytest.mark.parametrize("where", ["additional_config", "environment"])
def test_unknown_name_at_engine_start_names_its_source(r1, clean_selection, where):
    if where == "environment":
        clean_selection.setenv(settings.BACKEND_ENV, "NOPE")
        cfg, source = config(r1), settings.BACKEND_ENV
    else:
        cfg, source = config(r1, "NOPE"), "additional_config['mla_prefill_backend']"
    with pytest.raises(ValueError) as info:
        selector.get_mla_prefill_backend(cfg)
    message = str(info.value)
    assert "Unknown MLA prefill backend: 'NOPE'" in message
    assert f"The name comes from {source}" in message
    assert "TORCH_SDPA" in message  # still lists the valid names


def test_valid_overrides_still_apply(clean_selection):
    clean_selection.setenv(
        settings.OVERRIDES_ENV,
        json.dumps({"CUSTOM": "mla_prefill_ext.backends.torch_sdpa.TorchSDPAPrefillBackend"}),
    )
    assert settings.overrides_problem() is None
    registry._apply_environment()
    assert (
        selector.select(None, R1_BF16, selector.Choice("CUSTOM", settings.BACKEND_ENV, True)).name == "CUSTOM"
    )
