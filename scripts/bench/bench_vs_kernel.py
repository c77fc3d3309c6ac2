#!/usr/bin/env python3
"""``mla-prefill-ext bench`` next to the kernel benchmark: one backend and shape, the two times.

    python -m scripts.bench bench_vs_kernel --bench bench.json --kernel bench-kernel.json
        [--tolerance 0.05] [--json out.json] [--markdown out.md]
    python -m scripts.bench bench_vs_kernel --live [--backends FLASH_ATTN,FLASHINFER,TORCH_SDPA]
        [--shapes 1x1024,...,64x128+128] [--dims r1] [--rounds 15] [--device cuda|cpu]
        [--tolerance 0.05] [--json out.json] [--markdown out.md]

``--bench``: what ``mla-prefill-ext bench --json`` printed; ``--kernel``: kernel.py's ``--json``.
Each backend and shape both measured is a pair: a bench step without context against kernel.py's
new_tokens row (same backend, head dims, heads and shape); a step with context in one chunk as long
as the new tokens (kernel.py's shapes) against kernel.py's new_tokens_lse (``kernel --with-lse``:
the new tokens with their LSE, as that step calls them) plus context_chunk. A kernel.py record
without new_tokens_lse pairs its new_tokens instead, marked ``lse_left_out`` (the step's LSE is not
in kernel.py's figure). Only bench's bfloat16 runs are paired (kernel.py times bfloat16). The ratio
is bench's time over kernel.py's; a pair further from 1 than the tolerance is flagged, and the exit
code is 1 when one is. Runs on any machine: nothing is measured.

``--live`` measures instead, in this process: for each backend and shape (bench's shape specs, each
one kernel.py has; default: the 7 of the interleaved record, R1's dims with 16 heads), each side
builds its work with its own code (bench's step, kernel.py's case and ops), then one bench
repetition and one kernel.py round (of each op the pair needs) take turns for ``--rounds`` rounds,
so that host and GPU drift reach both alike; each side's figure is the median of its rounds, every
round's time is in the JSON. Paired as above (bfloat16, the new tokens' LSE in). Exit code 1 when a
pair is outside the tolerance, a backend cannot serve here or a side raised. See
``bench_vs_kernel_live.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from . import common


def _kernel_times(kernel: dict[str, Any]) -> dict[tuple, float]:
    """kernel.py's backend time per (backend, op, dims, heads, shape), in ms (rows with an error left out)."""
    return {
        (r["backend"], r["op"], tuple(r["dims"]), r["heads"], r["shape"]): r["backend_ms"]
        for r in kernel["kernel"]
        if "error" not in r
    }


def kernel_ops(new_tokens: int, context_tokens: int, chunks: int, with_lse: bool) -> list[str] | None:
    """kernel.py's ops whose times add up to a bench step of this shape; None: kernel.py has no such shape.

    A step without context is kernel.py's new_tokens; a step with one context chunk as long as its new
    tokens (kernel.py's cases) is its new tokens with their LSE (the step asks for it, to merge the
    context's result with it) plus the context chunk; ``with_lse`` False: the new tokens without it.
    """
    if context_tokens == 0:
        return ["new_tokens"]
    if context_tokens == new_tokens and chunks == 1:
        return ["new_tokens_lse" if with_lse else "new_tokens", "context_chunk"]
    return None


def pair(
    backend: str, shape: str, heads: int, bench_ms: float, kernel_ms: float, ops: list[str], tolerance: float
) -> dict[str, Any]:
    """One backend and shape: the two times, their ratio and whether it is within ``tolerance`` of 1."""
    ratio = bench_ms / kernel_ms
    return {
        "backend": backend,
        "shape": shape,
        "heads": heads,
        "bench_ms": bench_ms,
        "kernel_ms": kernel_ms,
        "kernel_ops": ops,
        "lse_left_out": ops[0] == "new_tokens" and len(ops) > 1,
        "ratio": ratio,
        "within_tolerance": abs(ratio - 1) <= tolerance,
    }


def pairs(bench: dict[str, Any], kernel: dict[str, Any], tolerance: float) -> list[dict[str, Any]]:
    """Every (backend, shape) both benchmarks timed, with the two times and their ratio."""
    d = bench["dims"]
    dims, heads = (d["qk_nope_head_dim"], d["qk_rope_head_dim"], d["v_head_dim"]), d["num_heads"]
    shapes = {s["label"]: s for s in bench["shapes"]}
    times = _kernel_times(kernel)
    out: list[dict[str, Any]] = []
    if bench.get("dtype", "bfloat16") != "bfloat16":
        return out  # kernel.py's inputs are bfloat16: no pair is the same step
    for row in bench["results"]:
        shape = shapes[row["shape"]]
        if row["time_ms"] is None:
            continue
        key = f"{shape['seqs']}x{shape['new_tokens']}"
        with_lse = (row["backend"], "new_tokens_lse", dims, heads, key) in times
        ops = kernel_ops(shape["new_tokens"], shape["context_tokens"], shape["chunks"], with_lse)
        if ops is None:
            continue  # kernel.py has no such shape
        found = [times.get((row["backend"], op, dims, heads, key)) for op in ops]
        if None in found:
            continue
        kernel_ms = sum(found)  # type: ignore[arg-type]
        out.append(pair(row["backend"], row["shape"], heads, row["time_ms"], kernel_ms, ops, tolerance))
    return out


def markdown(rows: list[dict[str, Any]], tolerance: float) -> str:
    lines = [
        "| backend | shape | heads | bench ms | kernel.py ms | kernel.py ops | ratio "
        f"| within {tolerance:.0%} |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['backend']} | {r['shape']} | {r['heads']} | {r['bench_ms']:.3f} | {r['kernel_ms']:.3f} "
            f"| {' + '.join(r['kernel_ops'])} | {r['ratio']:.3f} "
            f"| {'yes' if r['within_tolerance'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(__doc__)
    parser.add_argument("--bench", help="mla-prefill-ext bench --json's output")
    parser.add_argument("--kernel", help="kernel.py --json's output")
    parser.add_argument("--tolerance", type=float, default=0.05, help="largest |ratio - 1| accepted")
    parser.add_argument("--json", help="write the pairs here")
    parser.add_argument("--markdown", help="write the pairs as a Markdown table here")
    live = parser.add_argument_group("--live: both measured in this process, taking turns")
    live.add_argument("--live", action="store_true", help="measure both here instead of reading two runs")
    live.add_argument("--backends", help="comma-separated (default: FLASH_ATTN,FLASHINFER,TORCH_SDPA)")
    live.add_argument("--shapes", help="bench's SEQSxNEW or SEQSxNEW+NEW specs, comma-separated")
    live.add_argument("--dims", help="bench's --dims: a preset or NOPE,ROPE,V,HEADS (r1)")
    live.add_argument("--rounds", type=int, help="rounds of turns per backend and shape (default: 15)")
    live.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when there is a GPU")
    args = parser.parse_args(argv)
    if args.live:
        if args.bench or args.kernel:
            parser.error("--live measures both here: leave out --bench and --kernel")
        return main_live(parser, args)
    live_only = [
        f"--{a}" for a in ("backends", "shapes", "dims", "rounds", "device") if getattr(args, a) is not None
    ]
    if live_only:
        parser.error(f"{', '.join(live_only)}: only with --live")
    if not (args.bench and args.kernel):
        parser.error("--bench and --kernel are required (or --live)")
    bench = json.loads(Path(args.bench).read_text())
    kernel = json.loads(Path(args.kernel).read_text())
    rows = pairs(bench, kernel, args.tolerance)
    return report(rows, args.tolerance, args.markdown, args.json, {})


def report(
    rows: list[dict[str, Any]], tolerance: float, md_path: str | None, json_path: str | None, extra: dict
) -> int:
    """Print and write the pairs; the exit code (1: a pair outside the tolerance, an error, or no pair)."""
    table = markdown(rows, tolerance)
    print(table, end="")
    if md_path:
        Path(md_path).write_text(table)
    record = {"command": " ".join(sys.argv), **extra, "tolerance": tolerance, "pairs": rows}
    common.write_json(json_path, record)
    outside = [r for r in rows if not r["within_tolerance"]]
    summary = f"{len(rows)} pairs, {len(outside)} outside {tolerance:.0%}"
    errors, left_out = extra.get("errors", []), extra.get("backends_left_out", {})
    if errors or left_out:
        summary += f"; {len(errors)} backend-shape errors, {len(left_out)} backends cannot serve here"
    print(summary, file=sys.stderr)
    return 1 if outside or errors or left_out or not rows else 0


def main_live(parser: Any, args: Any) -> int:
    import os

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    common.use_this_checkout()
    from mla_prefill_ext.bench.spec import parse_dims

    from . import bench_vs_kernel_live as live

    try:
        shapes = live.live_shapes(args.shapes or live.DEFAULT_SHAPES)
        dims = parse_dims(args.dims or "r1")
    except ValueError as e:
        parser.error(f"--shapes/--dims: {e}")
    rounds = live.DEFAULT_ROUNDS if args.rounds is None else args.rounds
    if rounds < 1:
        parser.error("--rounds: at least 1")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: PyTorch sees no CUDA GPU here")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    names = [n.strip() for n in (args.backends or live.DEFAULT_BACKENDS).split(",") if n.strip()]
    backends, left_out = live.resolve_backends(names, device, dims)
    for name, why in left_out.items():
        live.progress_line(f"{name} left out: {why}")
    progress = live.progress_line
    rows, errors = live.measure_live(backends, shapes, dims, device, rounds, args.tolerance, progress)
    for e in errors:
        print(f"error: {e['backend']} on {e['shape']}: {e['error']}", file=sys.stderr)
    extra = common.record(
        mode="live",
        device=device,
        dims=dict(
            zip(("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_heads"), dims[:4], strict=True)
        ),
        shapes=[s.label for s in shapes],
        rounds=rounds,
        backends=list(backends),
        backends_left_out=left_out,
        errors=errors,
    )
    extra.pop("command")
    return report(rows, args.tolerance, args.markdown, args.json, extra)


if __name__ == "__main__":  # python -m scripts.bench bench_vs_kernel is the documented form
    sys.exit(main())
