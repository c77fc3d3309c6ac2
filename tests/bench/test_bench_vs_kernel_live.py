"""``bench_vs_kernel --live``: bench and the kernel benchmark measured in one process, taking turns.

The command runs on the CPU with TORCH_SDPA at a tiny model's dims (real backends, real timers,
each tool's own code): judged by its JSON, its table and its exit code, never by the times.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIVE = ["-m", "scripts.bench", "bench_vs_kernel", "--live", "--device", "cpu", "--backends", "TORCH_SDPA"]
TINY = ["--dims", "8,4,8,2", "--shapes", "1x16,2x8,2x8+8", "--rounds", "3"]
EXPECTED = [
    ("TORCH_SDPA", "1x16", ["new_tokens"]),
    ("TORCH_SDPA", "2x8", ["new_tokens"]),
    ("TORCH_SDPA", "2x8+8", ["new_tokens_lse", "context_chunk"]),
]


def start(*args: str) -> subprocess.Popen[str]:
    # One thread: on a shared CI machine PyTorch's threads waiting on each other cost more than the steps.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.fixture(scope="module")
def live_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[subprocess.Popen[str]]:
    """The command as a user runs it, any ratio accepted (started first: it imports vLLM for seconds)."""
    folder = tmp_path_factory.mktemp("live")
    args = ["--tolerance", "1000", "--json", str(folder / "live.json"), "--markdown", str(folder / "live.md")]
    proc = start(*LIVE, *TINY, *args)
    proc.folder = folder  # type: ignore[attr-defined]
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


@pytest.mark.vllm_patch  # kernel.py calls the backends as vLLM 0.20 does (as tests/bench/test_scripts.py)
def test_live_mode_flags_every_pair_outside_a_tolerance_of_0(live_run, capsys) -> None:
    """In this process (while the command runs): the same measurement, with no ratio accepted but 1."""
    from mla_prefill_ext.bench.spec import parse_dims
    from scripts.bench.bench_vs_kernel import report
    from scripts.bench.bench_vs_kernel_live import live_shapes, measure_live, resolve_backends

    dims = parse_dims("8,4,8,2")
    backends, left_out = resolve_backends(["TORCH_SDPA", "FLASH_ATTN"], "cpu", dims)
    assert list(backends) == ["TORCH_SDPA"] and "needs a GPU" in left_out["FLASH_ATTN"]
    pairs, errors = measure_live(backends, live_shapes("1x16,2x8+8"), dims, "cpu", 2, 0.0)
    assert errors == [] and [(p["shape"], p["kernel_ops"]) for p in pairs] == [
        EXPECTED[0][1:],
        EXPECTED[2][1:],
    ]
    # Two medians of timers never meet exactly: every pair is flagged, and the exit code says so.
    assert all(not p["within_tolerance"] for p in pairs)
    assert report(pairs, 0.0, None, None, {}) == 1
    assert capsys.readouterr().out.count("| NO |") == 2


@pytest.mark.vllm_patch
def test_live_mode_pairs_every_backend_and_shape_from_rounds_taken_in_turn(live_run) -> None:
    out, err = live_run.communicate(timeout=300)
    assert live_run.returncode == 0, err[-3000:]
    path = live_run.folder / "live.json"
    data = json.loads(path.read_text())
    assert data["mode"] == "live" and data["device"] == "cpu" and data["rounds"] == 3
    assert data["dims"] == {"qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "num_heads": 2}
    assert data["environment"]["vllm"] and data["errors"] == [] and data["backends_left_out"] == {}
    got = data["pairs"]
    assert [(p["backend"], p["shape"], p["kernel_ops"]) for p in got] == EXPECTED
    for p in got:
        # Each side's figure is the median of its rounds; the kernel side's round is its ops' sum.
        assert len(p["bench_rounds_ms"]) == 3 and p["bench_ms"] == statistics.median(p["bench_rounds_ms"])
        assert list(p["kernel_op_rounds_ms"]) == p["kernel_ops"]
        sums = [sum(r) for r in zip(*p["kernel_op_rounds_ms"].values(), strict=True)]
        assert p["kernel_rounds_ms"] == pytest.approx(sums)
        assert p["kernel_ms"] == statistics.median(p["kernel_rounds_ms"])
        assert p["ratio"] == pytest.approx(p["bench_ms"] / p["kernel_ms"]) and p["within_tolerance"]
        assert p["bench_calls_per_repetition"] >= 1
        assert set(p["kernel_launches_per_round"]) == set(p["kernel_ops"]) and p["heads"] == 2
        assert not p["lse_left_out"]
    table = (live_run.folder / "live.md").read_text()
    assert table in out and "| TORCH_SDPA | 2x8+8 | 2 |" in table
    assert "[3/3] TORCH_SDPA on 2x8+8: bench " in err and "3 pairs, 0 outside" in err


def test_a_round_is_one_bench_repetition_then_one_kernel_measure_per_op() -> None:
    from scripts.bench.bench_vs_kernel_live import take_turns

    log: list[str] = []

    def side(name: str, seconds: float):
        return lambda: log.append(name) or seconds

    bench_s, kernel_s = take_turns(
        side("bench", 1.0), {"new_tokens_lse": side("lse", 2.0), "context_chunk": side("chunk", 3.0)}, 2
    )
    assert log == ["bench", "lse", "chunk", "bench", "lse", "chunk"]
    assert bench_s == [1.0, 1.0] and kernel_s == {"new_tokens_lse": [2.0, 2.0], "context_chunk": [3.0, 3.0]}


def test_a_pair_is_the_median_of_each_side_and_flagged_outside_the_tolerance() -> None:
    from mla_prefill_ext.bench.spec import BenchShape
    from scripts.bench.bench_vs_kernel_live import live_pair

    shape = BenchShape(8, 2048, 2048)
    kernel = {"new_tokens_lse": [1e-3, 1e-3, 5e-3], "context_chunk": [2e-3, 2.2e-3, 2e-3]}
    row = live_pair("TORCH_SDPA", shape, 16, [3.1e-3, 9e-3, 3.0e-3], kernel, 0.05)
    assert row["kernel_rounds_ms"] == pytest.approx([3.0, 3.2, 7.0])
    assert row["bench_ms"] == pytest.approx(3.1) and row["kernel_ms"] == pytest.approx(3.2)
    assert row["within_tolerance"] and row["kernel_ops"] == ["new_tokens_lse", "context_chunk"]
    far = live_pair("TORCH_SDPA", shape, 16, [4e-3] * 3, kernel, 0.05)
    assert far["ratio"] == pytest.approx(1.25) and not far["within_tolerance"]


def test_the_exit_code_counts_flags_errors_and_backends_that_cannot_serve(capsys) -> None:
    from scripts.bench.bench_vs_kernel import report

    row = {"backend": "X", "shape": "1x16", "heads": 2, "bench_ms": 1.0, "kernel_ms": 1.0,
           "kernel_ops": ["new_tokens"], "ratio": 1.0, "within_tolerance": True}  # fmt: skip
    assert report([row], 0.05, None, None, {}) == 0
    assert report([{**row, "within_tolerance": False}], 0.05, None, None, {}) == 1
    assert report([row], 0.05, None, None, {"errors": [{"backend": "Y", "shape": "1x16", "error": "E"}]}) == 1
    assert report([row], 0.05, None, None, {"backends_left_out": {"FLASH_ATTN": "needs a GPU"}}) == 1
    assert report([], 0.05, None, None, {}) == 1  # nothing paired shows nothing
    assert "1 backend-shape errors, 0 backends cannot serve here" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--live", "--shapes", "1x16+32"], "the kernel benchmark has no such step"),
        (["--live", "--shapes", "4x64+128/2"], "the kernel benchmark has no such step"),
        (["--live", "--bench", "b.json"], "--live measures both here"),
        (["--bench", "b.json", "--kernel", "k.json", "--rounds", "3"], "--rounds: only with --live"),
        (["--bench", "b.json"], "--bench and --kernel are required (or --live)"),
    ],
)
def test_live_mode_usage_errors(args: list[str], message: str, capsys) -> None:
    from scripts.bench.bench_vs_kernel import main

    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_live_mode_refuses_cuda_without_a_gpu(capsys) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from scripts.bench.bench_vs_kernel import main

    with pytest.raises(SystemExit) as e:
        main(["--live", "--device", "cuda", "--shapes", "1x16"])
    assert e.value.code == 2 and "--device cuda: PyTorch sees no CUDA GPU here" in capsys.readouterr().err
