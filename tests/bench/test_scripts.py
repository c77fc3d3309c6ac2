"""The benchmark scripts run (smoke-sized CPU cases, on any machine; the numbers come from the GPU host)."""

from __future__ import annotations

import ast
import gzip
import importlib
import importlib.metadata
import json
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
    assert {"kernel", "step", "plan", "engine", "startup"} <= set(SCRIPTS)


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
    run_bench("kernel", "--device", "cpu", "--rounds", "1", "--json", str(out))
    data = json.loads(out.read_text())
    assert data["environment"]["vllm"] == importlib.metadata.version("vllm")
    ops = {(r["backend"], r["op"]) for r in data["kernel"]}
    assert ops == {("TORCH_SDPA", "new_tokens"), ("TORCH_SDPA", "context_chunk")}
    assert all(r["backend_tflops"] > 0 for r in data["kernel"])
    assert {s["automatic"] for s in data["selection"]} == {"TORCH_SDPA"}


def test_kernel_bench_times_only_the_backends_asked_for(tmp_path):
    out = tmp_path / "bench.json"
    run_bench("kernel", "--device", "cpu", "--rounds", "1", "--backends", "FLASH_ATTN", "--json", str(out))
    assert json.loads(out.read_text())["kernel"] == []  # FLASH_ATTN cannot run on the CPU
    proc = run_bench("kernel", "--backends", "FLASH_ATN", expect_rc=1)
    assert "unknown backend(s) ['FLASH_ATN']" in proc.stderr


def test_kernel_report_rebuilds_the_recorded_h200_tables(tmp_path):
    """docs/benchmarks.md's kernel tables come from the recorded run's log via kernel_report.py."""
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
        "| new_tokens | 128,64,128 | 16 | 1x4096 | 645 / 629 (1.025)"
        in (ROOT / "docs" / "benchmarks.md").read_text()
    )


def test_engine_scenarios_rebuilds_the_recorded_h200_table(tmp_path):
    """docs/benchmarks.md section 2 tabulates the recorded scenarios' throughput."""
    recorded = ROOT / "docs" / "results" / "h200-2026-11-29"
    out = tmp_path / "engine.json"
    run_bench("engine_scenarios", "--results", str(recorded / "scenarios"), "--json", str(out))
    rebuilt = json.loads(out.read_text())["engine"]
    committed = json.loads((recorded / "bench-engine.json").read_text())["engine"]
    assert rebuilt["table"] == committed["table"]
    assert rebuilt["ready_s"] == committed["ready_s"]
    proc = run_bench("engine_scenarios", "--results", str(tmp_path), expect_rc=1)
    assert f"engine scenario stock has no benchmark results in {tmp_path}" in proc.stderr


def test_step_bench_times_the_preparation_per_layer_count(tmp_path):
    """step.py on real vLLM objects: tables per backend, or the reason a backend cannot be timed here."""
    out = tmp_path / "step.json"
    proc = run_bench(
        "step", "--layers", "1,2", "--steps", "5", "--step-rounds", "1", "--warmup", "1", "--json", str(out)
    )
    step = json.loads(out.read_text())["step"]
    assert step["layers"] == [1, 2] and step["target_ratio"] == 1.2
    by_name = {r["backend"]: r for r in step["backends"]}
    assert list(by_name) == ["TORCH_SDPA", "FLASH_ATTN", "FLASHINFER", "TRTLLM_RAGGED"]
    # FlashInfer's wrappers need the NVIDIA driver when they are created: on a machine without one
    # its preparation is reported as not measurable, never faked; with one, it is timed like the rest.
    measured = ["TORCH_SDPA", "FLASH_ATTN", "TRTLLM_RAGGED"]
    if "not_measurable" in by_name["FLASHINFER"]:
        reason = by_name["FLASHINFER"]["not_measurable"]
        assert reason.startswith("its prepare_metadata cannot run on this CPU machine: "), reason
        assert "rows" not in by_name["FLASHINFER"]
    else:
        measured.append("FLASHINFER")
    for name in measured:
        res = by_name[name]
        assert [row["layers"] for row in res["rows"]] == [1, 2]
        for row in res["rows"]:
            assert row["steps"] == 5 and row["prepared_instances"] == 1  # one per builder, not per layer
            for key in ("addon_prepare_us", "stock_build_us", "build_with_addon_us", "hook_dispatch_us"):
                assert row[key] > 0, (name, key)
        assert res["ratio_prepare"] == res["rows"][1]["addon_prepare_us"] / res["rows"][0]["addon_prepare_us"]
        assert res["meets_target"] == (res["ratio_prepare"] <= 1.2)
        assert f"{name} (" in proc.stdout
    assert "| layers | add-on preparation in build() | stock build() |" in proc.stdout


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


def test_prefix_host_cost_times_every_part_on_vllms_own_objects(tmp_path):
    """prefix_host_cost.py builds every part from vLLM's real classes on the CPU and times each one."""
    bench = load_script("prefix_host_cost")
    out = tmp_path / "host.json"
    args = ["--requests", "2", "--prefix", "256", "--repeats", "1", "--block-size", "64", "16"]
    proc = run_bench("prefix_host_cost", *args, "--json", str(out))
    data = json.loads(out.read_text())
    assert data["environment"]["vllm"] == importlib.metadata.version("vllm")
    assert "cpu" in data["environment"] and data["args"]["prefix"] == 256
    keys = [key for key, _, _ in bench.PARTS]
    assert [r["block_size"] for r in data["prefix_host_cost"]] == [64, 16]
    for res in data["prefix_host_cost"]:
        assert res["not_built"] == {} and res["not_run"] == {}, res
        assert res["scheduler_cls"].endswith("AsyncScheduler") and res["hash_algo"] == "sha256"
        assert res["prefix_blocks_cached"] == 256 // res["block_size"]
        # the prefix came from the cache, one new token each was scheduled, both requests finished
        assert res["cached_tokens"] == [512] and res["scheduled_tokens"] == [2]
        assert res["finished_requests"] == [2]
        assert list(res["parts"]) == keys
        for key in keys:
            part = res["parts"][key]
            assert len(res["raw_ms"][key]) == 1, key
            if key != "gc":  # the collector need not run in a small call
                assert part["median_ms"] > 0 and part["min_ms"] > 0, key
        in_total = [key for key, _, counted in bench.PARTS if counted]
        assert res["total"]["raw_ms"][0] == pytest.approx(sum(res["raw_ms"][k][0] for k in in_total))
    assert proc.stdout.count("| total (rows not marked 'of which') |") == 2
    assert "not built" not in proc.stdout and "not run" not in proc.stdout


def test_prefix_host_cost_with_the_addons_hasher_still_hits_the_cache(tmp_path):
    """--hasher reuse: the add-on's engine-core hasher around vLLM's; the prefix's blocks still hit."""
    out = tmp_path / "host.json"
    args = ["--requests", "3", "--prefix", "256", "--repeats", "1", "--block-size", "16", "--hasher", "reuse"]
    run_bench("prefix_host_cost", *args, "--json", str(out))
    (res,) = json.loads(out.read_text())["prefix_host_cost"]
    assert res["hasher"] == "reuse" and res["not_built"] == {} and res["not_run"] == {}, res
    assert res["cached_tokens"] == [3 * 256] and res["finished_requests"] == [3]


def test_prefix_host_cost_with_the_addons_prompt_rows_lends_the_prefix(tmp_path):
    """--prompts reuse: in each call the first request's prompt is converted, the others take the
    cached prefix's 2,048 tokens from its row (the untimed call and the timed one)."""
    out = tmp_path / "host.json"
    args = [
        "--requests",
        "3",
        "--prefix",
        "2048",
        "--repeats",
        "1",
        "--block-size",
        "16",
        "--prompts",
        "reuse",
    ]
    run_bench("prefix_host_cost", *args, "--json", str(out))
    (res,) = json.loads(out.read_text())["prefix_host_cost"]
    assert res["prompts"] == "reuse" and res["not_built"] == {} and res["not_run"] == {}, res
    assert res["cached_tokens"] == [3 * 2048] and res["finished_requests"] == [3]
    assert res["prompts_copied"] == {"requests": 2 * 2, "tokens": 2 * 2 * 2048}


def test_prefix_host_cost_private_prefixes_are_each_cached_and_hit(tmp_path):
    """--private: each request its own cached prefix; every call's requests hit their own prefix."""
    out = tmp_path / "host.json"
    args = ["--requests", "3", "--prefix", "128", "--private", "--repeats", "2", "--block-size", "16"]
    run_bench("prefix_host_cost", *args, "--hasher", "reuse", "--hits", "reuse", "--json", str(out))
    (res,) = json.loads(out.read_text())["prefix_host_cost"]
    assert res["private"] is True and res["not_built"] == {} and res["not_run"] == {}, res
    assert res["prefix_blocks_cached"] == 3 * 128 // 16  # three prefixes, not one
    assert res["cached_tokens"] == [3 * 128, 3 * 128] and res["finished_requests"] == [3, 3]


def test_hasher_cost_pairs_vllms_hasher_with_the_reusing_one(tmp_path):
    """hasher_cost: vLLM's real hasher and the add-on's around it; shared prefixes reuse, private none."""
    # 256 + 24 tokens at block size 16: 16 prefix blocks and one of new tokens per request, 5 rounds (the
    # untimed one too). Shared: every request after the first takes the prefix's 16 blocks and hashes its
    # own one. Private, 9 requests (more than the 8 recent ones the reusing hasher remembers, as the
    # bench's 16 are): each prefix was last seen nine requests ago, nothing reused; 4 requests: each
    # prefix is found again from the third round on (the first round's requests, finished when the
    # second comes, lend nothing; the second's are kept as they share a first block with a recent one).
    cases = [(False, 9, (5 * 9 - 1) * 16), (True, 9, 0), (True, 4, 3 * 4 * 16)]
    for private, requests, reused in cases:
        out = tmp_path / f"hasher-{private}-{requests}.json"
        args = ["--requests", str(requests), "--prefix", "256", "--new", "24", "--block-size", "16"]
        run_bench("hasher_cost", *args, "--rounds", "4", *(["--private"] * private), "--json", str(out))
        res = json.loads(out.read_text())["hasher_cost"]
        assert [len(v) for v in res["raw_ms"].values()] == [4, 4]
        assert res["reused_blocks"] == reused
        assert res["hashed_blocks"] == 5 * requests * 17 - reused


def test_prefix_host_cost_says_which_part_it_could_not_build(tmp_path, monkeypatch):
    """A part vLLM cannot build here is reported with its reason; the parts needing it did not run."""
    bench = load_script("prefix_host_cost")
    monkeypatch.setenv("MLA_PREFILL_EXT_DISABLE", "1")

    def no_runner(self):
        raise RuntimeError("the runner needs CUDA here")

    monkeypatch.setattr(bench.Engine, "_runner", no_runner)
    out = tmp_path / "host.json"
    import torch

    threads = str(torch.get_num_threads())  # this process's setting stays as it is
    bench.main(
        [
            "--requests",
            "2",
            "--prefix",
            "128",
            "--repeats",
            "1",
            "--torch-threads",
            threads,
            "--json",
            str(out),
        ]
    )
    (res,) = json.loads(out.read_text())["prefix_host_cost"]
    assert res["not_built"]["runner"].startswith("RuntimeError: the runner needs CUDA here")
    for key in ("runner_add", "runner_commit", "runner_remove"):
        assert res["parts"][key]["not_run"].startswith("not built: RuntimeError"), key
        assert res["raw_ms"][key] == []
    assert res["parts"]["sched_update"]["median_ms"] > 0  # the scheduler still ran
    assert res["finished_requests"] == [2]


def test_prefix_fixed_cost_attributes_a_profile_to_the_watched_functions():
    import cProfile
    import io
    import pstats

    from scripts.bench import prefix_fixed_cost

    def hash_block_tokens(n):  # named as vLLM's block hash, which the run watches
        return sum(i * i for i in range(n))

    def schedule():
        import array

        array.array("i", range(50000)).tolist()  # a C method: "~:0(<method 'tolist' of ...>)"
        return [hash_block_tokens(20000) for _ in range(5)]

    profiler = cProfile.Profile()
    profiler.enable()
    schedule()
    profiler.disable()
    by_own, watched = prefix_fixed_cost.profile_rows(pstats.Stats(profiler, stream=io.StringIO()), top=3)
    assert len(by_own) <= 3 and by_own[0]["own_s"] >= by_own[-1]["own_s"]
    assert watched["schedule"] >= watched["hash_block_tokens"] > 0
    assert watched["tolist"] > 0
    assert watched["execute_model"] == 0.0


def test_prefix_fixed_cost_lists_kernels_by_device_time():
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from scripts.bench import prefix_fixed_cost

    events = [  # as torch.profiler's key_averages() gives them (device times in microseconds)
        # A CPU op carries the device time of the kernels it launched: not counted again.
        SimpleNamespace(
            key="aten::mm", count=122, self_device_time_total=50_000.0, device_type=DeviceType.CPU
        ),
        SimpleNamespace(
            key="flash_fwd_kernel", count=61, self_device_time_total=30_000.0, device_type=DeviceType.CUDA
        ),
        SimpleNamespace(key="gemm", count=122, self_device_time_total=50_000.0, device_type=DeviceType.CUDA),
    ]
    total, rows = prefix_fixed_cost.kernel_rows(events, top=1)
    assert total == pytest.approx(0.08)
    assert rows == [{"kernel": "gemm", "calls": 122, "seconds": pytest.approx(0.05)}]
    parsed = prefix_fixed_cost.make_parser().parse_args(["--side", "FLASH_ATTN", "--kernels"])
    assert (parsed.side, parsed.kernels) == ("FLASH_ATTN", True)


def test_prefix_fixed_cost_refuses_a_trace_without_the_profiled_call(tmp_path, capsys):
    """--trace writes the --kernels call's trace: alone it would be ignored, so it is refused before
    any engine starts."""
    from scripts.bench import prefix_fixed_cost

    with pytest.raises(SystemExit) as exit_info:
        prefix_fixed_cost.main(["--trace", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "give --kernels too" in capsys.readouterr().err
