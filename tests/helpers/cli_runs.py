"""The command line as a user runs it (tests/cli/): in a subprocess, judged by its output and exit code.

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

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from mla_prefill_ext.versions import SUPPORTED_TEXT

ROOT = Path(__file__).resolve().parents[2]
HELPERS = ROOT / "tests" / "helpers"
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


def write_harness(root: Path) -> Path:
    """A directory for PYTHONPATH: the import simulation and two user backend modules."""
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


# The runs that import vLLM, started together on first use (in parallel: ~5-10 s each). Each test
# module names its own (SLOW_RUNS: name -> (arguments, environment); SLOW_RUN_PATHS: name -> extra
# PYTHONPATH entries, relative to the harness).
def start_runs(
    runs: dict[str, tuple[list[str], dict[str, str]]], paths: dict[str, list[str]], harness: Path
) -> Iterator[dict[str, subprocess.CompletedProcess[str]]]:
    """Starts every run now; a test's first look at one waits for it. Kills what is left at the end."""
    procs = {}
    for name, (args, extra) in runs.items():
        env = cli_env(harness, **extra)
        extra_paths = [str(harness / p) for p in paths.get(name, [])]
        env["PYTHONPATH"] = os.pathsep.join([*extra_paths, env["PYTHONPATH"]])
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
