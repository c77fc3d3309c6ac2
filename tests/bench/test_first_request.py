"""The first-request benchmark's pure parts, and its orchestration on a machine where no side can start.

Its numbers come from the GPU host (scripts/gpu_first_request_suite.sh).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scripts.bench import first_request as bench
from scripts.bench import sides as side_runner

ROOT = Path(__file__).resolve().parents[2]
BENCH = [sys.executable, "-m", "scripts.bench", "first_request"]  # run from ROOT


def test_sides_parse_with_their_switches():
    sides = side_runner.parse_sides("stock,flash_attn,FLASHINFER,flashinfer-warm")
    assert [(s.label, s.backend, s.warm) for s in sides] == [
        ("stock", None, False),
        ("FLASH_ATTN", "FLASH_ATTN", False),
        ("FLASHINFER", "FLASHINFER", False),
        ("FLASHINFER-warm", "FLASHINFER", True),
    ]
    assert side_runner.side_env(sides[0]) == {"MLA_PREFILL_EXT_DISABLE": "1"}
    assert side_runner.side_env(sides[3]) == {"MLA_PREFILL_BACKEND": "FLASHINFER"}


def test_a_warm_side_needs_the_cache_it_reuses():
    with pytest.raises(ValueError, match="list that side first, or give --warm-cache"):
        side_runner.parse_sides("FLASHINFER-warm,FLASHINFER")
    assert side_runner.parse_sides("stock,FLASHINFER-warm", warm_cache_given=True)[1].warm
    with pytest.raises(ValueError, match="listed twice"):
        side_runner.parse_sides("stock,FLASH_ATTN,flash_attn")


def test_cache_env_keeps_or_isolates_the_hosts_caches(tmp_path):
    fresh = side_runner.cache_env(tmp_path / "fi", tmp_path / "side")
    assert fresh == {
        "FLASHINFER_WORKSPACE_BASE": str(tmp_path / "fi"),
        "VLLM_CACHE_ROOT": str(tmp_path / "side" / "vllm"),
        "TRITON_CACHE_DIR": str(tmp_path / "side" / "triton"),
    }
    assert side_runner.cache_env(tmp_path / "fi", None) == {"FLASHINFER_WORKSPACE_BASE": str(tmp_path / "fi")}


def test_a_sides_process_gets_its_own_switch_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("MLA_PREFILL_BACKEND", "FLASH_ATTN")  # the driver's own: not the side's
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # the caller's choice stays
    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER", raising=False)  # unset: off
    env = side_runner.process_env(side_runner.parse_sides("stock")[0], tmp_path / "fi", None, EXTRA="1")
    assert env["MLA_PREFILL_EXT_DISABLE"] == "1" and "MLA_PREFILL_BACKEND" not in env
    assert env["FLASHINFER_WORKSPACE_BASE"] == str(tmp_path / "fi") and "VLLM_CACHE_ROOT" not in env
    assert (env["HF_HUB_OFFLINE"], env["VLLM_USE_FLASHINFER_SAMPLER"], env["EXTRA"]) == ("0", "0", "1")


@pytest.mark.parametrize("wave", [bench.Wave(), bench.QUICK_WAVE])
def test_the_wave_mixes_long_prompts_and_a_shared_prefix(wave):
    prompts = bench.make_wave(wave)
    assert len(prompts) == wave.requests
    assert prompts == bench.make_wave(wave)  # the same prompts for every side
    assert all(wave.min_len <= len(p) <= wave.max_len for p in prompts)
    shared = [p for p in prompts if p[: wave.prefix_len] == prompts[0][: wave.prefix_len]]
    assert len(shared) == wave.requests // wave.share_every
    # Longer than a step's token budget (2048): prefilled in chunks over their own context.
    assert sum(len(p) > 2048 for p in prompts) >= wave.requests // 2
    assert all(2 <= t < bench.VOCAB for p in prompts for t in p)


def test_percentile_interpolates_between_ranks():
    values = [float(v) for v in range(1, 101)]
    assert side_runner.percentile(values, 50) == pytest.approx(50.5)
    assert side_runner.percentile(values, 99) == pytest.approx(99.01)
    assert side_runner.percentile([3.0, 1.0, 2.0], 100) == 3.0
    assert side_runner.percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        side_runner.percentile([], 50)


def test_modules_in_a_flashinfer_cache(tmp_path):
    ops = tmp_path / ".cache" / "flashinfer" / "0.6.8.post1" / "90a" / "cached_ops"
    for name, built in (("batch_prefill_fa3_x", True), ("half_built", False)):
        (ops / name).mkdir(parents=True)
        (ops / name / ("build.ninja" if not built else f"{name}.so")).write_text("")
    assert side_runner.modules_in_cache(tmp_path) == ["batch_prefill_fa3_x"]
    assert side_runner.modules_in_cache(tmp_path / "nothing") == []


def test_mapped_modules_reads_proc_maps():
    jit = "/c/.cache/flashinfer/0.6.8.post1/90a/cached_ops"
    maps = "\n".join(
        [
            f"7f00-7f10 r-xp 00000000 08:01 12 {jit}/batch_prefill_fa3_x/batch_prefill_fa3_x.so",
            f"7f10-7f20 r--p 00010000 08:01 12 {jit}/batch_prefill_fa3_x/batch_prefill_fa3_x.so",
            "7f20-7f30 r-xp 00000000 08:01 13 /usr/lib/libc.so.6",
            "7f30-7f40 r-xp 00000000 08:01 14 /site/flashinfer/data/aot/norm/norm.so",
            "7f40-7f50 rw-p 00000000 00:00 0 ",
        ]
    )
    assert bench.mapped_modules(maps, [jit]) == ["batch_prefill_fa3_x"]
    assert bench.mapped_modules(maps, [jit, "/site/flashinfer/data/aot/"]) == ["batch_prefill_fa3_x", "norm"]


def report(modules, owners=("FLASHINFER",), warm=0.0):
    return {
        "owners": list(owners),
        "warmups": [{"seconds": warm}] if warm else [],
        "flashinfer_modules": list(modules),
        "context_chunk_wrappers": [],
        "flashinfer_getter_misses": {},
    }


def raw_side(side, latencies, up, modules_after=(), warm=0.0, cache="cold"):
    return {
        "side": side,
        "ok": True,
        "launched_at": 1000.0,
        "engine_started_wall": 1005.0,
        "ready_wall": 1000.0 + up,
        "requests": [{"done_s": s, "first_token_s": s / 2, "num_cached_tokens": 16} for s in latencies],
        "workers_ready": [report(["a"], warm=warm)],
        "workers_after_wave": [report(["a", *modules_after])],
        "cache_before": [],
        "cache_after": ["a"],
        "flashinfer_cache_state": cache,
    }


def test_summary_sets_every_side_beside_stock():
    rows = bench.summarize(
        [
            raw_side("stock", [1.0, 2.0, 3.0], up=70.0),
            raw_side("FLASHINFER", [1.0, 2.0, 66.0], up=72.0, modules_after=["fa3"]),
            raw_side("FLASHINFER-warm", [1.0, 2.0, 3.3], up=71.0, warm=0.4, cache="warm"),
            {"side": "FLASH_ATTN", "ok": False, "error": "exit status 1"},
        ]
    )
    stock, cold, warm, failed = rows
    assert stock["p99_vs_stock"] == 1.0 and stock["up_after_s"] == 70.0 and stock["engine_s"] == 65.0
    assert cold["p99_s"] == pytest.approx(2.0 + (66.0 - 2.0) * 0.98)
    assert cold["p99_vs_stock"] == pytest.approx(cold["p99_s"] / stock["p99_s"])
    assert cold["modules_loaded_in_wave"] == ["fa3"] and cold["modules_built"] == ["a"]
    assert warm["warmup_s"] == 0.4 and warm["up_after_vs_stock_s"] == 1.0
    assert warm["modules_loaded_in_wave"] == [] and warm["cached_prompt_tokens"] == 48
    assert failed == {"side": "FLASH_ATTN", "ok": False, "error": "exit status 1"}
    table = bench.markdown(rows)
    assert table[2].startswith("| stock | cold | 70 s | 0.0 s | 2.00 s | 2.98 s | 3.00 s | 1.00 | none |")
    assert "| FLASHINFER | cold |" in table[3] and table[3].endswith("| fa3 |")
    assert table[5].startswith("| FLASH_ATTN | failed: exit status 1 |")


def test_owners_must_match_the_side():
    stock, fi, custom = side_runner.parse_sides("stock,FLASHINFER,CUSTOM")
    assert bench.check_owners(stock, [report([], owners=())]) is None
    assert "owned by ['FLASH_ATTN']" in bench.check_owners(fi, [report([], owners=("FLASH_ATTN",))])
    assert bench.check_owners(fi, [report([])]) is None
    assert bench.check_owners(custom, [report([], owners=("MUTANT_NO_WARMUP",))]) is None
    assert bench.check_owners(custom, [report([], owners=("vLLM's own",))]) is not None


@pytest.mark.vllm_patch  # records vLLM 0.20.2, the version the benchmark measures
def test_a_side_that_cannot_start_is_recorded_and_the_rest_still_written(tmp_path):
    """On this machine no engine starts: each side fails in its own process and says so."""
    out = tmp_path / "first.json"
    proc = subprocess.run(
        [
            *BENCH,
            "--sides",
            "stock,TORCH_SDPA",
            "--quick",
            "--eager",
            "--json",
            str(out),
            "--logs",
            str(tmp_path / "logs"),
            "--cache-root",
            str(tmp_path / "caches"),
            "--side-timeout",
            "300",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=660,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [s["side"] for s in data["sides"]] == ["stock", "TORCH_SDPA"]
    assert all(not s["ok"] and s["returncode"] not in (0, None) for s in data["sides"])
    assert [r["ok"] for r in data["table"]] == [False, False]
    assert data["environment"]["vllm"] == "0.20.2"
    assert (tmp_path / "logs" / "stock.log").read_text()  # the child's own output, for the reader
    assert "| stock | failed: exit status" in proc.stdout


def test_sides_past_the_deadline_are_skipped_not_started(tmp_path):
    out = tmp_path / "first.json"
    proc = subprocess.run(
        [*BENCH, "--sides", "stock,FLASHINFER", "--deadline", "1", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    sides = json.loads(out.read_text())["sides"]
    assert [(s["side"], s["ok"], s["error"]) for s in sides] == [
        ("stock", False, "skipped: 0 s left before the deadline"),
        ("FLASHINFER", False, "skipped: 0 s left before the deadline"),
    ]


def test_a_side_out_of_time_is_killed_with_its_engine_process(tmp_path):
    """vLLM's engine core is a process of the side's own: it goes too, freeing the GPU for the next side."""
    import psutil

    log = tmp_path / "side.log"
    child = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
        "print(p.pid, flush=True); time.sleep(120)"
    )
    assert side_runner.run_child([sys.executable, "-c", child], dict(), log, 3.0) is None
    grandchild = int(log.read_text().split()[0])
    # A SIGKILL is delivered asynchronously: on a busy machine the process may still be scheduled for
    # a moment. Killed means gone or a zombie within seconds; a survivor sleeps for two minutes.
    deadline = time.monotonic() + 10
    status = None
    while time.monotonic() < deadline:
        try:
            status = psutil.Process(grandchild).status()
        except psutil.NoSuchProcess:
            status = "gone"
        if status in ("gone", psutil.STATUS_ZOMBIE):
            break
        time.sleep(0.1)
    assert status in ("gone", psutil.STATUS_ZOMBIE), f"the engine process outlived its side: {status}"
    assert side_runner.run_child([sys.executable, "-c", "raise SystemExit(3)"], dict(), log, 30.0) == 3
