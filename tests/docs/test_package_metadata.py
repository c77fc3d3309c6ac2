"""pyproject.toml's metadata says what the package is: both modes, the supported vLLM range, one version."""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest

import mla_prefill_ext
from mla_prefill_ext import versions

ROOT = Path(__file__).resolve().parents[2]


def pyproject() -> dict[str, Any]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_version_is_written_in_one_place() -> None:
    from setuptools.config.expand import read_attr

    config = pyproject()
    assert "version" not in config["project"] and "version" in config["project"]["dynamic"]
    attr = config["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "mla_prefill_ext.__version__"
    # What setuptools writes into the metadata: read from the source, as a build reads it.
    assert read_attr(attr, root_dir=ROOT) == mla_prefill_ext.__version__
    # And what this environment's installation says (built from a checkout of this tree).
    assert version("mla-prefill-ext") == mla_prefill_ext.__version__


def test_the_description_names_both_modes() -> None:
    description = pyproject()["project"]["description"]
    assert "0.20.x" in description and "0.23" in description
    assert "patch" in description and "bridge" in description


@pytest.mark.parametrize(
    "release",
    ["0.19.1", "0.20.0", "0.20.2", "0.21.0", "0.22.1", "0.23.0", "0.25.1", "0.29.0", "0.33.0", "0.40.0"],
)
def test_the_vllm_extra_is_the_supported_range(release: str) -> None:
    """``pip install mla-prefill-ext[vllm]`` may pick exactly the releases the add-on serves."""
    from packaging.requirements import Requirement

    (spec,) = pyproject()["project"]["optional-dependencies"]["vllm"]
    requirement = Requirement(spec)
    assert requirement.name == "vllm"
    supported = versions.decide(release).mode != versions.NONE
    assert requirement.specifier.contains(release) == supported, (release, versions.decide(release))


def test_the_classifiers_cover_the_python_versions() -> None:
    project = pyproject()["project"]
    low = tuple(int(x) for x in project["requires-python"].removeprefix(">=").split("."))
    listed = [
        tuple(int(x) for x in c.rsplit(" :: ", 1)[1].split("."))
        for c in project["classifiers"]
        if c.startswith("Programming Language :: Python :: 3.")
    ]
    assert min(listed) == low
    assert "Development Status" in " ".join(project["classifiers"])
