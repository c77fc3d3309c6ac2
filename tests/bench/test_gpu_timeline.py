"""gpu_timeline: a profiler trace's GPU busy time, its idle gaps and the host's waits."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.bench import gpu_timeline

ROOT = Path(__file__).resolve().parents[2]


def _event(cat: str, name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1}


# Host launches at 0, the device runs 50-150 and 140-160 (one busy interval), the host waits in a
# synchronize 150-750 while the device idles, the device runs again 800-900.
EVENTS = [
    _event("cpu_op", "aten::mm", 0, 100),
    _event("kernel", "gemm", 50, 100),
    _event("kernel", "copy", 140, 20),
    _event("cuda_runtime", "cudaStreamSynchronize", 150, 600),
    _event("python_function", "step", 760, 30),
    _event("kernel", "attention", 800, 100),
    {"ph": "i", "cat": "kernel", "name": "marker", "ts": 10},  # not a complete event: ignored
]


def test_busy_time_gaps_and_waits_of_a_trace():
    s = gpu_timeline.summarize([e for e in EVENTS if e.get("ph") == "X"], gap_us=200)
    assert s["window_ms"] == pytest.approx(0.9)
    assert s["device_busy_ms"] == pytest.approx(0.21)  # 50-160 and 800-900
    assert s["gaps_counted"] == 1 and s["idle_ms"] == pytest.approx(0.64)
    (gap,) = s["largest_gaps"]
    assert gap["at_ms"] == pytest.approx(0.16)
    assert [h["name"] for h in gap["host"]] == ["cudaStreamSynchronize", "step"]
    assert s["host_waits"]["cudaStreamSynchronize"] == {"calls": 1, "ms": 0.6, "longest_ms": 0.6}
    # A gap below the threshold is not one.
    assert gpu_timeline.summarize(EVENTS[:-1], gap_us=700)["gaps_counted"] == 0


def test_a_gap_credits_each_host_event_with_its_own_time_and_async_copies_are_not_waits():
    """Nested host events on one thread: each counts its time less its children's."""
    events = [
        _event("python_function", "forward", 0, 1000),
        _event("kernel", "gemm", 0, 150),
        _event("cpu_op", "aten::to", 200, 500),
        _event("cpu_op", "aten::copy_", 210, 480),
        _event("cuda_runtime", "cudaMemcpyAsync", 220, 460),
        _event("cuda_runtime", "cudaGetDevice", 230, 0),  # no time: takes none from its parent
        _event("cuda_runtime", "cudaStreamWaitEvent", 700, 5),  # the device waits, not the host
        {**_event("cpu_op", "aten::index", 300, 400), "tid": 2},  # another thread: its own nesting
        _event("kernel", "attention", 800, 100),
    ]
    s = gpu_timeline.summarize(events, gap_us=200)
    (gap,) = s["largest_gaps"]  # 150-800
    assert [(h["name"], round(h["ms"], 3)) for h in gap["host"]] == [
        ("cudaMemcpyAsync in aten::copy_", 0.46),
        ("aten::index", 0.4),
        ("forward", 0.145),  # 150-200 and 705-800: its own Python around the ops
        ("aten::to", 0.02),
    ]
    assert s["host_waits"] == {}
    assert s["host_async_copies"]["cudaMemcpyAsync"]["ms"] == pytest.approx(0.46)
    assert gpu_timeline.is_wait("cudaMemcpy") and gpu_timeline.is_wait("cudaDeviceSynchronize")
    assert not gpu_timeline.is_wait("cudaMemcpyAsync") and not gpu_timeline.is_wait("cudaStreamWaitEvent")
    assert any("async copy cudaMemcpyAsync: 1 calls" in line for line in gpu_timeline.lines(s))


def test_an_event_that_outlives_its_parent_is_its_child_up_to_the_parents_end():
    crossing = [
        _event("user_annotation", "A", 150, 400),  # 150-550
        _event("cpu_op", "B", 300, 500),  # 300-800: begins in A, ends after it
        _event("cuda_runtime", "cudaLaunchKernel", 600, 50),  # in B, after A ended
    ]
    owned = dict(gpu_timeline.own_time(crossing))
    assert owned["A"] == [(150.0, 300.0)]
    assert owned["B"] == [(300.0, 600.0), (650.0, 800.0)]
    assert owned["cudaLaunchKernel in B"] == [(600.0, 650.0)]
    # Inside an outer event, the crossing one is the outer's child too: no time counted twice.
    outer = dict(gpu_timeline.own_time([_event("python_function", "G", 0, 1000), *crossing]))
    assert outer["G"] == [(0.0, 150.0), (800.0, 1000.0)]
    spans = [span for spans in outer.values() for span in spans]
    assert sum(b - a for a, b in spans) == 1000.0


def test_a_gap_adds_up_the_calls_of_one_name():
    """Many short launches in a gap: one entry with their sum, above a longer single op."""
    launches = [_event("cuda_runtime", "cudaLaunchKernel", 200 + 20 * i, 15) for i in range(30)]
    events = [
        _event("kernel", "gemm", 0, 150),
        *launches,
        _event("cpu_op", "aten::foo", 850, 60),
        _event("kernel", "attention", 1000, 100),
    ]
    (gap,) = gpu_timeline.summarize(events, gap_us=200)["largest_gaps"]
    assert [(h["name"], round(h["ms"], 3)) for h in gap["host"]] == [
        ("cudaLaunchKernel", 0.45),
        ("aten::foo", 0.06),
    ]


def test_merge_joins_overlapping_and_touching_intervals():
    assert gpu_timeline.merge([(5, 6), (0, 2), (1, 3), (3, 4)]) == [(0, 4), (5, 6)]


def test_the_command_reads_a_gzipped_trace_and_writes_its_summary(tmp_path):
    trace = tmp_path / "shared.json.gz"
    trace.write_bytes(gzip.compress(json.dumps({"traceEvents": EVENTS}).encode()))
    out = tmp_path / "summary.json"
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.bench", "gpu_timeline", str(trace), "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "device busy 0.2 ms" in proc.stdout and "cudaStreamSynchronize" in proc.stdout
    assert json.loads(out.read_text())["gaps_counted"] == 1


def test_a_trace_without_device_events_is_refused_with_a_reason(tmp_path):
    """A CPU-only profile (torch.profiler on this machine) has no kernels to measure against."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(64, 64) @ torch.ones(64, 64)
    trace = tmp_path / "cpu.json"
    prof.export_chrome_trace(str(trace))
    assert any(e.get("cat") == "cpu_op" for e in gpu_timeline.load(trace))
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.bench", "gpu_timeline", str(trace)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "no device events" in proc.stderr
