"""The mode table: which vLLM versions the add-on patches, bridges or leaves alone (runs everywhere)."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from mla_prefill_ext import versions


@pytest.mark.parametrize(
    ("version", "mode"),
    [
        ("0.19.1", "none"),
        ("0.20.0", "patch"),
        ("0.20.2", "patch"),
        ("0.20.3.dev4+gabc", "patch"),
        ("0.21.0rc1", "none"),  # a pre-release of 0.21 is 0.21
        ("0.21.0", "none"),
        ("0.22.1", "none"),
        ("0.23.0", "bridge"),
        ("0.25.1", "bridge"),
        ("0.33.0", "bridge"),
        ("0.33.4", "bridge"),
        ("0.34.0", "bridge"),
        ("1.0.0", "bridge"),
    ],
)
def test_mode_by_version(version, mode):
    assert versions.decide(version).mode == mode


def test_untested_releases_warn_once_naming_the_tested_ones():
    assert versions.decide("0.33.2").warning is None
    assert versions.decide("0.34.2").warning is None  # the newest tested line (0.34.0)
    warning = versions.decide("0.35.0").warning
    assert warning is not None and all(v in warning for v in versions.TESTED)


def test_versions_without_a_mode_say_why():
    reason = versions.decide("0.21.0").reason
    assert reason is not None and "0.21.0" in reason and "register" in reason
    assert versions.decide("garbage").reason is not None
    assert versions.decide("0.25.1").reason is None


def test_the_patch_range_is_the_tables_patch_row():
    assert versions.requirement(versions.PATCH) == ">=0.20.0,<0.21"
    assert versions.unsupported_reason(versions.PATCH, "0.20.2") is None
    assert versions.unsupported_reason(versions.PATCH, "0.25.1") is not None


def test_rows_cover_every_release_from_the_first_supported_one_without_gaps():
    rows = versions.MODES
    for before, after in itertools.pairwise(rows):
        assert before.high == after.low
    assert rows[-1].high is None


def test_the_dev_requirements_pin_the_release_the_default_environment_tests():
    """requirements-dev.txt (what scripts/setup.sh installs) and the table name the same vLLM."""
    text = (Path(__file__).resolve().parents[2] / "requirements-dev.txt").read_text()
    assert re.findall(r"^vllm==(\S+)\s*$", text, re.MULTILINE) == [versions.DEV_TESTED]
    assert versions.DEV_TESTED in versions.TESTED
    assert versions.decide(versions.DEV_TESTED).mode == versions.PATCH
