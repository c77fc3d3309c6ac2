"""Installs a package with pip into a folder of its own, as a user's environment would hold it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path


def pip_install(source: Path, root: Path) -> Path:
    """pip-install a copy of ``source`` (setuptools builds in the source tree) into ``root/site``."""
    src, site = root / "src", root / "site"
    shutil.copytree(source, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return site
