"""Dependency direction: backends never import the patch (``mla_prefill_ext.patches``).

The patch is the only code that knows vLLM's internals and depends on the backends; a backend
that reached back into it would tie every backend to vLLM's layer internals (and to import
order). Checked statically over the source files, so an import inside a function counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "mla_prefill_ext"
FORBIDDEN = f"{PACKAGE}.patches"
BACKENDS = Path(__file__).resolve().parent.parent / PACKAGE / "backends"


def _absolute(module: str | None, level: int, importer: str) -> str:
    """The absolute module name of ``from <level dots><module> import ...`` in ``importer``."""
    if level == 0:
        return module or ""
    base = importer.split(".")[:-level]
    return ".".join([*base, module] if module else base)


def forbidden_imports(source: str, importer: str) -> list[str]:
    """Every import of ``mla_prefill_ext.patches`` (or below) in ``source``, as ``line: module``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node.module, node.level, importer)
            targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")
        ):
            targets = [node.args[0].value]
        for name in targets:
            if name == FORBIDDEN or name.startswith(FORBIDDEN + "."):
                found.append(f"{node.lineno}: {name}")
                break
    return found


def backend_modules() -> list[tuple[str, Path]]:
    """(dotted name, path) of every module under backends/; a package's is ``<package>.__init__``,
    so that its relative imports resolve as Python resolves them."""
    files = sorted(BACKENDS.rglob("*.py"))
    return [
        (".".join([PACKAGE, *path.relative_to(BACKENDS.parent).with_suffix("").parts]), path)
        for path in files
    ]


def test_the_check_sees_every_form_of_import():
    importer = f"{PACKAGE}.backends.flashinfer"
    for source in (
        "import mla_prefill_ext.patches.layers",
        "from mla_prefill_ext.patches.layers import mla_layer_hyperparameters",
        "from mla_prefill_ext import patches",
        "from ..patches import wrappers",
        "from .. import patches",
        "def f():\n    from mla_prefill_ext.patches import layers",
        "import importlib\nimportlib.import_module('mla_prefill_ext.patches.layers')",
    ):
        assert forbidden_imports(source, importer), source
    for source in (
        "from mla_prefill_ext.backends.base import MLAPrefillBackend",
        "from . import base",
        "from mla_prefill_ext import selector",
        "import mla_prefill_ext.patchesque",
    ):
        assert not forbidden_imports(source, importer), source


def test_backends_are_found():
    names = [name for name, _ in backend_modules()]
    assert f"{PACKAGE}.backends.base" in names and f"{PACKAGE}.backends.flashinfer" in names
    assert f"{PACKAGE}.backends.__init__" in names


@pytest.mark.parametrize("module,path", backend_modules(), ids=[name for name, _ in backend_modules()])
def test_backend_does_not_import_the_patch(module: str, path: Path):
    found = forbidden_imports(path.read_text(), module)
    assert not found, (
        f"{module} imports {FORBIDDEN} (the patch depends on backends, not the reverse): {found}"
    )


# Scripts (benchmarks, tools) build on the package and its test kit (mla_prefill_ext.testing), never
# on the test suite: tests/ is not installed, and a script reaching into it ties the benchmarks to the
# suite's private helpers and to sys.path tricks.
REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPTS_DIR = REPO_ROOT / "scripts"
TESTS_DIR = REPO_ROOT / "tests"


def suite_modules() -> set[str]:
    """``tests`` and every module name in tests/ (conftest and test files put its folders on sys.path)."""
    return {"tests", *(path.stem for path in TESTS_DIR.rglob("*.py"))}


def imports_of_the_test_suite(source: str, suite: set[str]) -> list[str]:
    """Every import in ``source`` whose top-level name is the test suite or one of its modules."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")
        ):
            names = [node.args[0].value]
        found += [f"{node.lineno}: {name}" for name in names if name.split(".")[0] in suite]
    return found


def test_the_scripts_check_sees_every_form_of_import():
    suite = suite_modules()
    assert {"tests", "conftest", "custom_backends", "scenarios"} <= suite
    for source in (
        "from tests.gpu import scenarios",
        "import tests.gpu.scenarios",
        "import custom_backends",
        "def f():\n    import custom_backends",
        "from scenarios import run_all",
        "import importlib\nimportlib.import_module('tests.gpu.scenarios')",
    ):
        assert imports_of_the_test_suite(source, suite), source
    for source in (
        "from mla_prefill_ext.testing import vllm_host",
        "import mla_prefill_ext.testing.vllm_host as host",
        "import testsuite",
        "from common import ROOT",
    ):
        assert not imports_of_the_test_suite(source, suite), source


def test_nothing_under_scripts_imports_tests():
    suite = suite_modules()
    scripts = sorted(SCRIPTS_DIR.rglob("*.py"))
    assert scripts
    found = {
        str(path.relative_to(REPO_ROOT)): hits
        for path in scripts
        if (hits := imports_of_the_test_suite(path.read_text(), suite))
    }
    assert not found, (
        f"scripts import the test suite (move what they need to mla_prefill_ext.testing): {found}"
    )
