"""An engine benchmark run's JSON made small enough to keep under docs/results, the same way every time.

    python -m scripts.bench compact_record RUN.json[.gz] OUT.json.gz [--command "how it ran"]

``shared_prefix_engine --json`` writes everything a run saw: with ``--trace-arrivals`` each call's
requests and steps (hundreds of KB), each call's path counters and step shapes. A stored record keeps
what its tables and verdicts are made from and drops the rest, listing in its ``notes`` each thing
dropped and what summarizes it:

- ``arrival_traces``: dropped; ``by_arrival_split`` and ``split_steps`` (the run's tables of them) stay,
  made here from the traces if the run lacks them;
- ``path_steps`` (per call): summed per side and point into ``path_steps_summary`` (calls,
  steps_routed, steps_with_segments, gathered, blocks_reused, hits_reused, prompts_copied);
- ``table`` (the markdown's source), ``cached_tokens``, ``output_tokens``, and each engine's
  ``step_shapes`` in ``engines_after``: dropped;
- every float rounded to 6 decimals (seconds to the microsecond: the paired ratios and medians
  recompute from them), and the machine's paths made relative: the repository's root removed, the
  run's output folder written ``OUT/``.

``--command`` (optional): the command that made the run as the record's reader would type it (the
suite's part, say), put before the bench's own command line. Prints the record's size and the path
counters that were not zero. Compacting a compact record changes nothing.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shlex
from pathlib import Path
from typing import Any

from .common import parser
from .shared_prefix_steps import load
from .shared_prefix_table import split_table, step_table

PATH_COUNTERS = (
    "steps_routed",
    "steps_with_segments",
    "gathered",
    "blocks_reused",
    "hits_reused",
    "prompts_copied",
)
DROPPED = {
    "arrival_traces": "arrival_traces dropped for size; by_arrival_split and split_steps summarize them",
    "path_steps": (
        "path_steps (per call, the untimed first repetition included) dropped for size; "
        "path_steps_summary: their sums per side and point"
    ),
    "table": (
        "table (the markdown's source) dropped for size; markdown holds it, cache_as_planned each side's "
        "check that the prefix cache served what the point planned"
    ),
    "cached_tokens": "cached_tokens dropped for size",
    "output_tokens": "output_tokens dropped for size",
    "step_shapes": "engines_after: step_shapes dropped for size",
}
ROUNDED = "floats rounded to 6 decimals (seconds to the microsecond) for size"
DIGITS = 6


def _output_folder(command: str) -> str | None:
    """The folder the run's ``--json`` went to, as the command line names it."""
    words = shlex.split(command)
    for i, word in enumerate(words):
        if word == "--json" and i + 1 < len(words):
            return os.path.dirname(words[i + 1]) or None
        if word.startswith("--json="):
            return os.path.dirname(word.split("=", 1)[1]) or None
    return None


def _tidy(value: Any, replacements: list[tuple[re.Pattern[str], str]]) -> Any:
    if isinstance(value, float):
        return round(value, DIGITS)
    if isinstance(value, list):
        return [_tidy(v, replacements) for v in value]
    if isinstance(value, dict):
        return {k: _tidy(v, replacements) for k, v in value.items()}
    if isinstance(value, str):
        for pattern, new in replacements:
            value = pattern.sub(new, value)
    return value


def _path_prefix(folder: str) -> re.Pattern[str]:
    """``folder/`` where a path starts: at the string's start or after a space, ``=``, a quote or a
    bracket (not inside another path: ``out/`` is not replaced in ``layout/``)."""
    return re.compile(r"(?<![^\s=\"'(\[])" + re.escape(folder.rstrip("/") + "/"))


_SHAPE = re.compile(r"P=(\d+) B=(\d+) N=(\d+)")


def _ambiguous_shapes(points: list[str]) -> list[str]:
    """Points with the same requests and prompt length (older calls, which name only those, would
    be summed together)."""
    seen: dict[tuple[int, int], str] = {}
    clashes = []
    for point in points:
        m = _SHAPE.search(point)
        if not m:
            continue
        shape = (int(m.group(2)), int(m.group(1)) + int(m.group(3)))
        if shape in seen:
            clashes.append(f"{seen[shape]} / {point}")
        seen.setdefault(shape, point)
    return clashes


def path_steps_summary(path_steps: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Per ``"side | point"``: how many calls, and each path counter summed over them (runs from before
    calls named their point: ``"side | B requests x prompt_len tokens"``)."""
    summary: dict[str, dict[str, int]] = {}
    for call in path_steps:
        point = call.get("point") or f"{call.get('requests')} requests x {call.get('prompt_len')} tokens"
        entry = summary.setdefault(f"{call['side']} | {point}", dict.fromkeys(("calls", *PATH_COUNTERS), 0))
        entry["calls"] += 1
        for name in PATH_COUNTERS:
            entry[name] += int(call.get(name) or 0)
    return summary


def compact(run: dict[str, Any], command: str | None = None, root: str | None = None) -> dict[str, Any]:
    """``run`` as a stored record (a new dict; ``run`` is not changed)."""
    run = json.loads(json.dumps(run))
    notes: list[str] = list(run.get("notes") or [])
    traces = run.pop("arrival_traces", None)
    if traces:
        sides = [s["label"] if isinstance(s, dict) else s for s in run.get("sides", [])]
        run.setdefault("by_arrival_split", split_table(traces, sides))
        run.setdefault("split_steps", step_table(traces, sides))
    dropped = ["arrival_traces"] if traces is not None else []
    if "path_steps" in run:
        calls = run["path_steps"] or []
        clashes = _ambiguous_shapes([str(p) for p in run.get("points") or []])
        if clashes and any("point" not in call for call in calls):
            raise ValueError(
                "this run's calls do not name their point and points share a shape "
                f"({'; '.join(clashes)}): their path counters would be summed together"
            )
        run["path_steps_summary"] = path_steps_summary(run.pop("path_steps"))
        dropped.append("path_steps")
    if isinstance(run.get("table"), list):
        run["cache_as_planned"] = {
            row["key"]: {side: v.get("cache_as_planned") for side, v in (row.get("sides") or {}).items()}
            for row in run["table"]
            if isinstance(row, dict) and "key" in row
        }
    for key in ("table", "cached_tokens", "output_tokens"):
        if run.pop(key, None) is not None:
            dropped.append(key)
    engines_after = run.get("engines_after") or {}
    for engines in engines_after.values():
        for engine in engines if isinstance(engines, list) else [engines]:
            if isinstance(engine, dict) and engine.pop("step_shapes", None) is not None:
                if "step_shapes" not in dropped:
                    dropped.append("step_shapes")
    notes += [DROPPED[key] for key in dropped if DROPPED[key] not in notes]
    if ROUNDED not in notes:
        notes.append(ROUNDED)
    run["notes"] = notes
    replacements = []
    folder = _output_folder(run.get("command") or "")
    if folder and folder not in ("OUT", ".", "/"):
        replacements.append((_path_prefix(folder), "OUT/"))
    if root and root.rstrip("/"):
        replacements.append((_path_prefix(root), ""))
    if command and not (run.get("command") or "").startswith(command + "  # "):
        run["command"] = f"{command}  # {run.get('command', '')}"
    return _tidy(run, replacements)


def write(record: dict[str, Any], path: Path) -> int:
    """Gzipped (level 9, no timestamp: the same record gives the same bytes); its size in bytes."""
    data = gzip.compress(json.dumps(record, separators=(",", ":")).encode(), 9, mtime=0)
    path.write_bytes(data)
    return len(data)


def main(argv: list[str] | None = None) -> int:
    cli = parser(__doc__)
    cli.add_argument("run", type=Path, help="a shared_prefix_engine JSON (gzipped too)")
    cli.add_argument("out", type=Path, help="the compact record (.json.gz)")
    cli.add_argument("--command", help="how the run was made, as a reader would type it")
    args: argparse.Namespace = cli.parse_args(argv)
    record = compact(load(args.run), args.command, root=str(Path.cwd()))
    size = write(record, args.out)
    busy = {
        key: counts
        for key, counts in record.get("path_steps_summary", {}).items()
        if any(counts[name] for name in PATH_COUNTERS)
    }
    print(f"{args.out}: {size:,} bytes; path counters not zero: {busy or 'none'}")
    return 0
