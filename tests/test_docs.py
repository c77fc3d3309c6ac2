"""The README's generated parts stay true."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_backend_table_is_current():
    script = load_script("backend_table")
    assert script.readme_copy((ROOT / "README.md").read_text()) == script.table(), (
        "README.md's backend table is stale: run python scripts/backend_table.py --write"
    )


def test_readme_quick_start_commands_exist():
    text = (ROOT / "README.md").read_text()
    assert "bash scripts/setup.sh && .venv/bin/mla-prefill-ext check" in text
    assert ".venv/bin/python -m pytest -q" in text
    assert ".venv/bin/python -m pytest -q" in (ROOT / ".ci" / "run").read_text()


def test_check_command_passes_on_this_machine():
    """The README's main job: one prefill through the selected backend against float64."""
    proc = subprocess.run(
        [sys.executable, "-m", "mla_prefill_ext", "check", "--json", "--repeat", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert '"ok": true' in proc.stdout
