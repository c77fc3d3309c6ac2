"""The command-line tests' harness and their runs that import vLLM (helpers/cli_runs.py)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_runs import start_runs, write_harness


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory for PYTHONPATH: the import simulation and the user backend modules and packages."""
    return write_harness(tmp_path_factory.mktemp("cli_harness"))


@pytest.fixture(scope="module")
def slow(
    request: pytest.FixtureRequest, harness: Path
) -> Iterator[dict[str, subprocess.CompletedProcess[str]]]:
    """The test module's SLOW_RUNS, all started on first use, each awaited when a test reads it."""
    yield from start_runs(request.module.SLOW_RUNS, getattr(request.module, "SLOW_RUN_PATHS", {}), harness)
