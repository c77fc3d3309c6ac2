"""The suite's own layout: no test module imports another; shared helpers live in tests/helpers/.

A test module that imports another runs that module's import-time code (and its fixtures'
names) wherever it is imported, and ties two files of different package areas together.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in ``tree``, inside functions too."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def imports_of_test_modules(source: str) -> list[str]:
    """The imports in ``source`` of a test module, by bare name or through the ``tests`` package."""
    return [
        f"{line}: {module}"
        for line, module in imported_modules(ast.parse(source))
        if any(part.startswith("test_") for part in module.split("."))
    ]


def test_the_check_sees_an_import_of_a_test_module():
    assert imports_of_test_modules("from test_layer import TOLERANCE") == ["1: test_layer"]
    assert imports_of_test_modules("def f():\n    import tests.core.test_selector") == [
        "2: tests.core.test_selector"
    ]
    assert imports_of_test_modules("import custom_backends\nfrom mla_prefill_ext import testing") == []


def test_no_test_module_imports_another():
    offenders = {
        str(path.relative_to(TESTS)): found
        for path in sorted(TESTS.rglob("test_*.py"))
        if (found := imports_of_test_modules(path.read_text()))
    }
    assert not offenders, f"move what they share to tests/helpers/: {offenders}"
