"""The engine benchmark's tables from a recorded run: arrivals, every stock lifetime, pauses.

    python -m scripts.bench shared_prefix_steps RUN.json [RUN2.json ...]

For each run (``shared_prefix_engine --trace-arrivals --json RUN.json``): the timed calls by how their
requests arrived (one step or split), per point and side, count and median seconds; then the calls
split in two, per point and side: how many, the first step's requests, when it began, each of the two
steps' ms and the call's seconds (medians; ``shared_prefix_table.step_table`` says what a step's time
holds). Runs recorded before the second table existed get it here; a compact record (its traces
dropped) shows the tables it stored. Then, from the raw seconds every record keeps, where the run had two
or more stock lifetimes each side against every stock lifetime (``shared_prefix_table.lifetime_table``),
and where it had pause sides each against its host (``shared_prefix_table.pause_table``). A run's JSON
is read as it is (gzipped too).
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path
from typing import Any

from . import shared_prefix_table
from .common import parser
from .shared_prefix_table import comparison_lines, split_table, step_table


def load(path: Path) -> dict[str, Any]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def tables(run: dict[str, Any]) -> list[str]:
    """Both tables of one run, as printed lines: made from its arrival traces, or as the run stored
    them where the traces were dropped (a compact record); a line saying so when it has neither."""
    traces = run.get("arrival_traces") or []
    if not traces:
        stored_split, stored_steps = run.get("by_arrival_split") or [], run.get("split_steps") or []
        if not stored_split:
            return ["no arrival traces in this run (it ran without --trace-arrivals, or they were dropped)"]
        lines = ["calls by arrival (count: median s), as stored", *stored_split]
        if stored_steps:
            lines += ["calls split in two, their steps (medians), as stored", *stored_steps]
        return lines
    sides = [s["label"] if isinstance(s, dict) else s for s in run.get("sides", [])]
    sides = sides or sorted({t["side"] for t in traces})
    lines = ["calls by arrival (count: median s)", *split_table(traces, sides)]
    split_steps = step_table(traces, sides)
    if split_steps:
        lines += ["calls split in two, their steps (medians)", *split_steps]
    return lines


def comparisons(run: dict[str, Any]) -> list[str]:
    """From the run's raw seconds: each side against every stock lifetime (with two or more), and each
    pause side against its host side (``shared_prefix_table.comparisons``)."""
    return comparison_lines(shared_prefix_table.comparisons(run.get("seconds") or {}, run.get("sides") or []))


def main(argv: list[str]) -> int:
    cli = parser(__doc__)
    cli.add_argument("runs", nargs="+", type=Path, help="shared_prefix_engine JSON files")
    args: argparse.Namespace = cli.parse_args(argv)
    for path in args.runs:
        print(f"# {path}")
        run = load(path)
        print("\n".join(tables(run) + comparisons(run)))
    return 0
