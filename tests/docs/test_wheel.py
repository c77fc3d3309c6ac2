"""The wheel and the sdist a user installs: built from this checkout's package into a temporary folder.

With ``build`` (requirements-dev.txt): ``python -m build --no-isolation``, the sdist and the wheel
built from it; without it (the bridged test environments): ``pip wheel --no-build-isolation``, the
wheel alone. Both without network: the build tools are this environment's. Installed and used beside
vLLM, the wheel is checked by scripts/check_wheel.sh (CI).
"""

from __future__ import annotations

import configparser
import importlib.util
import shutil
import subprocess
import sys
import tarfile
import zipfile
from email.message import Message
from email.parser import Parser
from pathlib import Path

import pytest

import mla_prefill_ext
from mla_prefill_ext import versions

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_SOURCES = ("pyproject.toml", "README.md", "LICENSE", "mla_prefill_ext")
MODULES = sorted(
    p.relative_to(ROOT).as_posix()
    for p in (ROOT / "mla_prefill_ext").rglob("*.py")
    if "__pycache__" not in p.parts
)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path | None]:
    """The wheel and (with ``build``) the sdist. From a copy of the package's files: a build writes
    into the folder it builds from, and the copy shows that nothing else is needed."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    for name in PACKAGE_SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, src / name)
    if importlib.util.find_spec("build") is not None:
        command = [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src)]
    else:
        setuptools = pytest.importorskip("setuptools")
        if int(setuptools.__version__.split(".")[0]) < 77:  # what pyproject.toml's build-system needs
            pytest.skip(f"neither build nor setuptools>=77 here (setuptools {setuptools.__version__})")
        command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out)]
        command.append(str(src))
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (wheel,) = out.glob("*.whl")
    sdists = list(out.glob("*.tar.gz"))
    return {"wheel": wheel, "sdist": sdists[0] if sdists else None}


def wheel_file(built: dict[str, Path | None], name: str) -> str:
    with zipfile.ZipFile(built["wheel"]) as whl:
        return whl.read(f"mla_prefill_ext-{mla_prefill_ext.__version__}.dist-info/{name}").decode()


def metadata(text: str) -> Message:
    return Parser().parsestr(text)


def test_the_wheel_holds_the_package_and_nothing_else(built: dict[str, Path | None]) -> None:
    assert built["wheel"].name == f"mla_prefill_ext-{mla_prefill_ext.__version__}-py3-none-any.whl"
    with zipfile.ZipFile(built["wheel"]) as whl:
        names = whl.namelist()
    assert sorted(n for n in names if not n.startswith("mla_prefill_ext-")) == MODULES
    assert wheel_file(built, "top_level.txt").split() == ["mla_prefill_ext"]


def test_the_wheel_declares_the_vllm_plugin_and_the_console_script(built: dict[str, Path | None]) -> None:
    entry_points = configparser.ConfigParser()
    entry_points.read_string(wheel_file(built, "entry_points.txt"))
    assert dict(entry_points["vllm.general_plugins"]) == {"mla_prefill_ext": "mla_prefill_ext:activate"}
    assert dict(entry_points["console_scripts"]) == {"mla-prefill-ext": "mla_prefill_ext.cli:main"}
    assert set(entry_points.sections()) == {"vllm.general_plugins", "console_scripts"}


def test_the_wheel_carries_the_license(built: dict[str, Path | None]) -> None:
    assert wheel_file(built, "licenses/LICENSE") == (ROOT / "LICENSE").read_text()
    assert "Apache License\n                           Version 2.0" in (ROOT / "LICENSE").read_text()
    meta = metadata(wheel_file(built, "METADATA"))
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta.get_all("License-File") == ["LICENSE"]


@pytest.mark.parametrize(
    "release", ["0.19.1", "0.20.2", "0.21.0", "0.22.1", "0.23.0", "0.25.1", "0.34.0", "0.40.0"]
)
def test_the_wheel_metadata_states_the_supported_vllm_range(
    built: dict[str, Path | None], release: str
) -> None:
    from packaging.requirements import Requirement

    meta = metadata(wheel_file(built, "METADATA"))
    assert meta["Name"] == "mla-prefill-ext" and meta["Version"] == mla_prefill_ext.__version__
    assert meta["Requires-Python"] == ">=3.10"
    assert meta.get_all("Provides-Extra") == ["vllm"]
    requirements = [Requirement(r) for r in meta.get_all("Requires-Dist")]
    # vLLM only through the extra: installing the add-on never changes the vLLM it goes beside.
    assert [str(r) for r in requirements if r.marker is None] == ["wrapt>=2.5"]
    (vllm,) = [r for r in requirements if r.name == "vllm"]
    assert vllm.marker.evaluate({"extra": "vllm"}) and not vllm.marker.evaluate({"extra": ""})
    supported = versions.decide(release).mode != versions.NONE
    assert vllm.specifier.contains(release) == supported, (release, str(vllm.specifier))
    assert meta.get_payload().startswith("# mla-prefill-ext\n")  # the README, as the description


def test_the_sdist_holds_what_the_wheel_is_built_from(built: dict[str, Path | None]) -> None:
    if built["sdist"] is None:
        pytest.skip("no sdist without the build package (pip wheel builds the wheel alone)")
    top = f"mla_prefill_ext-{mla_prefill_ext.__version__}"
    with tarfile.open(built["sdist"]) as sdist:
        names = {n.removeprefix(f"{top}/") for n in sdist.getnames()}
        pkg_info = sdist.extractfile(f"{top}/PKG-INFO").read().decode()
    assert {"pyproject.toml", "README.md", "LICENSE", "PKG-INFO", *MODULES} <= names
    assert not any(n.startswith(("tests/", "scripts/", "docs/")) for n in names)
    wheel_meta, sdist_meta = metadata(wheel_file(built, "METADATA")), metadata(pkg_info)
    for field in ("Name", "Version", "Requires-Python", "License-Expression"):
        assert sdist_meta[field] == wheel_meta[field], field
    assert sdist_meta.get_all("Requires-Dist") == wheel_meta.get_all("Requires-Dist")
