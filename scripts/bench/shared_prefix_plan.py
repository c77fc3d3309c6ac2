#!/usr/bin/env python3
"""Host time of finding a step's shared prefixes and planning its context, on the CPU.

    python -m scripts.bench shared_prefix_plan [--repeats 20] [--json out.json]

What the shared-prefix path adds once per step (in the metadata builder, never per layer):
``find_shared_prefixes`` over the host copy of the prefill requests' block-table rows, and
``plan_context`` (groups, then the shared segments' and private remainders' workspace passes).
Each of 16 to 256 prefill requests has 32k tokens of cached context, in three layouts: all
requests share a 30k prefix (2k private each); four families of requests, each sharing its own
30k prefix; no sharing at all. Block sizes 16 and 64, a 64k-row workspace (vLLM's cap), block
tables 8k blocks wide. Medians and maxima over ``--repeats`` runs, timed with
``time.perf_counter``.
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np

from mla_prefill_ext.shared_prefix.groups import find_shared_prefixes
from mla_prefill_ext.shared_prefix.plan import plan_context

from . import common

CONTEXT, SHARED, WORKSPACE, WIDTH = 32768, 30720, 65536, 8192
LAYOUTS = {"one shared prefix": 1, "four families": 4, "no sharing": 0}


def step(requests: int, block_size: int, families: int, rng: np.random.Generator) -> np.ndarray:
    """Block-table rows: each family's prefix blocks, then blocks of each request's own."""
    shared, total = SHARED // block_size, CONTEXT // block_size
    ids = iter(rng.permutation(requests * total + families * shared + 1).astype(np.int32))
    prefixes = [np.array([next(ids) for _ in range(shared)], dtype=np.int32) for _ in range(families)]
    table = np.zeros((requests, WIDTH), dtype=np.int32)
    for r in range(requests):
        own = [next(ids) for _ in range(total - (shared if families else 0))]
        row = np.concatenate([prefixes[r % families], own]) if families else np.array(own)
        table[r, :total] = row
    return table


def timed(fn, args: tuple, repeats: int) -> tuple[float, float]:
    us = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        us.append((time.perf_counter() - start) * 1e6)
    return statistics.median(us), max(us)


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(__doc__)
    parser.add_argument("--repeats", type=int, default=20, help="timed runs per case")
    parser.add_argument("--requests", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    rows = []
    print("| requests | block size | layout | groups | find: median (max) us | plan: median (max) us |")
    print("| --- | --- | --- | --- | --- | --- |")
    for requests in args.requests:
        for block_size in (16, 64):
            for layout, families in LAYOUTS.items():
                table = step(requests, block_size, families, rng)
                ctx = np.full(requests, CONTEXT, dtype=np.int64)
                loc = np.arange(requests + 1, dtype=np.int64) * 128
                groups = find_shared_prefixes(table, ctx, block_size)
                find = timed(find_shared_prefixes, (table, ctx, block_size), args.repeats)
                plan = timed(plan_context, (table, ctx, loc, block_size, WORKSPACE), args.repeats)
                row = {
                    "requests": requests,
                    "block_size": block_size,
                    "layout": layout,
                    "groups": len(groups),
                    "find_median_us": find[0],
                    "find_max_us": find[1],
                    "plan_median_us": plan[0],
                    "plan_max_us": plan[1],
                }
                rows.append(row)
                print(
                    f"| {requests} | {block_size} | {layout} | {len(groups)} | "
                    f"{find[0]:.0f} ({find[1]:.0f}) | {plan[0]:.0f} ({plan[1]:.0f}) |",
                    flush=True,
                )
    common.write_json(args.json, common.record(shared_prefix_plan=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
