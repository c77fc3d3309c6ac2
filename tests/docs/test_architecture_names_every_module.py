"""docs/architecture.md's module map names every module and folder of the package.

A module added without its line in the map leaves the next maintainer guessing what it is for. The map
names modules by file name (``step.py`` or ``step``) under their folder, and folders as ``name/``.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "mla_prefill_ext"
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def module_map(text: str) -> str:
    """The text of the "Module map" section (to the next second-level heading)."""
    return text.split("\n## Module map", 1)[1].split("\n## ", 1)[0]


def names(section: str, name: str) -> bool:
    """Whether ``section`` names ``name`` as a word: ``name``, ``name.py`` or ``name/``."""
    return re.search(rf"(?<![\w.]){re.escape(name)}(?:\.py|/)?(?![\w])", section) is not None


def missing_names(section: str) -> list[str]:
    """Each module (by file name) and folder of the package that ``section`` does not name."""
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "__pycache__" in path.parts or path.name == "__init__.py":
            continue  # a package is named by its folder
        if not names(section, path.stem):
            missing.append(str(path.relative_to(PACKAGE)))
    for folder in sorted(p for p in PACKAGE.rglob("*") if p.is_dir() and (p / "__init__.py").is_file()):
        if not names(section, f"{folder.name}/"):
            missing.append(f"{folder.relative_to(PACKAGE)}/")
    return missing


def test_names_are_read_as_words():
    section = "  cli/  info.py, select; run (the bench); chunk_index\n  runtime.py"
    assert names(section, "info") and names(section, "select") and names(section, "run")
    assert names(section, "chunk_index") and names(section, "cli/")
    assert not names(section, "index") and not names(section, "time") and not names(section, "bench/")


def test_the_module_map_names_every_module_of_the_package():
    missing = missing_names(module_map(ARCHITECTURE.read_text()))
    assert not missing, f"docs/architecture.md's module map does not name: {missing}"
