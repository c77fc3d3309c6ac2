"""The benchmark script runs (a smoke-sized CPU case; the numbers come from the GPU host)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_kernel_bench_runs_on_cpu(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "bench_prefill.py"),
            "kernel",
            "--rounds",
            "1",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["environment"]["vllm"] == "0.20.2"
    ops = {(r["backend"], r["op"]) for r in data["kernel"]}
    assert ops == {("TORCH_SDPA", "new_tokens"), ("TORCH_SDPA", "context_chunk")}
    assert all(r["backend_tflops"] > 0 for r in data["kernel"])
    assert {s["automatic"] for s in data["selection"]} == {"TORCH_SDPA"}
