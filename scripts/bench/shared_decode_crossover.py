"""Where the shared-prefix decode pays, one R1 layer: vLLM's decode against the path's over a grid (GPU).

    python -m scripts.bench shared_decode_crossover [--requests 32,48,64,96,128] [--prefix 8192,16384,32768]
        [--private 0,256] [--shared-splits 0] [--repeats 30] [--json out.json]

Each point, B requests over a cached P-token prefix with S cached tokens of their own and one new token
each, times ``absorbed`` (vLLM's FA3 decode: one block-table row per request) and ``shared_absorbed`` (the
path's: one call of all B queries over the prefix's pages, one over each request's own pages, vLLM's
merge), as ``shared_prefix_layer`` does, all in one process. Then, per prefix length, the fewest requests
from which the shared call is faster at every S measured and at every larger B measured: what the path's
``DecodeCrossover`` takes (``min_members`` for ``min_shared_tokens``). A prefix length where no such B was
measured stays on vLLM's decode. ``--shared-splits``: FA3's split of the prefix call's keys (0: its
heuristic). Results: docs/benchmarks.md, "Decode over a shared prefix".
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Sequence
from typing import Any

from . import common
from .shared_prefix_case import make_case
from .shared_prefix_decode_path import prepare_absorbed, prepare_shared_absorbed
from .shared_prefix_layer import timed
from .shared_prefix_workload import parse_ints
from .sides import markdown_table


def measure(
    requests: int,
    prefix: int,
    private: int,
    device: Any,
    repeats: int,
    shared_splits: int = 0,
    time_it: Callable[[Callable[[], Any], int], float] = timed,
    attention: Callable | None = None,
    merge: Callable | None = None,
) -> dict[str, Any]:
    """One point: both sides' median ms and how far apart their outputs are (``attention``, ``merge``:
    reference kernels on a CPU; None: vLLM's, on a GPU)."""
    case = make_case(requests, prefix, private, 1, device)
    absorbed = prepare_absorbed(case, device, attention=attention)
    shared = prepare_shared_absorbed(case, device, num_splits=shared_splits, attention=attention, merge=merge)
    times = {"absorbed_ms": time_it(absorbed, repeats), "shared_absorbed_ms": time_it(shared, repeats)}
    diff = (absorbed().float() - shared().float()).abs().max().item()
    ratio = times["absorbed_ms"] / times["shared_absorbed_ms"]
    return dict(requests=requests, prefix=prefix, private=private, **times, ratio=ratio, max_out_diff=diff)


def crossover(points: Sequence[dict[str, Any]]) -> dict[int, int | None]:
    """Per prefix length: the fewest requests from which every point measured (every S, every larger B)
    has the shared call faster; None where there is no such B."""
    out: dict[int, int | None] = {}
    for prefix in sorted({p["prefix"] for p in points}):
        mine = [p for p in points if p["prefix"] == prefix]
        wins = {
            b: all(p["ratio"] > 1 for p in mine if p["requests"] == b) for b in {p["requests"] for p in mine}
        }
        from_here = [b for b in sorted(wins) if all(wins[c] for c in wins if c >= b)]
        out[prefix] = from_here[0] if from_here else None
    return out


def crossover_lines(table: dict[int, int | None]) -> list[str]:
    rows = [[str(p), "never measured faster" if b is None else str(b)] for p, b in table.items()]
    return markdown_table(["prefix tokens", "the shared call from (requests)"], rows)


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(__doc__)
    parser.add_argument("--requests", type=parse_ints, default=parse_ints("32,48,64,96,128"))
    parser.add_argument("--prefix", type=parse_ints, default=parse_ints("8192,16384,32768"))
    parser.add_argument("--private", type=lambda t: parse_ints(t, minimum=0), default=[0, 256])
    parser.add_argument(
        "--shared-splits", type=int, default=0, help="the prefix call's num_splits (0: FA3's)"
    )
    parser.add_argument("--repeats", type=int, default=30, help="timed calls per side (median)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    import torch

    device = torch.device("cuda")
    points, rows = [], []
    columns = ["B", "P", "S", "absorbed ms", "shared_absorbed ms", "ratio", "max diff"]
    for b, p, s in itertools.product(args.requests, args.prefix, args.private):
        point = measure(b, p, s, device, args.repeats, args.shared_splits)
        points.append(point)
        rows.append(
            [str(b), str(p), str(s), *(f"{point[k]:.3f}" for k in ("absorbed_ms", "shared_absorbed_ms"))]
        )
        rows[-1] += [f"{point['ratio']:.2f}", f"{point['max_out_diff']:.5f}"]
        common.stamp(" ".join(rows[-1]))
        torch.cuda.empty_cache()
    print("\n".join(markdown_table(columns, rows)), flush=True)
    table = crossover(points)
    print("\n".join(crossover_lines(table)), flush=True)
    common.write_json(args.json, common.record(points=points, crossover=table, config=vars(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
