#!/usr/bin/env python3
"""``mla-prefill-ext bench`` next to the kernel benchmark: one backend and shape, the two times.

    python -m scripts.bench bench_vs_kernel --bench bench.json --kernel bench-kernel.json
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
        if shape["context_tokens"] == 0:
            ops = ["new_tokens"]
        elif shape["context_tokens"] == shape["new_tokens"] and shape["chunks"] == 1:
            # The step asks for the new tokens' LSE (to merge the context's result with it).
            with_lse = (row["backend"], "new_tokens_lse", dims, heads, key) in times
            ops = ["new_tokens_lse" if with_lse else "new_tokens", "context_chunk"]
        else:
            continue  # kernel.py has no such shape
        found = [times.get((row["backend"], op, dims, heads, key)) for op in ops]
        if None in found:
            continue
        kernel_ms = sum(found)  # type: ignore[arg-type]
        ratio = row["time_ms"] / kernel_ms
        out.append(
            {
                "backend": row["backend"],
                "shape": row["shape"],
                "heads": heads,
                "bench_ms": row["time_ms"],
                "kernel_ms": kernel_ms,
                "kernel_ops": ops,
                "lse_left_out": ops[0] == "new_tokens" and len(ops) > 1,
                "ratio": ratio,
                "within_tolerance": abs(ratio - 1) <= tolerance,
            }
        )
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
    parser.add_argument("--bench", required=True, help="mla-prefill-ext bench --json's output")
    parser.add_argument("--kernel", required=True, help="kernel.py --json's output")
    parser.add_argument("--tolerance", type=float, default=0.05, help="largest |ratio - 1| accepted")
    parser.add_argument("--json", help="write the pairs here")
    parser.add_argument("--markdown", help="write the pairs as a Markdown table here")
    args = parser.parse_args(argv)
    bench = json.loads(Path(args.bench).read_text())
    kernel = json.loads(Path(args.kernel).read_text())
    rows = pairs(bench, kernel, args.tolerance)
    table = markdown(rows, args.tolerance)
    print(table, end="")
    if args.markdown:
        Path(args.markdown).write_text(table)
    common.write_json(args.json, {"command": " ".join(sys.argv), "tolerance": args.tolerance, "pairs": rows})
    outside = [r for r in rows if not r["within_tolerance"]]
    print(f"{len(rows)} pairs, {len(outside)} outside {args.tolerance:.0%}", file=sys.stderr)
    return 1 if outside or not rows else 0


if __name__ == "__main__":  # python -m scripts.bench bench_vs_kernel is the documented form
    sys.exit(main())
