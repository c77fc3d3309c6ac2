"""``bench_vs_kernel --live``: bench and the kernel benchmark measured in one process, taking turns.

Two runs minutes apart cannot show that the two agree for a backend whose time drifts between
runs by more than the tolerance (TORCH_SDPA loops over sequences in Python: its time follows the
host). Here, for each backend and shape, each side builds its work with its own code, then the two
take turns round by round, so that host and GPU drift reach both alike:

- bench: ``mla_prefill_ext.bench.run``'s step (built as ``mla-prefill-ext bench`` builds it, its
  first step checked call by call), warmed up and sized as ``median_time`` does it; a round is one
  of its repetitions (``time_repetition``);
- the kernel benchmark: ``kernel.py``'s case, backend and ops (``case_problem``, ``backend_ops``),
  each op warmed up and sized by ``launches_per_round``; a round is one ``measure`` of each op the
  pair needs, its launches per round as kernel.py's (its bare-kernel side is not timed: the pair
  compares the backend's figure, ``backend_ms``).

Pairs as the file mode pairs them (:func:`scripts.bench.bench_vs_kernel.kernel_ops`): a step without
context against new_tokens; a step with one context chunk as long as its new tokens against
new_tokens_lse plus context_chunk (their sum in each round). Each side's figure is the median of its
rounds; every round's time is in the JSON, so a drift shows.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from typing import Any

from mla_prefill_ext.bench.spec import BenchShape, MLADims, parse_shapes

from .bench_vs_kernel import kernel_ops, pair

DEFAULT_BACKENDS = "FLASH_ATTN,FLASHINFER,TORCH_SDPA"
# The interleaved record's shapes (docs/benchmarks.md, section 9): every kind of step both time.
DEFAULT_SHAPES = "1x1024,1x8192,8x2048,32x512,64x128,8x2048+2048,64x128+128"
DEFAULT_ROUNDS = 15


def live_shapes(text: str) -> list[BenchShape]:
    """bench's shape specs, each one kernel.py has (ValueError otherwise)."""
    shapes = parse_shapes(text)
    for s in shapes:
        if kernel_ops(s.new, s.context, s.chunks, with_lse=True) is None:
            raise ValueError(
                f"{s.label}: the kernel benchmark has no such step (it times new tokens alone, or after "
                "one context chunk as long as them: SEQSxNEW or SEQSxNEW+NEW)"
            )
    return shapes


def live_pair(
    backend: str,
    shape: BenchShape,
    heads: int,
    bench_s: list[float],
    kernel_s: dict[str, list[float]],
    tolerance: float,
) -> dict[str, Any]:
    """One backend and shape from its rounds: each side's median (the kernel side's ops summed per round)."""
    ops = list(kernel_s)
    kernel_rounds = [sum(per_op) for per_op in zip(*kernel_s.values(), strict=True)]
    row = pair(
        backend,
        shape.label,
        heads,
        statistics.median(bench_s) * 1e3,
        statistics.median(kernel_rounds) * 1e3,
        ops,
        tolerance,
    )
    row["bench_rounds_ms"] = [t * 1e3 for t in bench_s]
    row["kernel_rounds_ms"] = [t * 1e3 for t in kernel_rounds]
    row["kernel_op_rounds_ms"] = {op: [t * 1e3 for t in s] for op, s in kernel_s.items()}
    return row


def take_turns(
    bench_repetition: Callable[[], float], kernel_rounds: dict[str, Callable[[], float]], rounds: int
) -> tuple[list[float], dict[str, list[float]]]:
    """``rounds`` rounds, each one bench repetition then one kernel.py round of each op: seconds per call."""
    bench_s: list[float] = []
    kernel_s: dict[str, list[float]] = {op: [] for op in kernel_rounds}
    for _ in range(rounds):
        bench_s.append(bench_repetition())
        for op, measure in kernel_rounds.items():
            kernel_s[op].append(measure())
    return bench_s, kernel_s


def measure_pair(
    cls: type,
    shape: BenchShape,
    dims: MLADims,
    device: str,
    convention: Any,
    bench_problem: Any,
    kernel_inputs: tuple[dict[str, Any], Any, tuple],
    rounds: int,
) -> tuple[list[float], dict[str, list[float]], dict[str, Any]] | str:
    """One backend on one shape, both sides built with their own code: the rounds, or bench's error."""
    from mla_prefill_ext.bench import run, timing
    from mla_prefill_ext.cli.bench import DEFAULT_BENCH_WARMUP

    from . import kernel

    step, error = run.step_to_time(cls, bench_problem, dims, convention)
    if step is None:
        return f"bench: {error}"
    sync = run.device_sync(bench_problem)
    calls = timing.size_repetition(step, sync=sync, warmup=run.timed_warmup(DEFAULT_BENCH_WARMUP))

    case, p, chunk = kernel_inputs
    measure = kernel.launch_timer(device)
    _, ours = kernel.backend_ops(cls, case, p, chunk)
    ops = kernel_ops(shape.new, shape.context, shape.chunks, with_lse=True) or []
    launches = {op: kernel.launches_per_round({"backend": ours[op]}, measure, device) for op in ops}

    bench_s, kernel_s = take_turns(
        lambda: timing.time_repetition(step, sync=sync, calls=calls),
        {op: (lambda op=op: measure(ours[op], launches[op])) for op in ops},
        rounds,
    )
    return bench_s, kernel_s, {"bench_calls_per_repetition": calls, "kernel_launches_per_round": launches}


def measure_live(
    backends: dict[str, type],
    shapes: list[BenchShape],
    dims: MLADims,
    device: str,
    rounds: int,
    tolerance: float,
    progress: Callable[[str], None] = lambda _: None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every backend on every shape: the pairs, and the (backend, shape) that raised."""
    import torch

    from mla_prefill_ext.bench.run import describe_error, make_shape_problem
    from mla_prefill_ext.testing.conventions.bridged import installed_vllm_convention

    from . import kernel

    convention = installed_vllm_convention()
    pairs: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    total, done = len(backends) * len(shapes), 0
    for shape in shapes:
        # Each side's inputs, as each builds them: bench's step and kernel.py's case (whose
        # problem always has its context chunk, timed or not).
        case = kernel.grid_case(tuple(dims[:3]), dims.num_heads, shape.new_lens())
        try:
            bench_problem = make_shape_problem(shape, dims, torch.bfloat16, device, seed=0)
            p, chunk, _, _ = kernel.case_problem(case, device)
        except Exception as e:  # e.g. out of memory: every backend's result on this shape
            errors += [
                {"backend": n, "shape": shape.label, "error": f"the inputs: {describe_error(e)}"}
                for n in backends
            ]
            done += len(backends)
            continue
        for name, cls in backends.items():
            done += 1
            inputs = (case, p, chunk)
            try:
                got = measure_pair(cls, shape, dims, device, convention, bench_problem, inputs, rounds)
            except Exception as e:  # a side that raises on this shape: reported, never a pair
                got = describe_error(e)
            if isinstance(got, str):
                errors.append({"backend": name, "shape": shape.label, "error": got})
                progress(f"[{done}/{total}] {name} on {shape.label}: error: {got}")
                continue
            bench_s, kernel_s, sizes = got
            row = live_pair(name, shape, dims.num_heads, bench_s, kernel_s, tolerance)
            row.update(sizes)
            pairs.append(row)
            progress(
                f"[{done}/{total}] {name} on {shape.label}: bench {row['bench_ms']:.3f} ms, kernel.py "
                f"{row['kernel_ms']:.3f} ms, ratio {row['ratio']:.3f}"
            )
        bench_problem = p = chunk = None  # free this shape's tensors before the next one
        if device == "cuda":
            torch.cuda.empty_cache()
    return pairs, errors


def resolve_backends(names: list[str], device: str, dims: MLADims) -> tuple[dict[str, type], dict[str, str]]:
    """Each named backend's class where it can serve here (bench's checks); why each other cannot."""
    import torch

    from mla_prefill_ext.registry import lookup
    from mla_prefill_ext.selector import MLAPrefillSelectorConfig, check_backend, current_device_capability

    capability = current_device_capability() if device == "cuda" else None
    config = MLAPrefillSelectorConfig.from_dims(torch.bfloat16, *dims[:3])
    classes: dict[str, type] = {}
    left_out: dict[str, str] = {}
    for name in names:
        try:
            member = lookup(name)
        except ValueError as e:
            left_out[name] = str(e)
            continue
        cls, reasons = check_backend(member, capability, config)
        if cls is None or reasons:
            left_out[member.name] = "; ".join(reasons)
        else:
            classes[member.name] = cls
    return classes, left_out


def progress_line(text: str) -> None:
    print(f"bench_vs_kernel --live: {text}", file=sys.stderr, flush=True)
