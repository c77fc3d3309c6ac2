"""Dependency direction: who may import whom inside the package, checked statically (ast).

- Backends import neither the selector nor a host: a backend is chosen, it does not
  choose, and a backend that reached into a host (the code that knows vLLM's internals)
  would tie every backend to vLLM's layer internals and to import order.
- The registry imports no selector (the selector keys its cache on the registry's counter).
- The two hosts, ``hosts/vllm_0_20/`` (the patch) and ``hosts/vllm_0_23/`` (the bridge), import
  nothing from each other, and no concrete backend: they know the backend base class only.
- ``hosts/core/`` (what both hosts do) imports neither host.
- The CLI imports only the hosts' public interface (``hosts/__init__`` and ``hosts/core``),
  never a host's own modules: it asks the host in force what it reports.
- The runtime path (everything but ``testing/``, the CLI and ``bench/``) imports nothing from
  ``mla_prefill_ext.testing``: the conformance kit is a tool, never loaded by an engine (the
  benchmark, another tool, drives backends through it).

Checked over the source files, so an import inside a function or under ``TYPE_CHECKING``
counts too, as does ``importlib.import_module("...")`` with a literal name.

No import cycles: the package's modules, and the tools' under scripts/, linked by every import
(imports inside functions and under ``TYPE_CHECKING`` included), form no cycle. A cycle held
together by an import inside a function works only in the order someone happened to import
things, and needs guards to stop the recursion; one closed by a type-only import is the same
circle in the design, one moved annotation away from recursing.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest

PACKAGE = "mla_prefill_ext"
HOSTS = f"{PACKAGE}.hosts"
PATCH_HOST = f"{HOSTS}.vllm_0_20"
BRIDGE_HOST = f"{HOSTS}.vllm_0_23"
FORBIDDEN = PATCH_HOST
REPO_ROOT = Path(__file__).resolve().parents[2]
ROOT = REPO_ROOT / PACKAGE
SCRIPTS_DIR = REPO_ROOT / "scripts"
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
        "backends-import-no-selector-or-host",
        _in("backends"),
        lambda: (f"{PACKAGE}.selector", HOSTS),
        "a backend is chosen, it does not choose; the hosts depend on backends, not the reverse",
    ),
    Rule(
        "registry-imports-no-selector",
        _in("registry"),
        lambda: (f"{PACKAGE}.selector",),
        "the selector depends on the registry (it keys its cache on registry.generation())",
    ),
    Rule(
        "patch-host-imports-no-bridge-host-or-concrete-backend",
        _in("hosts.vllm_0_20"),
        lambda: (BRIDGE_HOST, *concrete_backends()),
        "the two hosts import nothing from each other; the patch knows the backend base class only",
    ),
    Rule(
        "bridge-host-imports-no-patch-host-or-concrete-backend",
        _in("hosts.vllm_0_23"),
        lambda: (PATCH_HOST, *concrete_backends()),
        "the two hosts import nothing from each other; the bridge knows the backend base class only",
    ),
    Rule(
        "host-core-imports-no-host",
        _in("hosts.core"),
        lambda: (PATCH_HOST, BRIDGE_HOST),
        "the core is what both hosts do, on every vLLM: it cannot depend on either",
    ),
    Rule(
        "cli-imports-only-the-hosts-interface",
        _in("cli"),
        lambda: (PATCH_HOST, BRIDGE_HOST),
        "the CLI asks the host in force through hosts/__init__ and hosts/core, never a host's internals",
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
        "import mla_prefill_ext.hosts.vllm_0_20.mla",
        "from mla_prefill_ext.hosts.vllm_0_20.mla import INSTRUMENTOR",
        "from mla_prefill_ext.hosts import vllm_0_20",
        "from ..hosts.vllm_0_20 import mla",
        "from ..hosts import vllm_0_20",
        "def f():\n    from mla_prefill_ext.hosts.vllm_0_20 import mla",
        "if TYPE_CHECKING:\n    from mla_prefill_ext.hosts.vllm_0_20 import mla",
        "import importlib\nimportlib.import_module('mla_prefill_ext.hosts.vllm_0_20.mla')",
    ):
        assert forbidden_imports(source, importer), source
    for source in (
        "from mla_prefill_ext.backends.base import MLAPrefillBackend",
        "from . import base",
        "from mla_prefill_ext import selector",
        "import mla_prefill_ext.hosts.vllm_0_20x",
    ):
        assert not forbidden_imports(source, importer), source


def test_a_concrete_backend_is_told_from_the_base_class():
    concrete = concrete_backends()
    assert f"{PACKAGE}.backends.flashinfer" in concrete and f"{PACKAGE}.backends.base" not in concrete
    importer = f"{PACKAGE}.hosts.vllm_0_20.hooks.layer"
    for source in (
        "from mla_prefill_ext.backends.flashinfer import FlashInferPrefillBackend",
        "from mla_prefill_ext.backends import flashinfer",
        "from ....backends.torch_sdpa import TorchSDPAPrefillBackend",
    ):
        assert forbidden_imports(source, importer, concrete), source
    for source in (
        "from mla_prefill_ext.backends.base import MLAPrefillBackend",
        "from mla_prefill_ext.backends import MLAPrefillBackend",
        "from ....backends import base",
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


# --- import cycles -------------------------------------------------------------------------------


def _module_of(name: str, modules: set[str]) -> str | None:
    """The package module that ``import name`` loads itself (a package's is its ``__init__``)."""
    if name in modules:
        return name
    if f"{name}.__init__" in modules:
        return f"{name}.__init__"
    return None


def module_imports(source: str, importer: str, modules: set[str]) -> dict[str, int]:
    """{module: line} of every import in ``source`` of one of ``modules``, wherever it stands.

    ``from pkg import name`` counts as an import of ``pkg.name`` when that is a module, else of
    ``pkg``; parent packages a dotted import loads on the way are not counted (Python runs them
    first, they never close a cycle by themselves).
    """
    found: dict[str, int] = {}

    def add(name: str, line: int) -> None:
        module = _module_of(name, modules)
        if module is not None and module != importer:
            found.setdefault(module, line)

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node.module, node.level, importer)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                add(sub if _module_of(sub, modules) else base, node.lineno)
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")
        ):
            add(node.args[0].value, node.lineno)
    return found


def import_graph(sources: dict[str, str]) -> dict[str, dict[str, int]]:
    """{module: {imported package module: line}} for ``sources`` ({dotted name: source})."""
    modules = set(sources)
    return {name: module_imports(source, name, modules) for name, source in sources.items()}


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (as a closed path) per strongly connected group of modules (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def connect(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(graph.get(module, {})):
            if target not in index:
                connect(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            connect(module)
    return [_path_through(group, graph) for group in sorted(groups)]


def _path_through(group: list[str], graph: dict[str, dict[str, int]]) -> list[str]:
    """A shortest cycle from the group's first module back to it, through the group."""
    start, members = group[0], set(group)
    paths = {start: [start]}
    queue = [start]
    while queue:
        module = queue.pop(0)
        for target in sorted(graph[module]):
            if target == start:
                return [*paths[module], start]
            if target in members and target not in paths:
                paths[target] = [*paths[module], target]
                queue.append(target)
    return group


def describe_cycle(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    short = [m.removeprefix(f"{PACKAGE}.") for m in cycle]
    steps = [f"{a} (line {graph[ca][cb]})" for a, ca, cb in zip(short, cycle, cycle[1:], strict=False)]
    return " -> ".join([*steps, short[-1]])


def test_the_cycle_check_sees_a_cycle_through_a_function_level_import():
    sources = {
        f"{PACKAGE}.a": "def f():\n    from mla_prefill_ext import b\n",
        f"{PACKAGE}.b": "import importlib\nimportlib.import_module('mla_prefill_ext.c')\n",
        f"{PACKAGE}.c": "from . import a\n",
        f"{PACKAGE}.d": "import json\n",
        f"{PACKAGE}.p.__init__": "from mla_prefill_ext.p.q import X\n",
        f"{PACKAGE}.p.q": "from mla_prefill_ext import d\n",
    }
    graph = import_graph(sources)
    assert graph[f"{PACKAGE}.d"] == {}  # not a module of the graph: no edge
    assert graph[f"{PACKAGE}.p.__init__"] == {f"{PACKAGE}.p.q": 1}
    cycles = import_cycles(graph)
    assert cycles == [[f"{PACKAGE}.a", f"{PACKAGE}.b", f"{PACKAGE}.c", f"{PACKAGE}.a"]]
    assert describe_cycle(cycles[0], graph) == "a (line 2) -> b (line 2) -> c (line 1) -> a"
    sources[f"{PACKAGE}.c"] = "from mla_prefill_ext import d\n"
    assert import_cycles(import_graph(sources)) == []


def test_the_cycle_check_sees_a_cycle_closed_by_a_type_only_import():
    # The shape base.py and warmup.py had: an import inside a method one way, a TYPE_CHECKING one back.
    sources = {
        f"{PACKAGE}.base": "def warm_up():\n    from mla_prefill_ext.warmup import run\n",
        f"{PACKAGE}.warmup": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from mla_prefill_ext.base import B\n"
        ),
    }
    graph = import_graph(sources)
    assert import_cycles(graph) == [[f"{PACKAGE}.base", f"{PACKAGE}.warmup", f"{PACKAGE}.base"]]
    assert describe_cycle(import_cycles(graph)[0], graph) == "base (line 2) -> warmup (line 3) -> base"


def test_the_cycle_check_reads_the_scripts_as_python_does():
    sources = {
        "scripts.bench.__init__": "",
        "scripts.bench.a": "from . import b\n",
        "scripts.bench.b": "def f():\n    from .a import x\n",
    }
    assert import_cycles(import_graph(sources)) == [["scripts.bench.a", "scripts.bench.b", "scripts.bench.a"]]
    names = {name for name, _ in script_modules()}
    assert {"scripts.bench.__main__", "scripts.gpu_harness.scenarios"} <= names


def script_modules() -> list[tuple[str, Path]]:
    """(dotted name, path) of every Python file under scripts/, as ``python -m scripts...`` names it."""
    return [
        (".".join(["scripts", *path.relative_to(SCRIPTS_DIR).with_suffix("").parts]), path)
        for path in sorted(SCRIPTS_DIR.rglob("*.py"))
    ]


@pytest.mark.parametrize("tree", ["package", "scripts"])
def test_no_import_cycle(tree: str):
    modules = package_modules() if tree == "package" else script_modules()
    graph = import_graph({name: path.read_text() for name, path in modules})
    cycles = [describe_cycle(cycle, graph) for cycle in import_cycles(graph)]
    why = "imports inside functions and type-only ones count"
    assert not cycles, f"import cycles in the {tree} ({why}):\n" + "\n".join(cycles)


# Scripts (benchmarks, tools) build on the package and its test kit (mla_prefill_ext.testing), never
# on the test suite: tests/ is not installed, and a script reaching into it ties the benchmarks to the
# suite's private helpers and to sys.path tricks.
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
    assert {"tests", "conftest", "custom_backends", "cli_runs"} <= suite
    for source in (
        "from tests.gpu import scenarios",
        "import tests.gpu.scenarios",
        "import custom_backends",
        "def f():\n    import custom_backends",
        "from cli_runs import start",
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


# Python that the shell scripts under scripts/ run inline (python -c "...", heredocs): the same rule.
INLINE_IMPORT_OF_THE_SUITE = re.compile(r"^\s*(from\s+tests[.\s]|import\s+tests\b)", re.MULTILINE)


def test_no_shell_script_under_scripts_imports_tests():
    shell = sorted(SCRIPTS_DIR.rglob("*.sh"))
    assert shell
    found = [
        f"{path.relative_to(REPO_ROOT)}:{text[: m.start()].count(chr(10)) + 1}"
        for path in shell
        for text in [path.read_text()]
        for m in INLINE_IMPORT_OF_THE_SUITE.finditer(text)
    ]
    assert not found, f"shell scripts import the test suite in inline Python: {found}"
    assert INLINE_IMPORT_OF_THE_SUITE.search('  "$python" -c "\nfrom tests.gpu.recorded_runs import check')
    assert not INLINE_IMPORT_OF_THE_SUITE.search("python -m pytest tests/gpu/test_shared_prefix.py")
