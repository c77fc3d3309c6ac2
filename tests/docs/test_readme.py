"""The README's generated parts stay true."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from cpu_log_lines import CPU_LOG_LINES

ROOT = Path(__file__).resolve().parents[2]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_backend_table_is_current():
    script = load_script("backend_table")
    assert script.readme_copy((ROOT / "README.md").read_text()) == script.table(), (
        "README.md's backend table is stale: run .venv/bin/python scripts/backend_table.py --write"
    )


def test_readme_quick_start_commands_exist():
    text = (ROOT / "README.md").read_text()
    assert "bash scripts/setup.sh && .venv/bin/mla-prefill-ext check" in text
    command = ".venv/bin/python -m pytest -q -n 2 --dist loadfile"
    assert command in text
    # CI runs that very command (vLLM 0.20.2, in .venv), then the rest of the matrix.
    ci = (ROOT / ".ci" / "run").read_text()
    assert command in ci and ".venv/bin/python -m nox -t bridged" in ci
    assert (
        '"-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadfile"'
        in (ROOT / "noxfile.py").read_text()
    )
    assert ".venv/bin/python -m nox" in text


@pytest.mark.vllm_patch  # the quick start's environment (scripts/setup.sh: vLLM 0.20.2)
def test_check_command_passes_on_this_machine():
    """The README's main job: one prefill through the selected backend against float64."""
    import torch

    proc = subprocess.run(
        [sys.executable, "-m", "mla_prefill_ext", "check", "--json", "--repeat", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert '"ok": true' in proc.stdout
    if not torch.cuda.is_available():
        readme = " ".join((ROOT / "README.md").read_text().split())
        assert all(" ".join(line.split()) in readme for line in CPU_LOG_LINES)
        for line in filter(str.strip, proc.stderr.splitlines()):
            assert any(known in line for known in CPU_LOG_LINES), f"the README does not explain: {line}"


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run(
        [sys.executable, "-m", "mla_prefill_ext", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.vllm_patch  # the quick start's environment (scripts/setup.sh: vLLM 0.20.2)
def test_info_reports_patch_and_backends():
    import json

    # Bytecode may be written here (an empty PYTHONDONTWRITEBYTECODE is unset): no note about it.
    proc = run_cli("info", "--json", env={"PYTHONDONTWRITEBYTECODE": ""})
    assert proc.returncode == 0, proc.stderr[-2000:]
    info = json.loads(proc.stdout)
    assert info["vllm_version"] == "0.20.2" and info["vllm_supported"] and info["patched"]
    assert info["verdict"] == "ok" and info["exit_code"] == 0 and info["findings"] == []
    assert all(t["problem"] is None for t in info["targets"])
    names = {b["name"]: b for b in info["backends"]}
    assert names["CUSTOM"]["class_path"] is None
    assert names["FLASH_ATTN"]["class_path"].endswith("FlashAttnPrefillBackend")


@pytest.mark.usefixtures("flash_attn_kernels")
def test_select_explains_every_candidate():
    import json

    proc = run_cli("select", "--capability", "9.0", "--dims", "64,32,64", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    sel = json.loads(proc.stdout)
    assert sel["selected"] == "FLASH_ATTN" and sel["automatic_order"][-1] == "TORCH_SDPA"
    reasons = {c["name"]: c["reasons"] for c in sel["candidates"]}
    assert any("DeepSeek-R1" in r for r in reasons["FLASHINFER"])
    assert any("9.0 not supported" in r for r in reasons["TRTLLM_RAGGED"])
    bad = run_cli("select", "--capability", "9.0", "--backend", "trtllm_ragged")
    assert bad.returncode == 1 and "cannot serve" in bad.stdout


def test_readme_custom_backend_example_runs(tmp_path):
    """The README's runnable example: the counting CUSTOM backend through `check`."""
    calls = tmp_path / "calls.txt"
    proc = run_cli(
        "check",
        "--backend",
        "CUSTOM",
        "--repeat",
        "1",
        env={
            "PYTHONPATH": str(ROOT / "examples"),
            "MLA_PREFILL_COUNT_FILE": str(calls),
            "MLA_PREFILL_BACKEND_OVERRIDES": '{"CUSTOM": "counting_backend.CountingPrefillBackend"}',
        },
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert "backend: CUSTOM (counting_backend.CountingPrefillBackend" in proc.stdout
    kinds = [line.split(" ", 1)[1] for line in calls.read_text().splitlines()]
    assert kinds.count("new_tokens") == 2  # warm-up + one timed run
    assert kinds.count("context_chunk 0") == 2 and kinds.count("context_chunk 1") == 2


def test_readme_check_synopsis_names_every_option():
    """The Diagnostics section's `check [...]` line shows each option `check --help` has."""
    import re

    proc = run_cli("check", "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    options = set(re.findall(r"\[(--[a-z-]+)", proc.stdout.split("\n\n", 1)[0]))  # the usage lines
    assert {"--backend", "--conformance", "--dtype"} <= options
    readme = " ".join((ROOT / "README.md").read_text().split())
    synopsis = readme.split("- `check [", 1)[1].split("`:", 1)[0]
    # --json and --debug are every command's, stated once for all.
    assert sorted(o for o in options - {"--json", "--debug"} if o not in synopsis) == []
    assert "class path" in readme.split("- `check [", 1)[1].split("## ", 1)[0]


def test_the_counting_backend_counts_one_run_at_a_time(tmp_path, monkeypatch):
    """A run's first call empties the count file, unless the run that wrote it is still going."""
    import os

    example = ROOT / "examples" / "counting_backend.py"
    spec = importlib.util.spec_from_file_location("counting_backend", example)
    counting = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(counting)
    calls = tmp_path / "calls.txt"
    monkeypatch.setenv(counting.COUNT_FILE_ENV, str(calls))
    dims = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    backend = counting.CountingPrefillBackend(num_heads=2, scale=0.1, vllm_config=None, **dims)

    earlier = subprocess.Popen(["true"])  # a process of an earlier run, finished
    earlier.wait()
    calls.write_text(f"{earlier.pid} new_tokens\n" * 3)
    backend._record("new_tokens")
    assert calls.read_text() == f"{os.getpid()} new_tokens\n"

    other = subprocess.Popen(["sleep", "60"])  # another process of this run, still running
    try:
        calls.write_text(f"{other.pid} new_tokens\n")
        counting._JOINED.clear()  # as in a new process
        backend._record("context_chunk 0")
        backend._record("context_chunk 1")
    finally:
        other.kill()
        other.wait()
    assert calls.read_text().splitlines() == [
        f"{other.pid} new_tokens",
        f"{os.getpid()} context_chunk 0",
        f"{os.getpid()} context_chunk 1",
    ]
