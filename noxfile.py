"""The test matrix: the CPU suite against each tested vLLM (``python -m nox``; ``-s tests-0.25.1`` for one).

The releases come from ``mla_prefill_ext/versions.py`` (``TESTED``, ``DEV_TESTED``), read
by path: nox's interpreter may not import the package.

* ``tests-0.20.2`` (``DEV_TESTED``) runs in the interpreter that runs nox: ``.venv`` from
  ``scripts/setup.sh`` (vLLM 0.20.2, the patch mode; requirements-dev.txt pins it).
* ``tests-0.25.1``, ``tests-0.33.0`` and ``tests-0.34.0`` each have a virtual environment under
  ``.nox/`` (8-9 GB: vLLM pins its own PyTorch), made once and reused; vLLM is installed
  only when the environment lacks that release; the test tools (a no-op once there) and the
  add-on (editable, from this checkout) every time.
* A release with a pin that PyPI cannot satisfy (``PIN_SUBSTITUTES``) is installed with
  ``--no-deps``, then its requirements, read from its installed metadata, with that pin replaced
  (every time, a no-op once there: an interrupted install completes on the next run).

pytest runs with two workers (pytest-xdist, ``-n 2 --dist loadfile``).

``MLA_NOX_DISCARD_ENVS=1`` (set by ``.ci/run``) deletes a bridged session's environment when the
session ends: on a fresh CI machine the environments together (9 GB each) may not fit on disk,
one at a time (18 GB with ``.venv``) does.

``-t bridged`` runs the bridged sessions alone (what ``.ci/run`` does after the README's command).

Arguments after ``--`` go to pytest (``python -m nox -- -x tests/hosts/vllm_0_23/test_bridge.py``).
The supported versions and modes are declared in ``mla_prefill_ext/versions.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

import nox


def _versions_table():
    """``mla_prefill_ext/versions.py`` alone (no vLLM, no package ``__init__``): the one table."""
    path = Path(__file__).parent / "mla_prefill_ext" / "versions.py"
    spec = importlib.util.spec_from_file_location("_mla_prefill_ext_versions", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_VERSIONS = _versions_table()
DEV_VERSION = _VERSIONS.DEV_TESTED
VENV_VERSIONS = tuple(v for v in _VERSIONS.TESTED if v != DEV_VERSION)

nox.options.sessions = [f"tests-{v}" for v in _VERSIONS.TESTED]
BRIDGED_TAG = "bridged"  # the sessions of VENV_VERSIONS: each in its own environment under .nox/
nox.options.reuse_venv = "yes"

# Two workers, each test module kept on one (module-scoped fixtures start their processes once).
PYTEST = ("-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadfile")
TEST_TOOLS = ("pytest>=8", "pytest-xdist>=3", "hypothesis>=6", "pytest-benchmark>=4")

# Pins of a release that PyPI cannot satisfy, by release: the requirement name -> what to install
# instead. vLLM 0.34.0 pins flashinfer-python==0.7.3, a release PyPI never had; 0.7.4 is the nearest.
PIN_SUBSTITUTES: dict[str, dict[str, str]] = {
    "0.34.0": {"flashinfer-python": "flashinfer-python==0.7.4"},
}

# The installed vLLM's requirements as JSON [name, requirement] pairs, without its extras and without
# those whose environment markers do not hold here (run in the session's environment: its markers).
_REQUIREMENTS_OF_VLLM = (
    "import json; from importlib.metadata import requires; "
    "from packaging.requirements import Requirement; from packaging.utils import canonicalize_name; "
    "rs = [Requirement(line) for line in requires('vllm') or ()]; "
    "print(json.dumps([[canonicalize_name(r.name), str(r).split(';')[0].strip()] for r in rs "
    "if r.marker is None or r.marker.evaluate({'extra': ''})]))"
)

# The installed vLLM's version without importing vLLM (seconds): "none" when it is absent.
_VERSION_OF_VLLM = (
    "from importlib.metadata import distributions as d; "
    "print(next((x.version for x in d(name='vllm')), 'none'))"
)


@nox.session(name=f"tests-{DEV_VERSION}", python=False)
def tests_dev(session: nox.Session) -> None:
    found = session.run(sys.executable, "-c", _VERSION_OF_VLLM, silent=True).strip()
    if found != DEV_VERSION:
        session.error(
            f"this interpreter ({sys.executable}) has vLLM {found}, not {DEV_VERSION}: run nox with the "
            "interpreter of scripts/setup.sh's environment, .venv/bin/python -m nox"
        )
    session.run(sys.executable, *PYTEST, *session.posargs)


tests_dev.__doc__ = f"vLLM {DEV_VERSION} (patch mode), in this interpreter (``.venv/bin/python -m nox``)."


def _install_substituted(session: nox.Session, version: str, install_vllm: bool) -> None:
    """vLLM ``version`` without its own dependencies, then its requirements with PIN_SUBSTITUTES's."""
    substitutes = PIN_SUBSTITUTES[version]
    if install_vllm:
        session.install("--no-deps", f"vllm=={version}", "packaging")  # packaging: to read its metadata
    listed = json.loads(session.run_install("python", "-c", _REQUIREMENTS_OF_VLLM, silent=True))
    missing = set(substitutes) - {name for name, _ in listed}
    if missing:  # a substitute for a pin vLLM no longer has would hide that the table is stale
        session.error(f"vLLM {version} has no requirement {sorted(missing)}: update PIN_SUBSTITUTES")
    # pip reports the replaced pin as a conflict with vLLM's metadata and installs it all the same.
    session.install(*(substitutes.get(name, req) for name, req in listed), *TEST_TOOLS)


def _bridged(version: str) -> None:
    # Tagged: `nox -t bridged` (.ci/run) runs every bridged release of the table, none named by hand.
    @nox.session(name=f"tests-{version}", venv_backend="venv", reuse_venv=True, tags=[BRIDGED_TAG])
    def tests(session: nox.Session) -> None:
        # run_install: the probe decides what to install, so it runs under --install-only too.
        found = session.run_install("python", "-c", _VERSION_OF_VLLM, silent=True).strip()
        if version in PIN_SUBSTITUTES:
            _install_substituted(session, version, install_vllm=found != version)
        elif found != version:
            session.install(f"vllm=={version}", *TEST_TOOLS)
        else:
            session.install(*TEST_TOOLS)  # a no-op once they are there
        session.install("--no-deps", "-e", ".")
        session.install("wrapt>=2.5")
        try:
            session.run("python", *PYTEST, *session.posargs)
        finally:
            if os.environ.get("MLA_NOX_DISCARD_ENVS") == "1":
                session.log(f"MLA_NOX_DISCARD_ENVS=1: deleting {session.virtualenv.location}")
                shutil.rmtree(session.virtualenv.location, ignore_errors=True)

    tests.__doc__ = f"vLLM {version} (bridge mode), in .nox/tests-{version.replace('.', '-')}."
    globals()[f"tests_{version.replace('.', '_')}"] = tests


for _version in VENV_VERSIONS:
    _bridged(_version)
