"""Broken installed backend packages: what the docs promise is what an engine's selection does.

Automatic selection imports each installed backend to read its claim and leaves a broken one out
with one WARNING per package, naming the package; an explicit choice of another backend imports
none of them and says nothing.
"""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

import pytest
import torch
from entry_point_packages import BACKEND_MODULE, install

from mla_prefill_ext import registry, selector, settings
from mla_prefill_ext.selector import MLAPrefillSelectorConfig

R1_BF16 = MLAPrefillSelectorConfig(torch.bfloat16, True)
# The README points to docs/backends.md for backend packages; that page says what a broken one does.
BACKENDS_DOC = (Path(__file__).resolve().parents[2] / "docs" / "backends.md").read_text()

BROKEN = {
    # name: (package, module text, what the warning says)
    "FAKE_RAISES": ("fakepkg-raises", "raise RuntimeError('no kernel library here')\n", "no kernel library"),
    "FAKE_NOT_SUB": ("fakepkg-not-sub", "class FakeNotSubBackend:\n    pass\n", "not a subclass"),
    "FAKE_PARTIAL": (
        "fakepkg-partial",
        "from mla_prefill_ext.backends.base import MLAPrefillBackend\n\n\n"
        "class FakePartialBackend(MLAPrefillBackend):\n    pass\n",
        "does not implement",
    ),
    "FAKE_WRONG_NAME": ("fakepkg-wrong-name", None, "entry point's name must be the backend's name"),
}


@pytest.fixture
def broken(site: Path) -> dict[str, str]:
    for name, (dist, text, _) in BROKEN.items():
        module = f"fakepkg_{name.lower()}"
        cls = f"{name.title().replace('_', '')}Backend"
        if text is None:  # a good backend whose get_name() is not the entry point's name
            text = BACKEND_MODULE.format(cls=cls, name="SOMETHING_ELSE", claim="None")
        install(site, dist, {name: f"{module}:{cls}"}, {module: text})
    registry.discover_installed(refresh=True)
    return {name: f"fakepkg_{name.lower()}" for name in BROKEN}


def warnings(records: list[logging.LogRecord]) -> list[str]:
    return [r.getMessage() for r in records if r.levelno == logging.WARNING]


def test_automatic_selection_warns_once_per_broken_package_naming_it(broken, addon_log):
    for _ in range(3):
        assert selector.select(None, R1_BF16).name == "TORCH_SDPA"
    lines = warnings(addon_log)
    assert len(lines) == len(BROKEN), lines
    for name, (dist, _, why) in BROKEN.items():
        (line,) = [m for m in lines if m.startswith(f"MLA prefill backend {name} is left out")]
        assert why in line and dist in line, line


def test_an_explicit_choice_imports_no_installed_backend_and_says_nothing(broken, addon_log):
    choice = selector.Choice("TORCH_SDPA", settings.BACKEND_ENV, True)
    assert selector.select(None, R1_BF16, choice).name == "TORCH_SDPA"
    assert not warnings(addon_log)
    assert not set(broken.values()) & set(sys.modules)


def test_the_backends_doc_says_what_the_code_does():
    text = " ".join(BACKENDS_DOC.split())
    assert "never affects an engine that does not select it" not in text
    assert re.search(r"automatic selection leaves it out with one WARNING per broken package", text)
    assert "an explicit choice imports only the chosen class" in text
