"""The benchmark scripts run (smoke-sized CPU cases, on any machine; the numbers come from the GPU host)."""

from __future__ import annotations

import ast
import gzip
import importlib
import importlib.metadata
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.bench import MEASUREMENTS

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "scripts" / "bench"
SCRIPTS = sorted(MEASUREMENTS)

# The scripts time the patch's hooks on vLLM 0.20 objects and record vLLM 0.20.2 (skipped where the
# add-on bridges a later vLLM).
pytestmark = pytest.mark.vllm_patch


def run_bench(script: str, *args: str, expect_rc: int = 0) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.bench", script, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == expect_rc, proc.stderr[-3000:]
    return proc


def load_script(name: str):
    """A measurement of the scripts.bench package, as a module."""
    return importlib.import_module(f"scripts.bench.{name}")


def test_the_scripts_are_found():
    assert {"kernel", "engine", "shared_prefix_engine", "serving", "first_request"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_help_says_what_it_measures(script: str):
    source = (BENCH / f"{script}.py").read_text()
    docstring = source.split('"""')[1]
    proc = run_bench(script, "--help")
    assert docstring.splitlines()[0] in proc.stdout  # the job, in one line
    assert f"python -m scripts.bench {script}" in proc.stdout  # how to run it
    assert "--json" in proc.stdout


def test_kernel_bench_runs_on_cpu(tmp_path):
    out = tmp_path / "bench.json"
    run_bench("kernel", "--device", "cpu", "--rounds", "3", "--json", str(out))
    data = json.loads(out.read_text())
    assert data["environment"]["vllm"] == importlib.metadata.version("vllm")
    ops = {(r["backend"], r["op"]) for r in data["kernel"]}
    assert ops == {("TORCH_SDPA", "new_tokens"), ("TORCH_SDPA", "context_chunk")}
    for row in data["kernel"]:
        # The figure is the median of the rounds it records, one time per round, each per call.
        assert len(row["backend_rounds_ms"]) == 3 and 1 <= row["launches_per_round"] <= 200
        assert row["backend_ms"] == statistics.median(row["backend_rounds_ms"])
        assert row["backend_tflops"] > 0 and "bare_ms" not in row  # TORCH_SDPA has no bare kernel
    assert {s["automatic"] for s in data["selection"]} == {"TORCH_SDPA"}


def test_kernel_bench_times_only_the_backends_asked_for(tmp_path):
    out = tmp_path / "bench.json"
    run_bench("kernel", "--device", "cpu", "--rounds", "1", "--backends", "FLASH_ATTN", "--json", str(out))
    assert json.loads(out.read_text())["kernel"] == []  # FLASH_ATTN cannot run on the CPU
    proc = run_bench("kernel", "--backends", "FLASH_ATN", expect_rc=1)
    assert "unknown backend(s) ['FLASH_ATN']" in proc.stderr


def test_kernel_report_rebuilds_the_recorded_h200_tables(tmp_path):
    """The recorded run's kernel tables (in its README) come from its log via kernel_report.py."""
    recorded = ROOT / "docs" / "results" / "h200-2026-11-29"
    out, md = tmp_path / "kernel.json", tmp_path / "tables.md"
    log = str(recorded / "bench-kernel.log.gz")  # stored gzipped (docs/results/README.md)
    run_bench("kernel_report", "--kernel-log", log, "--json", str(out), "--markdown", str(md))
    rebuilt = json.loads(out.read_text())
    committed = json.loads(gzip.decompress((recorded / "bench-kernel.json.gz").read_bytes()))
    assert rebuilt["kernel"] == committed["kernel"]
    assert rebuilt["selection"] == committed["selection"]
    assert "| new_tokens | 128,64,128 | 16 | 1x4096 | 645 / 629 (1.025)" in md.read_text()
    assert (
        "| new_tokens | 128,64,128 | 16 | 1x4096 | 645 / 629 (1.025)" in (recorded / "README.md").read_text()
    )


def test_engine_bench_tables_ab_ratios_from_the_raw_seconds():
    bench = load_script("engine")
    grid = bench.parse_grid("1024x2,4096x1")
    sides = ["stock", "FLASHINFER", "FLASHINFER@prev"]
    seconds = {
        "stock": {"1024x2": [1.0, 2.0, 1.0], "4096x1": [1.0, 1.0, 1.0]},
        "FLASHINFER": {"1024x2": [1.25, 2.5, 1.25], "4096x1": [2.0, 2.0, 2.0]},
        "FLASHINFER@prev": {"1024x2": [1.0, 2.0, 1.0], "4096x1": [1.0, 1.0, 1.0]},
    }
    pairs = [("FLASHINFER", "stock"), ("FLASHINFER", "FLASHINFER@prev"), ("FLASH_ATTN", "stock")]
    table, summary = bench.tabulate(seconds, grid, sides, pairs)
    first = table[0]
    assert first["stock"]["median"] == 2048 / 1.0 and first["stock"]["min"] == 2048 / 2.0
    assert first["FLASHINFER/stock"] == 0.8 and first["FLASHINFER/stock paired"] == 0.8
    assert table[1]["FLASHINFER/FLASHINFER@prev"] == 0.5
    assert "FLASH_ATTN/stock" not in first  # a side that did not run has no ratio
    assert summary["FLASHINFER/stock"] == {"median_of_points": 0.65, "min": 0.5, "max": 0.8}
    lines = bench.markdown(table, sides)
    assert lines[2].startswith("| 1024x2 | 2k (1-2k) |") and "FLASHINFER/stock 0.800; 0.800" in lines[2]


def test_the_measurements_are_one_package():
    """Every measurement is listed (python -m scripts.bench NAME), and the modules import each other
    through the package, never by a bare name found on a sys.path entry."""
    modules = {path.stem for path in BENCH.glob("*.py")}
    runnable = {path.stem for path in BENCH.glob("*.py") if "\ndef main(" in path.read_text()}
    assert runnable - {"__main__"} == set(MEASUREMENTS)
    by_bare_name = {}
    for path in BENCH.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            if hits := [name for name in names if name.split(".")[0] in modules]:
                by_bare_name.setdefault(path.name, []).extend(hits)
    assert not by_bare_name, by_bare_name
