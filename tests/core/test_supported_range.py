"""The supported vLLM range is said the same way by the doctor, --help and the README's first line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from mla_prefill_ext import versions
from mla_prefill_ext.cli import build_parser
from mla_prefill_ext.cli.common import install_hint

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def first_paragraph() -> str:
    return " ".join(README.split("\n\n")[1].split())


def test_the_range_names_both_modes_as_the_version_table_does():
    modes = {m.name: m for m in versions.MODES}
    assert modes[versions.PATCH].low[:2] == (0, 20) and modes[versions.BRIDGE].low[:2] == (0, 23)
    assert versions.SUPPORTED_TEXT == "vLLM 0.20.x (patched) or 0.23+ (bridged)"


def test_help_the_doctor_and_the_readme_agree():
    text = versions.SUPPORTED_TEXT
    help_text = " ".join(build_parser().format_help().split())
    assert text in help_text
    hint = install_hint()
    assert text in hint and versions.INSTALL_SPEC in hint and all(v in hint for v in versions.TESTED)
    assert f"**{text}**" in first_paragraph()


def test_the_readme_says_how_to_run_info_from_a_checkout():
    command = "PYTHONPATH=. python3 -m mla_prefill_ext info"
    assert f"`{command}`" in " ".join(README.split())
    # It runs as written at the checkout's root (here with the test's interpreter).
    env = {**os.environ, "PYTHONPATH": "."}
    done = subprocess.run(
        [sys.executable, "-m", "mla_prefill_ext", "info"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.stdout.startswith("mla-prefill-ext "), done.stdout + done.stderr[-2000:]
    assert "verdict:" in done.stdout
