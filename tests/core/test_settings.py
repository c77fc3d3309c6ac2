"""Settings: the one parser of the user's choice, the overrides' round trip, the engine-config stamp."""

from __future__ import annotations

import json
import os
from unittest import mock

import pytest

from mla_prefill_ext import settings

# --- One parser of the user's choice -------------------------------------------------------------


@pytest.mark.parametrize(
    ("additional", "env", "expected"),
    [
        ({}, None, (False, None)),
        ({"mla_prefill_backend": None}, None, (False, None)),  # None: not set
        ({"mla_prefill_backend": ""}, "flashinfer", (True, "flashinfer")),  # blank: not set
        ({"mla_prefill_backend": "  "}, None, (False, None)),
        ({"mla_prefill_backend": "auto"}, "FLASHINFER", (True, None)),  # auto is set: automatic
        ({"mla_prefill_backend": "FLASH_ATTN"}, "FLASHINFER", (True, "FLASH_ATTN")),
        ({}, "Auto", (True, None)),
        ({}, " torch_sdpa ", (True, "torch_sdpa")),
    ],
)
def test_one_parser_for_every_caller(clean_selection, additional, env, expected):
    from mla_prefill_ext.hosts.core import refusal
    from mla_prefill_ext.selector import requested_choice

    if env is not None:
        clean_selection.setenv(settings.BACKEND_ENV, env)
    is_set, choice = settings.user_setting(additional)
    assert (is_set, choice.name if choice else None) == expected
    config = mock.Mock(additional_config=additional, attention_config=None)
    assert requested_choice(config) == choice
    # The guard of an unpatchable vLLM refuses exactly what the selector would honour.
    with mock.patch("vllm.config.get_current_vllm_config_or_none", return_value=config):
        assert (refusal.explicit_choice() is not None) == (choice is not None)


def test_a_choice_that_is_not_a_string_is_named():
    with pytest.raises(TypeError, match=r"additional_config\['mla_prefill_backend'\].*int 3"):
        settings.user_setting({"mla_prefill_backend": 3})


def test_where_a_choice_came_from(clean_selection):
    assert settings.user_setting({"mla_prefill_backend": "x"})[1].source == (
        "additional_config['mla_prefill_backend']"
    )
    clean_selection.setenv(settings.BACKEND_ENV, "x")
    choice = settings.explicit_choice()
    assert (choice.source, choice.explicit) == (settings.BACKEND_ENV, True)


@pytest.mark.parametrize(("value", "disabled"), [("1", True), (" Yes ", True), ("on", True), ("0", False)])
def test_the_disable_switch(clean_selection, value, disabled):
    clean_selection.setenv(settings.DISABLE_ENV, value)
    assert settings.is_disabled() is disabled
    clean_selection.delenv(settings.DISABLE_ENV)
    assert not settings.is_disabled()


def test_environment_names_every_variable(clean_selection):
    clean_selection.setenv(settings.BACKEND_ENV, "flash_attn")
    assert settings.environment() == {
        settings.BACKEND_ENV: "flash_attn",
        settings.OVERRIDES_ENV: None,
        settings.DISABLE_ENV: os.environ.get(settings.DISABLE_ENV),
    }


# --- Registrations handed to child processes -----------------------------------------------------


def test_overrides_round_trip_through_the_environment(clean_selection):
    settings.mirror_overrides({"CUSTOM": "pkg.mod.Backend", "A_NAME": "pkg.a.A"})
    raw = settings.overrides_in_environment()
    assert raw == os.environ[settings.OVERRIDES_ENV] == json.dumps(json.loads(raw), sort_keys=True)
    assert settings.parse_overrides(raw) == {"A_NAME": "pkg.a.A", "CUSTOM": "pkg.mod.Backend"}
    settings.mirror_overrides({})
    assert settings.OVERRIDES_ENV not in os.environ


@pytest.mark.parametrize("raw", ["[1, 2]", "not json", '"CUSTOM"'])
def test_overrides_that_are_not_an_object_are_refused(raw):
    with pytest.raises(ValueError):
        settings.parse_overrides(raw)


def test_the_registry_owns_no_name_of_its_own():
    from mla_prefill_ext import registry

    assert registry.OVERRIDES_ENV is settings.OVERRIDES_ENV


# --- Settings reach Ray workers through vLLM's own copy list -------------------------------------


def test_copy_list_is_extended_once_and_keeps_the_users_entries(clean_selection):
    clean_selection.setenv(settings.RAY_COPY_LIST_ENV, "MY_VAR")
    settings.ask_vllm_to_copy_to_ray()
    settings.ask_vllm_to_copy_to_ray()
    listed = os.environ[settings.RAY_COPY_LIST_ENV].split(",")
    assert listed[0] == "MY_VAR"
    assert sorted(listed[1:]) == sorted(
        [*settings.ENV_VARS, settings.SHARED_PREFIX_ENV, settings.SHARED_DECODE_ENV]
    )


# --- The engine-config stamp ---------------------------------------------------------------------


def test_snapshot_is_normalised(clean_selection):
    assert settings.snapshot() == settings.DEFAULT_SNAPSHOT
    clean_selection.setenv(settings.BACKEND_ENV, " flashinfer ")
    clean_selection.setenv(settings.OVERRIDES_ENV, '{"CUSTOM": "m.C"}')
    clean_selection.setenv(settings.DISABLE_ENV, "true")
    assert settings.snapshot() == {
        settings.BACKEND_ENV: "FLASHINFER",
        settings.OVERRIDES_ENV: {"CUSTOM": "m.C"},
        settings.DISABLE_ENV: True,
    }
    clean_selection.setenv(settings.OVERRIDES_ENV, "{broken")
    assert settings.snapshot()[settings.OVERRIDES_ENV] == "{broken"  # kept as given, compared as such


def test_nothing_set_means_no_stamp(clean_selection):
    assert settings.stamped({"other": 1}) is None


def test_the_stamp_is_a_new_dict(clean_selection):
    clean_selection.setenv(settings.BACKEND_ENV, "torch_sdpa")
    users = {"other": 1}
    stamped = settings.stamped(users)
    assert users == {"other": 1}
    assert stamped == {"other": 1, settings.STAMP_KEY: settings.snapshot()}
    assert settings.stamped(None) is None  # no additional_config to carry it


def test_a_process_whose_settings_differ_says_what_to_set(clean_selection):
    clean_selection.setenv(settings.BACKEND_ENV, "torch_sdpa")
    additional = settings.stamped({})
    assert settings.engine_mismatch(additional) is None
    assert settings.engine_mismatch({}) is None and settings.engine_mismatch(None) is None
    clean_selection.delenv(settings.BACKEND_ENV)
    problem = settings.engine_mismatch(additional)
    assert "MLA_PREFILL_BACKEND='AUTO'" in problem and "Set MLA_PREFILL_BACKEND='TORCH_SDPA'" in problem
