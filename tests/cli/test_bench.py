"""``mla-prefill-ext bench``: a backend's speed next to the built-ins, run as a user runs it on a CPU.

The command runs in subprocesses (judged by output and exit code); its parts (shape and dims
parsing, the timer, the FLOP count, the step it times) are checked directly. Timings are printed,
never asserted: only that there is one per backend and shape.
"""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from cli_runs import SITECUSTOMIZE, assert_no_traceback, cli_env, finish, start

from mla_prefill_ext.bench.spec import SHAPE_SETS, BenchShape, MLADims, parse_dims, parse_shapes
from mla_prefill_ext.bench.timing import median_time

ROOT = Path(__file__).resolve().parents[2]
SMALL = [s.label for s in SHAPE_SETS["small"]]
CPU_SDPA = ["bench", "--backend", "TORCH_SDPA", "--device", "cpu", "--shapes", "small"]
QUICK = ["--repeat", "2", "--warmup", "1"]
# A tiny model for the runs that only look at the command's behaviour, not at R1's dims.
TINY = ["--dims", "8,4,8,2", "--shapes", "1x16,2x8+8", "--repeat", "1", "--warmup", "1"]

# R1's dims as one GPU of eight sees them: 16 heads, qk 128 + 64, v 128. FLOPs of a step by
# hand: 2 (multiply-add) x heads x (QK^T over 192 + PV over 128) x the query-key pairs: the
# causal half of each sequence's new tokens, n (n + 1) / 2, plus its new tokens against its
# context, n x c.
R1_FLOPS_PER_PAIR = 2 * 16 * (192 + 128)
SMALL_PAIRS = {
    "1x256": 256 * 257 // 2,
    "4x64": 4 * (64 * 65 // 2),
    "1x128+256": 128 * 129 // 2 + 128 * 256,
    "4x64+128/2": 4 * (64 * 65 // 2 + 64 * 128),
}


# Two backends that are not built-ins, registered by the overrides variable (tests/helpers on the
# path): TORCH_SDPA under another name, and one whose context-chunk kernel raises.
REGISTERED = {
    "MLA_PREFILL_BACKEND_OVERRIDES": json.dumps(
        {
            "WRAPPED_SDPA": "custom_backends.WrappedSDPABackend",
            "FAILING_WARMUP": "custom_backends.FailingWarmupBackend",
        }
    ),
    "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "tests" / "helpers"), *filter(None, [os.environ.get("PYTHONPATH")])]
    ),
}


def bench_env(**extra: str) -> dict[str, str]:
    """cli_env with one CPU thread: on a shared CI machine, PyTorch's threads waiting on each other
    cost more than the steps themselves (what is timed here is the command, not the machine)."""
    return cli_env(**{"OMP_NUM_THREADS": "1", **extra})


def bench(*args: str, **env: str) -> subprocess.Popen[str]:
    return start(["-m", "mla_prefill_ext", *args], bench_env(**env))


@pytest.fixture(scope="module")
def cpu_runs() -> Iterator[dict[str, subprocess.CompletedProcess[str]]]:
    """The CPU runs that import vLLM, started together (each costs seconds)."""
    procs = {
        "text": bench(*CPU_SDPA, *QUICK),
        "json": bench(*CPU_SDPA, *QUICK, "--json"),
        "unknown": bench("bench", "--backend", "TORCH_SDPA,NOPE_BACKEND", "--device", "cpu"),
        "unknown_json": bench("bench", "--backend", "NOPE_BACKEND", "--device", "cpu", "--json"),
        "cannot_serve": bench("bench", "--backend", "FLASH_ATTN", "--device", "cpu", *TINY),
        "registered": bench(
            "bench", "--backend", "WRAPPED_SDPA,FAILING_WARMUP", "--device", "cpu", *TINY, **REGISTERED
        ),
    }
    yield {name: finish(p) for name, p in procs.items()}


# The command


def test_cpu_bench_prints_a_time_and_a_ratio_per_shape(cpu_runs: dict[str, Any]) -> None:
    proc = cpu_runs["text"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert_no_traceback(proc)
    lines = proc.stdout.splitlines()
    (header,) = [line for line in lines if line.startswith("shape ")]
    assert header.split()[:5] == ["shape", "backend", "time", "ms", "TFLOP/s"]
    assert header.endswith("vs fastest built-in")
    for label in SMALL:
        (row,) = [line for line in lines if line.split()[:1] == [label]]
        # shape, backend (* under test), time, TFLOP/s, ratio (the fastest built-in)
        assert re.fullmatch(
            rf"{re.escape(label)} +TORCH_SDPA \* +\d+\.\d{{3}} +[\d.e+-]+ +1\.00x \(TORCH_SDPA\)", row
        ), row
    assert "under test (*): TORCH_SDPA" in proc.stdout
    assert "built-ins that can serve here: TORCH_SDPA" in proc.stdout
    assert "built-ins left out: FLASH_ATTN: needs a GPU" in proc.stdout
    assert "MLA dims: qk 128+64, v 128, 16 heads (r1)" in proc.stdout


def test_cpu_bench_json_has_every_field(cpu_runs: dict[str, Any]) -> None:
    proc = cpu_runs["json"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] is True and report["exit_code"] == 0
    assert report["device"] == "cpu" and report["capability"] is None and report["dtype"] == "bfloat16"
    assert report["dims"] == {
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "num_heads": 16,
        "preset": "r1",
    }
    assert report["repeat"] == 2 and report["warmup"] == 1
    (sdpa,) = report["backends"]
    assert sdpa["name"] == "TORCH_SDPA" and sdpa["under_test"] and sdpa["builtin"]
    assert sdpa["class"].endswith("TorchSDPAPrefillBackend") and sdpa["source"] == "--backend"
    assert set(report["builtins_left_out"]) >= {"FLASH_ATTN", "FLASHINFER", "TRTLLM_RAGGED"}
    assert [s["label"] for s in report["shapes"]] == SMALL
    assert [r["shape"] for r in report["results"]] == SMALL
    for shape, row in zip(report["shapes"], report["results"], strict=True):
        assert shape["flops"] == row["flops"] == R1_FLOPS_PER_PAIR * SMALL_PAIRS[shape["label"]]
        assert row["error"] is None and row["backend"] == "TORCH_SDPA"
        assert row["time_ms"] > 0 and len(row["times_ms"]) == 2 and row["calls_per_repetition"] >= 1
        assert row["tflops"] == pytest.approx(row["flops"] / (row["time_ms"] / 1e3) / 1e12)
        assert row["fastest_builtin"] == "TORCH_SDPA" and row["speed_vs_fastest_builtin"] == 1.0
    by_label = {s["label"]: s for s in report["shapes"]}
    assert by_label["4x64+128/2"] == {
        "label": "4x64+128/2",
        "seqs": 4,
        "new_tokens": 64,
        "context_tokens": 128,
        "chunks": 2,
        "tokens": 256,
        "flops": R1_FLOPS_PER_PAIR * SMALL_PAIRS["4x64+128/2"],
    }


def test_an_unknown_backend_is_a_usage_error_naming_it(cpu_runs: dict[str, Any]) -> None:
    proc = cpu_runs["unknown"]
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert_no_traceback(proc)
    assert proc.stderr.startswith("usage: mla-prefill-ext bench")
    assert (
        "argument --backend: Unknown MLA prefill backend: 'NOPE_BACKEND'. Valid options are:" in proc.stderr
    )
    report = json.loads(cpu_runs["unknown_json"].stdout)
    assert cpu_runs["unknown_json"].returncode == 2
    assert "'NOPE_BACKEND'" in report["error"] and report["exit_code"] == 2


def test_a_backend_that_cannot_serve_here_says_why(cpu_runs: dict[str, Any]) -> None:
    proc = cpu_runs["cannot_serve"]
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert_no_traceback(proc)
    assert proc.stdout.startswith(
        "FAIL: MLA prefill backend FLASH_ATTN cannot serve here (no GPU, dtype bfloat16, MLA dims "
        "qk 8+4, v 8, 2 heads): needs a GPU"
    ), proc.stdout


def test_a_registered_backend_is_timed_beside_the_builtin_and_one_that_raises_fails(
    cpu_runs: dict[str, Any],
) -> None:
    proc = cpu_runs["registered"]
    assert proc.returncode == 1, proc.stdout + proc.stderr  # a backend under test did not run a step
    assert_no_traceback(proc)
    lines = proc.stdout.splitlines()
    assert "under test (*): WRAPPED_SDPA (custom_backends.WrappedSDPABackend; --backend)" in proc.stdout
    assert "built-ins that can serve here: TORCH_SDPA" in proc.stdout

    def row(shape: str, backend: str) -> str:
        (found,) = [line for line in lines if line.split()[:2] == [shape, backend]]
        return found

    for shape in ("1x16", "2x8+8"):
        # The registered backend: marked, timed, its ratio to the built-in it is measured against.
        assert re.fullmatch(
            rf"{re.escape(shape)} +WRAPPED_SDPA \* +\d+\.\d{{3}} +[\d.e+-]+ +\d+\.\d\dx \(TORCH_SDPA\)",
            row(shape, "WRAPPED_SDPA"),
        ), row(shape, "WRAPPED_SDPA")
        # The built-in reference: not marked, 1.00x of itself.
        assert re.fullmatch(
            rf"{re.escape(shape)} +TORCH_SDPA +\d+\.\d{{3}} +[\d.e+-]+ +1\.00x \(TORCH_SDPA\)",
            row(shape, "TORCH_SDPA"),
        ), row(shape, "TORCH_SDPA")
    # New tokens only: the failing backend runs; with context its chunk kernel raises.
    assert re.search(r"1\.00x|\d+\.\d\dx \(TORCH_SDPA\)$", row("1x16", "FAILING_WARMUP"))
    assert row("2x8+8", "FAILING_WARMUP").endswith("error (below)")
    # The call as this vLLM makes it: by index (0.20 by position, 0.23-0.27 by keyword), 0.29+ a chunk.
    call = r"run_prefill_context_chunk\((0|chunk_idx=0|chunk=<vLLM ContextChunk 0>)\)"
    assert re.search(
        rf"^error: FAILING_WARMUP on 2x8\+8: {call} "
        r"raised RuntimeError: building the context-chunk kernel failed: no compiler on this host$",
        proc.stdout,
        re.MULTILINE,
    ), proc.stdout
    assert "FAIL: 1 step(s) of the backend(s) under test did not run." in proc.stdout


def test_no_progress_unless_stderr_is_a_terminal(cpu_runs: dict[str, Any], tmp_path: Path) -> None:
    assert "mla-prefill-ext bench: [" not in cpu_runs["text"].stderr
    assert "mla-prefill-ext bench: [" not in cpu_runs["json"].stderr
    # On a terminal: one line per backend and shape, on stderr (stdout stays the report).
    parent, child = pty.openpty()
    chunks: list[bytes] = []

    def read() -> None:  # drain the terminal as the command writes (its buffer is small)
        while True:
            try:
                data = os.read(parent, 4096)
            except OSError:
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mla_prefill_ext",
            "bench",
            "--backend",
            "TORCH_SDPA",
            "--device",
            "cpu",
            *TINY,
        ],
        stdout=subprocess.PIPE,
        stderr=child,
        text=True,
        env=bench_env(),
        cwd=ROOT,
        timeout=300,
    )
    os.close(child)
    reader.join(timeout=10)
    os.close(parent)
    terminal = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0, proc.stdout + terminal
    assert "mla-prefill-ext bench: [1/2] TORCH_SDPA on 1x16" in terminal
    assert "mla-prefill-ext bench: [2/2] TORCH_SDPA on 2x8+8" in terminal
    assert "mla-prefill-ext bench: [" not in proc.stdout


def test_bench_without_vllm_says_what_is_missing(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = cli_env(PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]), MLA_TEST_HIDE="vllm,torch")
    proc = finish(start(["-m", "mla_prefill_ext", *CPU_SDPA], env))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert_no_traceback(proc)
    assert "mla-prefill-ext bench cannot run here:" in proc.stdout


# Its parts


class FakeDevice:
    """A clock and an asynchronous device: a call queues work, synchronising waits for it."""

    def __init__(self, durations: list[float]) -> None:
        self.now = 0.0
        self.queued = 0.0
        self.durations = iter(durations)
        self.calls = 0
        self.syncs = 0

    def clock(self) -> float:
        return self.now

    def call(self) -> None:
        self.calls += 1
        self.queued += next(self.durations)

    def sync(self) -> None:
        self.syncs += 1
        self.now += self.queued
        self.queued = 0.0


def test_the_timer_takes_the_median_of_synchronised_repetitions_after_warm_up() -> None:
    # Two slow warm-up calls (a kernel compiling), one sizing call (5 ms: 4 calls make the 20 ms
    # of a repetition), then 3 repetitions of 4 calls: 5 ms, 6 ms and an outlier of 100 ms each.
    device = FakeDevice([1.0, 1.0, 0.005] + [0.005] * 4 + [0.006] * 4 + [0.1] * 4)
    timing = median_time(
        device.call, sync=device.sync, repeat=3, warmup=2, min_repetition_s=0.02, clock=device.clock
    )
    assert device.calls == 2 + 1 + 3 * 4
    assert timing.calls_per_repetition == 4
    assert timing.samples_s == pytest.approx([0.005, 0.006, 0.1])
    assert timing.median_s == pytest.approx(0.006)
    # Every repetition ends with the device synchronised: its work is inside the time.
    assert device.syncs >= 3 + 1 and device.queued == 0.0


def test_the_timer_sizes_a_repetition_within_bounds() -> None:
    slow = FakeDevice([0.5] * 10)  # slower than a repetition: one call each
    assert (
        median_time(slow.call, sync=slow.sync, repeat=2, warmup=0, clock=slow.clock).calls_per_repetition == 1
    )
    fast = FakeDevice([1e-7] * 1000)  # very fast: at most max_calls
    timing = median_time(fast.call, sync=fast.sync, repeat=2, warmup=0, max_calls=50, clock=fast.clock)
    assert timing.calls_per_repetition == 50 and timing.median_s == pytest.approx(1e-7)
    with pytest.raises(ValueError, match="repeat must be at least 1"):
        median_time(fast.call, sync=fast.sync, repeat=0, warmup=0)


def test_flops_are_counted_as_by_hand_and_as_the_kernel_benchmark_counts_them() -> None:
    import torch

    from mla_prefill_ext.bench.run import make_shape_problem

    # 2 sequences of 3 new tokens, each after 4 cached tokens in 2 chunks; qk 8+4, v 8, 2 heads.
    problem = make_shape_problem(BenchShape(2, 3, 4, 2), MLADims(8, 4, 8, 2), torch.float32, "cpu")
    pairs = 2 * (3 * 4 // 2 + 3 * 4)  # causal half of 3x3, plus 3 x 4 context, per sequence
    assert problem.flops() == 2 * 2 * (12 + 8) * pairs == 2880
    # scripts/bench/kernel.py counts each op on its own: the two add up to the step's.
    assert problem.flops(context=False) + problem.flops(new_tokens=False) == problem.flops()
    assert len(problem.chunk_k) == 2 and problem.q.shape == (6, 2, 12)


def test_the_timed_step_makes_the_calls_the_conventions_make() -> None:
    """The timed step (metadata prepared once) calls the backend as the conformance kit's step does."""
    import torch

    from mla_prefill_ext.bench.run import make_shape_problem, prepared_step
    from mla_prefill_ext.registry import MLAPrefillBackendEnum
    from mla_prefill_ext.testing.conventions.bridged import installed_vllm_convention

    class Recording(MLAPrefillBackendEnum.TORCH_SDPA.get_class()):  # type: ignore[misc]
        calls: ClassVar[list[str]] = []

        def prepare_metadata(self, prefill_metadata: Any) -> None:
            self.calls.append("prepare")
            super().prepare_metadata(prefill_metadata)

        def run_prefill_new_tokens(self, q: Any, k: Any, v: Any, return_softmax_lse: bool, **kw: Any) -> Any:
            self.calls.append(f"new lse={return_softmax_lse}")
            return super().run_prefill_new_tokens(q, k, v, return_softmax_lse, **kw)

        def run_prefill_context_chunk(self, *args: Any, **kw: Any) -> Any:
            self.calls.append("chunk")
            return super().run_prefill_context_chunk(*args, **kw)

    convention = installed_vllm_convention()
    dims = MLADims(8, 4, 8, 2)
    kwargs = dict(
        num_heads=2, scale=0.3, kv_lora_rank=512, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8
    )
    for shape, expected in (
        (BenchShape(2, 3), ["new lse=False"]),
        (BenchShape(2, 3, 4, 2), ["new lse=True", "chunk", "chunk"]),
    ):
        problem = make_shape_problem(shape, dims, torch.float32, "cpu")
        backend = convention.construct(Recording, {**kwargs, "vllm_config": None})
        Recording.calls.clear()
        step = prepared_step(convention, backend, problem)
        # Prepared once, before the timed calls (through the bridge on vLLM 0.29+, the adapter
        # also prepares one clone per context chunk then), and never again in a step.
        prepared = list(Recording.calls)
        step()
        step()
        assert prepared and set(prepared) == {"prepare"}, Recording.calls
        assert Recording.calls[len(prepared) :] == expected * 2, Recording.calls


def test_shapes_and_dims_parse() -> None:
    assert parse_shapes("small") == list(SHAPE_SETS["small"])
    assert parse_shapes("1x4096, 8x2048+2048, 4x1024+8192/2, 1x4096") == [
        BenchShape(1, 4096),
        BenchShape(8, 2048, 2048, 1),
        BenchShape(4, 1024, 8192, 2),
    ]
    assert [s.label for s in parse_shapes("4x1024+8192/2,8x2048+2048")] == ["4x1024+8192/2", "8x2048+2048"]
    default = SHAPE_SETS["default"]
    assert {s.seqs for s in default} == {1, 8, 32, 64} and any(s.context for s in default)
    assert min(s.tokens for s in default) == 1024 and max(s.tokens for s in default) == 32768
    for bad in ("huge", "0x128", "1x0", "4x64+2/3", "1x64+", "x64"):
        with pytest.raises(ValueError):
            parse_shapes(bad)
    assert parse_dims("r1") == MLADims(128, 64, 128, 16, "r1")
    assert parse_dims("64,32,64,8") == MLADims(64, 32, 64, 8)
    for bad in ("128,64,128", "0,1,1,1", "r2"):
        with pytest.raises(ValueError, match="qk_nope,qk_rope,v,heads"):
            parse_dims(bad)


# scripts/bench/kernel.py's grid (its plumbing, on the CPU)


def test_kernel_grid_takes_the_shapes_and_heads_asked_for() -> None:
    """--shapes / --heads: kernel.py on bench's shapes only, one head count."""
    from scripts.bench.kernel import kernel_grid, parse_grid_shapes

    shapes = parse_grid_shapes("1x1024,8x2048")
    grid = kernel_grid(False, "cuda", "r1", shapes, (16,))
    assert [(c["heads"], len(c["new"]), c["new"][0], c["ctx"]) for c in grid] == [
        (16, 1, 1024, [1024]),
        (16, 8, 2048, [2048] * 8),
    ]
    assert len(kernel_grid(False, "cuda", "r1")) == 20  # the default grid: 10 shapes, 16 and 128 heads
    for bad in ("8x", "0x128", "2048"):
        with pytest.raises(ValueError, match="SEQSxNEW"):
            parse_grid_shapes(bad)
