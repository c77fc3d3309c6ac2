"""The command line as a user runs it: in a subprocess, judged by its output and exit code.

No command may answer with a Python traceback: missing dependencies, an unsupported vLLM,
bad settings, bad flags and failing backends are findings or usage errors. Exit codes:
0 all is well, 1 a problem found, 2 cannot check (or a bad flag, with the usage line).

Without vLLM or PyTorch: a real virtual environment without vLLM would cost minutes to
build, so those runs simulate one. A ``sitecustomize`` module, put first on PYTHONPATH
in a temporary directory, installs a meta path finder that raises ModuleNotFoundError
for the blocked top-level modules (``vllm``, ``torch``) and hides their distributions
from ``importlib.metadata``, which is how a bare environment looks to the add-on. The
same module can make the installed vLLM report another version (``vllm.__version__``
and its metadata), to play an unsupported vLLM.

Runs that import vLLM cost 5-10 s each on a small CPU machine; they are started
together, in parallel, when the first test needs one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mla_prefill_ext import __version__
from mla_prefill_ext.cli import build_parser
from mla_prefill_ext.versions import INSTALL_SPEC, SUPPORTED_TEXT

ROOT = Path(__file__).resolve().parent.parent
SUPPORTED = SUPPORTED_TEXT

SITECUSTOMIZE = '''
"""Test harness: hide modules (MLA_TEST_HIDE) or fake vLLM's version (MLA_TEST_VLLM_VERSION)."""
import importlib.abc
import importlib.machinery
import importlib.metadata
import os
import sys

HIDDEN = {m for m in os.environ.get("MLA_TEST_HIDE", "").split(",") if m}
FAKE_VLLM = os.environ.get("MLA_TEST_VLLM_VERSION")


class Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        if FAKE_VLLM and name == "vllm":
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            real_exec = spec.loader.exec_module

            def exec_module(module):
                real_exec(module)
                module.__version__ = FAKE_VLLM

            spec.loader.exec_module = exec_module
            return spec
        return None


sys.meta_path.insert(0, Finder())
real_version = importlib.metadata.version


def version(name):
    if name.lower() in HIDDEN:
        raise importlib.metadata.PackageNotFoundError(name)
    if FAKE_VLLM and name.lower() == "vllm":
        return FAKE_VLLM
    return real_version(name)


importlib.metadata.version = version
'''

# The README's decorator example, without the methods it elides.
README_BACKEND = """
from mla_prefill_ext import MLAPrefillBackend


class MyPrefill(MLAPrefillBackend): ...
"""

BROKEN_BACKEND = """
from mla_prefill_ext.backends.torch_sdpa import TorchSDPAPrefillBackend


class Broken(TorchSDPAPrefillBackend):
    @staticmethod
    def get_name():
        return "BROKEN"

    def run_prefill_new_tokens(self, q, k, v, return_softmax_lse):
        raise RuntimeError("kernel exploded")
"""

CLAIM_BACKEND = """
from mla_prefill_ext.backends.base import AutoSelectClaim
from mla_prefill_ext.backends.torch_sdpa import TorchSDPAPrefillBackend


class DemoClaimBackend(TorchSDPAPrefillBackend):
    auto_select_claim = AutoSelectClaim(("cpu",))

    @staticmethod
    def get_name():
        return "DEMO_CLAIM"
"""
CLAIM_CLASS = "demo_claim_backend.DemoClaimBackend"

# Two installed packages whose backends claim the same place (before FLASH_ATTN, or before
# TORCH_SDPA where FLASH_ATTN is not in the device's list) on every device.
RIVAL_BACKEND = """
from mla_prefill_ext.backends.base import AutoSelectClaim
from mla_prefill_ext.backends.torch_sdpa import TorchSDPAPrefillBackend


class Rival(TorchSDPAPrefillBackend):
    auto_select_claim = AutoSelectClaim(("cpu", "7.x", "8.x", "9.x", "10.x", "12.x"))

    @staticmethod
    def get_name():
        return "{name}"
"""
# Package names in the other order than backend names: the tie goes by backend name.
RIVALS = {"aaa-rival": "RIVAL_ZED", "zzz-rival": "RIVAL_ALPHA"}


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory for PYTHONPATH: the import simulation and two user backend modules."""
    root = tmp_path_factory.mktemp("cli_harness")
    (root / "sitecustomize.py").write_text(SITECUSTOMIZE)
    (root / "readme_backend.py").write_text(README_BACKEND)
    (root / "broken_backend.py").write_text(BROKEN_BACKEND)
    # An installed backend package whose entry point is malformed (on PYTHONPATH only where asked).
    dist_info = root / "packages" / "demo_backends-0.1.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: demo-backends\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text("[mla_prefill_ext.backends]\nDEMO_BAD = nodots\n")
    # An installed backend package that claims a place in automatic selection on a CPU.
    claim_site = root / "claim_packages"
    dist_info = claim_site / "demo_claim-0.1.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: demo-claim\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text(
        "[mla_prefill_ext.backends]\nDEMO_CLAIM = demo_claim_backend:DemoClaimBackend\n"
    )
    (claim_site / "demo_claim_backend.py").write_text(CLAIM_BACKEND)
    for dist, name in RIVALS.items():
        module = f"{dist.replace('-', '_')}_backend"
        dist_info = root / "rival_packages" / f"{dist.replace('-', '_')}-0.1.dist-info"
        dist_info.mkdir(parents=True)
        (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
        (dist_info / "entry_points.txt").write_text(f"[mla_prefill_ext.backends]\n{name} = {module}:Rival\n")
        (root / "rival_packages" / f"{module}.py").write_text(RIVAL_BACKEND.replace("{name}", name))
    return root


def cli_env(harness: Path | None = None, **extra: str) -> dict[str, str]:
    """This environment without the add-on's settings (and any from other tests), plus ``extra``.

    Python may write bytecode there (an empty PYTHONDONTWRITEBYTECODE counts as unset): whether
    ``info`` notes modules compiled from source in every process depends on the machine, not on
    what these runs test; that note has its own test.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLA_PREFILL", "MLA_TEST_"))}
    env["PYTHONDONTWRITEBYTECODE"] = ""
    if harness is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(harness), *filter(None, [env.get("PYTHONPATH")])])
    return {**env, **extra}


def start(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )


def finish(proc: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return finish(start(["-m", "mla_prefill_ext", *args], env))


def cuda_here() -> bool:
    import torch

    return torch.cuda.is_available()


def assert_no_traceback(proc: subprocess.CompletedProcess[str]) -> None:
    both = proc.stdout + proc.stderr
    assert "Traceback" not in both, both[-4000:]


# The runs that import vLLM, started together on first use (in parallel: ~5-10 s each).
SLOW_RUNS: dict[str, tuple[list[str], dict[str, str]]] = {
    # A user with several problems at once (info imports vLLM's MLA module: the costly runs).
    "info_unsupported_vllm": (
        ["info"],
        {
            "MLA_TEST_VLLM_VERSION": "0.21.0",
            "MLA_PREFILL_BACKEND": "FLASH_ATTN",
            "MLA_PREFILL_BACKEND_OVERRIDES": '{"CUSTOM": oops',
        },
    ),
    "info_bad_settings": (
        ["info", "--json"],
        {
            "MLA_PREFILL_BACKEND": "nonsense",
            "MLA_PREFILL_BACKEND_OVERRIDES": json.dumps(
                {"CUSTOM": "readme_backend.MyPrefill", "MINE": "Foo", "1BAD": "a.B", "OTHER": 3}
            ),
        },
    ),
    "select_abstract": (
        ["select", "--backend", "custom"],
        {"MLA_PREFILL_BACKEND_OVERRIDES": '{"CUSTOM": "readme_backend.MyPrefill"}'},
    ),
    "check_abstract": (
        ["check", "--backend", "CUSTOM", "--repeat", "1"],
        {"MLA_PREFILL_BACKEND_OVERRIDES": '{"CUSTOM": "readme_backend.MyPrefill"}'},
    ),
    "check_unknown_backend": (["check", "--backend", "nope", "--json"], {}),
    # The add-on switched off: select and check still answer, and say so.
    "select_disabled_json": (["select", "--json"], {"MLA_PREFILL_EXT_DISABLE": "1"}),
    "check_disabled": (["check", "--repeat", "1"], {"MLA_PREFILL_EXT_DISABLE": "1"}),
    "check_broken": (
        ["check", "--backend", "BROKEN", "--repeat", "1", "--json"],
        {"MLA_PREFILL_BACKEND_OVERRIDES": '{"BROKEN": "broken_backend.Broken"}'},
    ),
    # The conformance suite (a few seconds per dtype on a CPU: one run takes every dtype).
    "conformance_sdpa": (["check", "--backend", "TORCH_SDPA", "--conformance"], {}),
    "conformance_mutant": (
        ["check", "--backend", "custom", "--conformance", "--dtype", "bfloat16"],
        {"MLA_PREFILL_BACKEND_OVERRIDES": '{"CUSTOM": "conformance_mutants.Base2LSE"}'},
    ),
    "conformance_claim_json": (["check", "--conformance", "--dtype", "bfloat16", "--json"], {}),
    # An installed backend package that claims a place in automatic selection here.
    "info_claim": (["info"], {}),
    "select_claim": (["select"], {}),
    "select_claim_json": (["select", "--capability", "cpu", "--json"], {}),
    # Two installed packages claiming the same place.
    "info_rivals_json": (["info", "--json"], {}),
    "select_rivals": (["select", "--capability", "cpu"], {}),
}
# Extra PYTHONPATH entries per run: installed packages (in the harness), the mutants (tests/).
SLOW_RUN_PATHS: dict[str, list[str]] = {
    "info_bad_settings": ["packages", "claim_packages"],  # this user also installed packages
    "conformance_mutant": [str(ROOT / "tests")],
    "conformance_claim_json": ["claim_packages"],
    "info_claim": ["claim_packages"],
    "select_claim": ["claim_packages"],
    "select_claim_json": ["claim_packages"],
    "info_rivals_json": ["rival_packages"],
    "select_rivals": ["rival_packages"],
}


@pytest.fixture(scope="module")
def slow(harness: Path) -> Iterator[dict[str, Any]]:
    procs = {}
    for name, (args, extra) in SLOW_RUNS.items():
        env = cli_env(harness, **extra)
        paths = [str(harness / p) for p in SLOW_RUN_PATHS.get(name, [])]
        env["PYTHONPATH"] = os.pathsep.join([*paths, env["PYTHONPATH"]])
        procs[name] = start(["-m", "mla_prefill_ext", *args], env)
    results: dict[str, subprocess.CompletedProcess[str]] = {}

    class Results(dict):
        def __missing__(self, name: str) -> subprocess.CompletedProcess[str]:
            results[name] = finish(procs[name])
            return results[name]

    try:
        yield Results()
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


# The command line itself (no vLLM needed: these are fast)


def test_version() -> None:
    proc = run("--version", env=cli_env())
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"mla-prefill-ext {__version__} (an add-on for {SUPPORTED})"


def test_every_flag_has_help_and_the_product_is_the_add_on() -> None:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.choices and isinstance(a.choices, dict)).choices
    assert set(subparsers) == {"info", "select", "check", "bench"}
    for name, sub in subparsers.items():
        for action in sub._actions:
            assert action.help, f"{name} {action.option_strings} has no help"
        assert "shim" not in sub.format_help().lower()
    assert "shim" not in parser.format_help().lower()
    proc = run("check", "--help", env=cli_env())
    assert proc.returncode == 0
    for flag in ("--backend", "--conformance", "--device", "--dtype", "--repeat", "--seed", "--json"):
        assert flag in proc.stdout
    assert "timed runs after one warm-up run" in proc.stdout


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["check", "--repeat", "0"], "argument --repeat: expected a whole number of at least 1, got '0'"),
        (["check", "--repeat", "many"], "argument --repeat"),
        (["check", "--seed", "-1"], "argument --seed"),
        (["check", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
        (["check", "--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
        (["check", "--conformance", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
        (["check", "--conformance", "--seed", "x"], "argument --seed"),
        (["select", "--capability", "99.9"], "argument --capability: expected a CUDA compute capability"),
        (["select", "--capability", "9"], "argument --capability"),
        (["select", "--capability", "0.5"], "argument --capability"),
        (["select", "--dims", "0,0,0"], "argument --dims: expected 'r1' or three positive head dims"),
        (["select", "--dims", "128,64"], "argument --dims"),
        (["info", "--verbose"], "unrecognized arguments: --verbose"),
        ([], "the following arguments are required"),
    ],
)
def test_bad_flags_print_the_usage_line_and_exit_2(args: list[str], says: str) -> None:
    proc = run(*args, env=cli_env())
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("usage: mla-prefill-ext"), proc.stderr
    assert says in proc.stderr
    assert_no_traceback(proc)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["select", "--capability", "99.9", "--json"], "argument --capability: expected a CUDA"),
        (["select", "--json", "--dims", "1,2"], "argument --dims: expected 'r1'"),
        (["info", "--json", "--verbose"], "unrecognized arguments: --verbose"),
        (["check", "--json", "--repeat", "0"], "argument --repeat: expected a whole number of at least 1"),
    ],
)
def test_with_json_a_usage_error_is_json_on_stdout(args: list[str], says: str) -> None:
    """Scripts parse stdout: a usage error there is JSON too (and the usage line stays on stderr)."""
    proc = run(*args, env=cli_env())
    assert proc.returncode == 2, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["error"].startswith(says) and report["exit_code"] == 2
    # The usage line argparse prints on stderr (the subcommand's, or the program's where it gives that).
    assert report["usage"].startswith("usage: mla-prefill-ext") and proc.stderr.startswith(report["usage"])
    assert says in proc.stderr
    assert_no_traceback(proc)


def test_check_on_cuda_without_a_gpu_is_a_usage_error() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    proc = run("check", "--device", "cuda", env=cli_env())
    assert proc.returncode == 2
    assert proc.stderr.startswith("usage: mla-prefill-ext check")
    assert "argument --device: cuda was asked for, but PyTorch sees no CUDA GPU here" in proc.stderr
    assert_no_traceback(proc)


# Without vLLM or PyTorch (simulated: see the module docstring)


@pytest.mark.parametrize("hidden", ["vllm,torch", "vllm"])
def test_every_command_without_vllm_says_what_is_missing(harness: Path, hidden: str) -> None:
    env = cli_env(harness, MLA_TEST_HIDE=hidden)
    info = run("info", env=env)
    assert info.returncode == 2, info.stdout + info.stderr
    assert_no_traceback(info)
    assert "vLLM: not installed" in info.stdout
    assert f"vLLM is not installed: this add-on needs {SUPPORTED}." in info.stdout
    assert ("PyTorch is not installed" in info.stdout) == ("torch" in hidden)
    assert info.stdout.rstrip().splitlines()[-1].startswith("verdict: cannot check: install a supported vLLM")

    if hidden == "vllm,torch":  # each run with PyTorch present pays for importing it: keep those few
        report = json.loads(run("info", "--json", env=env).stdout)
        assert report["verdict"] == "cannot check" and report["exit_code"] == 2
        assert report["vllm_version"] is None and report["supported_range"] == SUPPORTED
        assert any("vLLM is not installed" in f["message"] for f in report["findings"])

    for command in ("select", "check") if hidden == "vllm,torch" else ("check",):
        proc = run(command, env=env)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert_no_traceback(proc)
        assert f"mla-prefill-ext {command} cannot run here:" in proc.stdout
        assert f"vLLM is not installed: this add-on needs {SUPPORTED}." in proc.stdout


def test_importing_the_package_without_vllm(harness: Path) -> None:
    code = textwrap.dedent(
        """
        import sys
        import mla_prefill_ext
        print("imported", "vllm" in sys.modules, "torch" in sys.modules)
        print("dir", "register_mla_prefill_backend" in dir(mla_prefill_ext))
        for name in ("MLAPrefillBackend", "register_mla_prefill_backend"):
            try:
                getattr(mla_prefill_ext, name)
                print(name, "ok")
            except ModuleNotFoundError as e:
                print(name, "missing", e.name, "|", e)
        """
    )
    lines = {}
    for hidden in ("vllm", "vllm,torch"):
        proc = finish(start(["-c", code], cli_env(harness, MLA_TEST_HIDE=hidden)))
        assert proc.returncode == 0, proc.stderr[-4000:]
        lines[hidden] = proc.stdout.splitlines()
    for out in lines.values():
        assert out[:2] == ["imported False False", "dir True"]
    # PyTorch present: the base class is all a backend author needs, and it loads.
    assert lines["vllm"][2] == "MLAPrefillBackend ok"
    assert lines["vllm"][3].startswith("register_mla_prefill_backend missing vllm |")
    # Neither: each name says what is missing and which vLLM to install.
    assert lines["vllm,torch"][2].startswith("MLAPrefillBackend missing torch | mla_prefill_ext.")
    for line in (lines["vllm"][3], lines["vllm,torch"][2]):
        assert f"pip install '{INSTALL_SPEC}'" in line
        assert "mla-prefill-ext info" in line


def test_backend_table_script_without_vllm_says_which_python_to_use(harness: Path) -> None:
    proc = finish(
        start(
            [str(ROOT / "scripts" / "backend_table.py"), "--check"],
            cli_env(harness, MLA_TEST_HIDE="vllm,torch"),
        )
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert_no_traceback(proc)
    assert "needs vLLM and PyTorch" in proc.stderr
    assert ".venv/bin/python scripts/backend_table.py --write" in proc.stderr


# info: the doctor


@pytest.mark.vllm_patch  # info's report of the patch
def test_info_on_an_unsupported_vllm_reports_the_refusal(slow: dict[str, Any]) -> None:
    proc = slow["info_unsupported_vllm"]
    assert proc.returncode == 1, proc.stdout + proc.stderr[-4000:]
    assert_no_traceback(proc)
    out = proc.stdout
    assert f"vLLM 0.21.0: NOT supported, mode: none (supported: {SUPPORTED})" in out
    assert "add-on: not active (see the findings)" in out
    assert "backend choice: FLASH_ATTN (from MLA_PREFILL_BACKEND)" in out
    findings = [line for line in out.splitlines() if line.startswith("  PROBLEM  ") and "." in line]
    assert any(f.startswith("  PROBLEM  vLLM 0.21.0 is not supported") for f in findings)
    assert any(
        f.startswith("  PROBLEM  mla-prefill-ext cannot honour MLA_PREFILL_BACKEND=FLASH_ATTN")
        for f in findings
    )
    assert any(f.startswith("  PROBLEM  MLA_PREFILL_BACKEND_OVERRIDES is not valid JSON") for f in findings)
    assert all(f.endswith(".") for f in findings)  # findings are sentences
    verdict = out.rstrip().splitlines()[-1]
    assert verdict.startswith("verdict: ") and verdict.endswith(" problems found (see the findings).")
    assert "shim" not in out.lower()
    assert "(wrapped)" not in out  # targets say what the add-on does with them: "wraps" or "reads"
    assert "  ok       wraps  MLAAttention.__init__" in out


@pytest.mark.vllm_patch  # info's report of the patch
def test_info_reports_bad_settings_and_tries_every_registration(slow: dict[str, Any]) -> None:
    proc = slow["info_bad_settings"]
    assert proc.returncode == 1, proc.stdout + proc.stderr[-4000:]
    assert_no_traceback(proc)
    report = json.loads(proc.stdout)
    assert report["verdict"] == "problem" and report["exit_code"] == 1
    assert report["vllm_supported"] and report["patched"]
    assert report["choice"]["requested"] == "nonsense" and report["choice"]["source"] == "MLA_PREFILL_BACKEND"
    backends = {b["name"]: b for b in report["backends"]}
    assert backends["TORCH_SDPA"]["loads"] is True
    assert backends["CUSTOM"]["loads"] is False
    assert (
        "does not implement get_name, run_prefill_context_chunk, run_prefill_new_tokens"
        in (backends["CUSTOM"]["error"])
    )
    # Registrations in this process come from the environment variable, not from a call.
    assert backends["CUSTOM"]["kind"] == "registered in MLA_PREFILL_BACKEND_OVERRIDES"
    assert backends["MINE"]["loads"] is False
    assert "'Foo' is not of the form 'package.module.ClassName'" in backends["MINE"]["error"]
    messages = [f["message"] for f in report["findings"]]
    assert messages[0].startswith("MLA_PREFILL_BACKEND is set to 'nonsense', which is not a backend name;")
    assert any("entry '1BAD' is ignored" in m for m in messages)
    assert any("entry 'OTHER' is ignored: its class path must be a string" in m for m in messages)
    packages = {p["name"]: p for p in report["backend_packages"]}
    assert set(packages) == {"DEMO_BAD", "DEMO_CLAIM"}
    assert packages["DEMO_BAD"]["distribution"] == "demo-backends" and packages["DEMO_BAD"]["problem"]
    assert packages["DEMO_CLAIM"]["problem"] is None
    # Each backend's claim on automatic selection, and whether it applies on this device.
    assert backends["DEMO_CLAIM"]["class_path"] == CLAIM_CLASS and backends["DEMO_CLAIM"]["loads"]
    assert backends["DEMO_CLAIM"]["claim"] == {
        "capabilities": ["cpu"],
        "before": "FLASH_ATTN",
        "applies_here": not cuda_here(),
        "ignored": None,
        "error": None,
    }
    assert backends["TORCH_SDPA"]["claim"] is None
    # Where the add-on takes over vLLM's MLA prefill: CUDA, CPU and no platform.
    assert report["platform"]["served"] is True and report["platform"]["reason"] is None
    assert report["platform"]["name"] in ("CUDA", "CPU", "none")
    assert any(
        m.startswith("The mla_prefill_ext.backends entry point DEMO_BAD = 'nodots' of package demo-backends")
        for m in messages
    )
    assert len(messages) == 6
    assert all(m.endswith(".") for m in messages)


# select and check


def test_select_says_valid_only_for_a_backend_that_can_be_built(slow: dict[str, Any]) -> None:
    proc = slow["select_abstract"]
    assert proc.returncode == 1, proc.stdout + proc.stderr[-4000:]
    assert_no_traceback(proc)
    custom = next(line for line in proc.stdout.splitlines() if line.strip().startswith("CUSTOM"))
    assert "invalid: " in custom and "cannot be instantiated: it does not implement" in custom
    assert "selected: none" in proc.stdout


def test_check_never_crashes_on_a_backend_that_cannot_run(slow: dict[str, Any]) -> None:
    proc = slow["check_abstract"]
    assert proc.returncode == 1, proc.stdout + proc.stderr[-4000:]
    assert_no_traceback(proc)
    assert proc.stdout.startswith(
        "FAIL: MLA prefill backend CUSTOM (from --backend) cannot be loaded: 'readme_backend.MyPrefill' "
        "cannot be instantiated: it does not implement get_name, run_prefill_context_chunk, "
        "run_prefill_new_tokens"
    )

    proc = slow["check_unknown_backend"]  # with --json: the usage error is JSON on stdout too
    assert proc.returncode == 2, proc.stdout + proc.stderr[-4000:]
    assert_no_traceback(proc)
    assert "usage: mla-prefill-ext check" in proc.stderr
    message = "argument --backend: Unknown MLA prefill backend: 'nope'. Valid options are: FLASH_ATTN"
    assert message in proc.stderr
    report = json.loads(proc.stdout)
    assert report["error"].startswith(message) and report["exit_code"] == 2
    assert report["usage"].startswith("usage: mla-prefill-ext check")

    proc = slow["check_broken"]
    assert proc.returncode == 1, proc.stdout + proc.stderr[-4000:]
    assert_no_traceback(proc)
    report = json.loads(proc.stdout)
    assert report["ok"] is False and report["backend"] == "BROKEN"
    assert report["dtype"] == "bfloat16"  # the plain check's default (--conformance: every dtype)
    assert report["error"] == "backend BROKEN failed: RuntimeError: kernel exploded (at broken_backend.py:11)"


def test_select_and_check_say_when_the_add_on_is_off(slow: dict[str, Any]) -> None:
    note = (
        "note: the add-on is off (MLA_PREFILL_EXT_DISABLE is set): vLLM runs its stock MLA prefill in "
        "every process; "
    )
    proc = slow["select_disabled_json"]
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    assert report["disabled_by_env"] is True and report["selected"]
    proc = slow["check_disabled"]
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert_no_traceback(proc)
    lines = proc.stdout.splitlines()
    assert lines[0] == note + (
        "this check runs the backend directly; vLLM would not use it while the add-on is off."
    )
    assert lines[-1] == "PASS"


# check --conformance: the conformance suite (mla_prefill_ext.testing)


def property_lines(out: str) -> dict[str, str]:
    """``{property: PASS|FAIL|SKIP}`` from the report's properties section."""
    from mla_prefill_ext.testing import PROPERTIES

    found = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] in ("PASS", "FAIL", "SKIP") and parts[1] in PROPERTIES:
            found[parts[1]] = parts[0]
    return found


def test_check_conformance_reports_every_property(slow: dict[str, Any]) -> None:
    from mla_prefill_ext.testing import PROPERTIES

    proc = slow["conformance_sdpa"]
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert_no_traceback(proc)
    out = proc.stdout
    assert out.startswith(
        "backend under test: TORCH_SDPA (from --backend)\n"
        "MLA prefill conformance: TORCH_SDPA (mla_prefill_ext.backends.torch_sdpa.TorchSDPAPrefillBackend)\n"
    )
    # Every dtype by default: 3 dtypes x 2 MLA head dims x 2 head counts.
    assert "cases: 12 run, 0 skipped" in out
    for dtype in ("bfloat16", "float16", "float32"):
        assert f"  run   {dtype}, qk 128+64 v 128, 16 heads" in out
    assert property_lines(out) == dict.fromkeys(PROPERTIES, "PASS")
    assert "\nRESULT: PASS\n" in out


def test_check_conformance_json_on_the_backend_selected_here(slow: dict[str, Any]) -> None:
    """Without --backend: the backend the selector picks here (the installed one, by its claim)."""
    from mla_prefill_ext.testing import PROPERTIES

    proc = slow["conformance_claim_json"]
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert_no_traceback(proc)
    report = json.loads(proc.stdout)
    assert report["ok"] is True and report["mode"] == "conformance"
    expected = "DEMO_CLAIM" if not cuda_here() else report["backend"]
    assert report["backend"] == expected and report["source"] == "automatic"
    if not cuda_here():
        assert report["class"] == CLAIM_CLASS and report["get_name"] == "DEMO_CLAIM"
    assert report["dtypes"] == ["bfloat16"] and {c["dtype"] for c in report["cases"]} == {"bfloat16"}
    assert report["seed"] == 0 and report["failed_properties"] == []
    assert {p: v["status"] for p, v in report["properties"].items()} == dict.fromkeys(PROPERTIES, "pass")


def test_check_conformance_names_the_property_a_wrong_backend_fails(slow: dict[str, Any]) -> None:
    from conformance_mutants import Base2LSE

    proc = slow["conformance_mutant"]
    assert proc.returncode == 1, proc.stdout + proc.stderr[-4000:]
    assert_no_traceback(proc)
    out = proc.stdout
    assert out.startswith(
        "backend under test: CUSTOM (from --backend; its get_name() is MUTANT)\n"
        "MLA prefill conformance: MUTANT (conformance_mutants.Base2LSE)\n"
    )
    statuses = property_lines(out)
    assert statuses[Base2LSE.FAILS] == "FAIL"
    assert statuses["scale"] == statuses["causal"] == "PASS"  # one bug, reported under its own name
    result = next(line for line in out.splitlines() if line.startswith("RESULT: "))
    assert result.startswith("RESULT: FAIL (") and Base2LSE.FAILS in result


# Where the add-on serves, and out-of-tree backends' claims on automatic selection


@pytest.mark.vllm_patch  # info's report of the patch
def test_info_shows_the_platform_and_each_backends_claim(slow: dict[str, Any]) -> None:
    proc = slow["info_claim"]
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert_no_traceback(proc)
    lines = proc.stdout.splitlines()
    (platform_line,) = [line for line in lines if line.startswith("platform: ")]
    assert platform_line.endswith(": the add-on serves MLA prefill here"), platform_line
    if not cuda_here():
        assert platform_line in (
            "platform: CPU: the add-on serves MLA prefill here",
            "platform: none (vLLM detected no GPU platform): the add-on serves MLA prefill here",
        )
    where = "does not apply on this device" if cuda_here() else "applies on this device"
    assert (
        f"  ok       DEMO_CLAIM (entry point of package demo-claim): {CLAIM_CLASS}; "
        f"claim: cpu; before FLASH_ATTN ({where})"
    ) in lines
    assert (
        "  ok       TORCH_SDPA (built-in): mla_prefill_ext.backends.torch_sdpa.TorchSDPAPrefillBackend"
        in lines
    )
    if not cuda_here():
        assert any(
            line.endswith(": DEMO_CLAIM would serve (it joined automatic selection by its claim)")
            for line in lines
        )
    assert lines[-1] == "verdict: ok: the add-on is active and vLLM's MLA layer is patched."


def test_the_platform_line_says_where_vllms_own_prefill_stays() -> None:
    """ROCm, XPU and other platforms cannot be had here: the line info prints for each case."""
    from mla_prefill_ext.cli.runtime import platform_line as _platform_line

    served = {"name": "CUDA", "served": True, "reason": None, "error": None}
    assert _platform_line(served, True, False) == "platform: CUDA: the add-on serves MLA prefill here"
    assert _platform_line({**served, "name": "none"}, True, False) == (
        "platform: none (vLLM detected no GPU platform): the add-on serves MLA prefill here"
    )
    assert _platform_line(served, False, True) == (
        "platform: CUDA: the add-on would serve MLA prefill here (it is disabled)"
    )
    rocm = {
        "name": "ROCm",
        "served": False,
        "reason": "platform RocmPlatform has its own kernels",
        "error": None,
    }
    assert _platform_line(rocm, True, False) == (
        "platform: ROCm: vLLM's own MLA prefill stays (platform RocmPlatform has its own kernels); "
        "an explicit MLA_PREFILL_BACKEND is honoured if a backend can serve it"
    )
    broken = {"name": None, "served": None, "reason": None, "error": "RuntimeError: no platform"}
    assert _platform_line(broken, True, False) == "platform: unknown (see the findings)"


def test_select_marks_a_backend_that_joined_by_its_claim(slow: dict[str, Any]) -> None:
    report = json.loads(slow["select_claim_json"].stdout)  # --capability cpu: as on this machine
    assert report["automatic_order"] == ["DEMO_CLAIM", "TORCH_SDPA"]
    assert report["builtin_order"] == ["TORCH_SDPA"]
    assert report["claims"] == [
        {
            "name": "DEMO_CLAIM",
            "source": "entry point of package demo-claim",
            "capabilities": ["cpu"],
            "before": "FLASH_ATTN",
        }
    ]
    assert report["selected"] == "DEMO_CLAIM" and report["selected_by_claim"] is True
    assert {"name": "DEMO_CLAIM", "valid": True, "reasons": []} in report["candidates"]

    if cuda_here():
        pytest.skip("the human report below is for a machine without a GPU")
    proc = slow["select_claim"]
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert_no_traceback(proc)
    lines = proc.stdout.splitlines()
    assert "automatic order: DEMO_CLAIM (claim: cpu; before FLASH_ATTN) > TORCH_SDPA" in lines
    assert "requested: AUTO (automatic)" in lines
    assert "selected: DEMO_CLAIM (it joined automatic selection by its claim)" in lines
    assert "  DEMO_CLAIM     valid" in lines


def test_info_reports_packages_that_claim_the_same_place(slow: dict[str, Any]) -> None:
    """Two installed packages claim the same place: info names both, which comes first and why."""
    proc = slow["info_rivals_json"]
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert_no_traceback(proc)
    report = json.loads(proc.stdout)
    place = "FLASH_ATTN" if cuda_here() else "TORCH_SDPA"  # FLASH_ATTN is in every GPU's list
    assert report["competing_claims"] == [{"before": place, "order": ["RIVAL_ALPHA", "RIVAL_ZED"]}]
    if report["mode"] == "bridge":  # vLLM 0.23+: vLLM's own automatic selection decides (the bridge's lines)
        assert report["choice"]["vllm_decides"] and report["bridge"]["instrumented"]
    else:
        assert report["choice"]["selected_here"] == "RIVAL_ALPHA" and report["choice"]["selected_by_claim"]
    notes = [f["message"] for f in report["findings"] if f["level"] == "note"]
    assert (
        "RIVAL_ALPHA (entry point of package zzz-rival) and RIVAL_ZED (entry point of package "
        f"aaa-rival) claim the same place in automatic selection on this device, before {place}; "
        "claims at one place are tried in the alphabetical order of the backends' names: RIVAL_ALPHA "
        "comes first and serves every model it accepts, RIVAL_ZED serves only models RIVAL_ALPHA refuses."
    ) in notes
    assert report["verdict"] == "ok"  # two packages may claim one place: a note, not a problem

    lines = slow["select_rivals"].stdout.splitlines()
    assert lines[1:3] == [
        "automatic order: RIVAL_ALPHA (claim: cpu, 7.x, 8.x, 9.x, 10.x, 12.x; before FLASH_ATTN) > "
        "RIVAL_ZED (claim: cpu, 7.x, 8.x, 9.x, 10.x, 12.x; before FLASH_ATTN) > TORCH_SDPA",
        "note: RIVAL_ALPHA (entry point of package zzz-rival) and RIVAL_ZED (entry point of package "
        "aaa-rival) claim the same place in automatic selection without a GPU, before TORCH_SDPA; "
        "claims at one place are tried in the alphabetical order of the backends' names: RIVAL_ALPHA "
        "comes first and serves every model it accepts, RIVAL_ZED serves only models RIVAL_ALPHA refuses.",
    ]


def test_info_notes_modules_compiled_from_source_in_every_process(tmp_path: Path) -> None:
    import compileall

    from mla_prefill_ext.cli.runtime import bytecode_findings as _bytecode_findings

    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("X = 1\n")
    (pkg / "mod.py").write_text("Y = 2\n")
    # Python may write bytecode: the first import does, nothing to say.
    assert _bytecode_findings({"pkg": str(pkg)}, can_write=True) == []
    # It may not, and there is none: every process compiles these modules.
    (note,) = _bytecode_findings({"pkg": str(pkg)}, can_write=False)
    assert note.level == "note" and "pkg has modules without bytecode" in note.message
    assert note.message.endswith(f"-m compileall -q {pkg}")
    # Compiled once (as pip does unless --no-compile): nothing to say.
    assert compileall.compile_dir(str(pkg), quiet=1)
    assert _bytecode_findings({"pkg": str(pkg)}, can_write=False) == []
    (pkg / "late.py").write_text("Z = 3\n")  # one module left without bytecode is enough
    assert len(_bytecode_findings({"pkg": str(pkg)}, can_write=False)) == 1
    # The command names every folder, as the README's does: the add-on's and wrapt's.
    other = tmp_path / "other"
    other.mkdir()
    (other / "__init__.py").write_text("W = 4\n")
    assert compileall.compile_dir(str(other), quiet=1)
    (note,) = _bytecode_findings({"pkg": str(pkg), "other": str(other)}, can_write=False)
    assert "pkg has modules without bytecode" in note.message
    assert note.message.endswith(f"-m compileall -q {pkg} {other}")
    (other / "late.py").write_text("V = 5\n")
    (note,) = _bytecode_findings({"pkg": str(pkg), "other": str(other)}, can_write=False)
    assert "pkg and other have modules without bytecode" in note.message
