"""Dependency direction: who may import whom inside the package, checked statically (ast).

- Backends import neither the selector nor the patch: a backend is chosen, it does not
  choose, and a backend that reached into the patch (the only code that knows vLLM's
  internals) would tie every backend to vLLM's layer internals and to import order.
- The registry imports no selector (the selector keys its cache on the registry's counter).
- Nothing under ``patches/`` imports a concrete backend: the patch knows the base class only.
- The two hosts, ``patches/`` (vLLM 0.20) and ``bridge/`` (vLLM 0.23+), import nothing from each
  other; the bridge, too, knows the backend base class only.
- The runtime path (everything but ``testing/``, the CLI and ``bench/``) imports nothing from
  ``mla_prefill_ext.testing``: the conformance kit is a tool, never loaded by an engine (the
  benchmark, another tool, drives backends through it).

Checked over the source files, so an import inside a function or under ``TYPE_CHECKING``
counts too, as does ``importlib.import_module("...")`` with a literal name.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest

PACKAGE = "mla_prefill_ext"
FORBIDDEN = f"{PACKAGE}.patches"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE
BACKENDS = ROOT / "backends"


def _absolute(module: str | None, level: int, importer: str) -> str:
    """The absolute module name of ``from <level dots><module> import ...`` in ``importer``."""
    if level == 0:
        return module or ""
    base = importer.split(".")[:-level]
    return ".".join([*base, module] if module else base)


def _is_under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def forbidden_imports(source: str, importer: str, forbidden: tuple[str, ...] = (FORBIDDEN,)) -> list[str]:
    """Every import of a module in ``forbidden`` (or below) in ``source``, as ``line: module``."""
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
            if _is_under(name, forbidden):
                found.append(f"{node.lineno}: {name}")
                break
    return found


def package_modules() -> list[tuple[str, Path]]:
    """(dotted name, path) of every module of the package; a package's is ``<package>.__init__``,
    so that its relative imports resolve as Python resolves them."""
    return [
        (".".join([PACKAGE, *path.relative_to(ROOT).with_suffix("").parts]), path)
        for path in sorted(ROOT.rglob("*.py"))
    ]


def backend_modules() -> list[tuple[str, Path]]:
    return [(name, path) for name, path in package_modules() if _is_under(name, (f"{PACKAGE}.backends",))]


def concrete_backends() -> tuple[str, ...]:
    """Every backend module but the base class's: what the patch must never name."""
    return tuple(
        name
        for name, _ in backend_modules()
        if name not in (f"{PACKAGE}.backends.base", f"{PACKAGE}.backends.__init__")
    )


def _in(*prefixes: str) -> Callable[[str], bool]:
    full = tuple(f"{PACKAGE}.{p}" for p in prefixes)
    return lambda module: _is_under(module, full)


class Rule(NamedTuple):
    name: str
    applies_to: Callable[[str], bool]
    forbidden: Callable[[], tuple[str, ...]]
    why: str


RULES = (
    Rule(
        "backends-import-no-selector-or-patch",
        _in("backends"),
        lambda: (f"{PACKAGE}.selector", FORBIDDEN),
        "a backend is chosen, it does not choose; the patch depends on backends, not the reverse",
    ),
    Rule(
        "registry-imports-no-selector",
        _in("registry"),
        lambda: (f"{PACKAGE}.selector",),
        "the selector depends on the registry (it keys its cache on registry.generation())",
    ),
    Rule(
        "patches-import-no-concrete-backend",
        _in("patches"),
        concrete_backends,
        "the patch knows the backend base class only (hooks such as accept_layer_hyperparameters)",
    ),
    Rule(
        "patches-import-no-bridge",
        _in("patches"),
        lambda: (f"{PACKAGE}.bridge",),
        "the two hosts (vLLM 0.20's patch, vLLM 0.23+'s bridge) import nothing from each other",
    ),
    Rule(
        "bridge-imports-no-patch-or-concrete-backend",
        _in("bridge"),
        lambda: (FORBIDDEN, *concrete_backends()),
        "the two hosts import nothing from each other; the bridge knows the backend base class only",
    ),
    Rule(
        "runtime-imports-no-testing",
        lambda module: not _in("testing", "cli", "bench")(module),
        lambda: (f"{PACKAGE}.testing",),
        "the conformance kit is a tool: no engine process may load it",
    ),
)

CASES = [
    (rule, module, path) for rule in RULES for module, path in package_modules() if rule.applies_to(module)
]


def test_the_check_sees_every_form_of_import():
    importer = f"{PACKAGE}.backends.flashinfer"
    for source in (
        "import mla_prefill_ext.patches.mla",
        "from mla_prefill_ext.patches.mla import INSTRUMENTOR",
        "from mla_prefill_ext import patches",
        "from ..patches import wrappers",
        "from .. import patches",
        "def f():\n    from mla_prefill_ext.patches import mla",
        "if TYPE_CHECKING:\n    from mla_prefill_ext.patches import mla",
        "import importlib\nimportlib.import_module('mla_prefill_ext.patches.mla')",
    ):
        assert forbidden_imports(source, importer), source
    for source in (
        "from mla_prefill_ext.backends.base import MLAPrefillBackend",
        "from . import base",
        "from mla_prefill_ext import selector",
        "import mla_prefill_ext.patchesque",
    ):
        assert not forbidden_imports(source, importer), source


def test_a_concrete_backend_is_told_from_the_base_class():
    concrete = concrete_backends()
    assert f"{PACKAGE}.backends.flashinfer" in concrete and f"{PACKAGE}.backends.base" not in concrete
    importer = f"{PACKAGE}.patches.hooks.layer"
    for source in (
        "from mla_prefill_ext.backends.flashinfer import FlashInferPrefillBackend",
        "from mla_prefill_ext.backends import flashinfer",
        "from ...backends.torch_sdpa import TorchSDPAPrefillBackend",
    ):
        assert forbidden_imports(source, importer, concrete), source
    for source in (
        "from mla_prefill_ext.backends.base import MLAPrefillBackend",
        "from mla_prefill_ext.backends import MLAPrefillBackend",
        "from ...backends import base",
    ):
        assert not forbidden_imports(source, importer, concrete), source


def test_every_rule_has_modules_to_check():
    names = {name for name, _ in package_modules()}
    assert {f"{PACKAGE}.backends.__init__", f"{PACKAGE}.backends.flashinfer", f"{PACKAGE}.registry"} <= names
    for rule in RULES:
        assert any(case[0] is rule for case in CASES), rule.name


@pytest.mark.parametrize(
    ("rule", "module", "path"), CASES, ids=[f"{rule.name}:{module}" for rule, module, _ in CASES]
)
def test_dependency_direction(rule: Rule, module: str, path: Path):
    found = forbidden_imports(path.read_text(), module, rule.forbidden())
    assert not found, f"{module} imports {found}: {rule.why} ({rule.name})"


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
