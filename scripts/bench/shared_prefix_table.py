"""The shared-prefix engine benchmark's table: per point, each side's seconds and its paired ratio to stock.

Pure (no vLLM, no GPU). Repetition i of every side ran the same prompts back to back, so
``baseline_i / side_i`` is a paired ratio (above 1: the side is faster); a side's ratio is the
median of those, with their min and max.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from typing import Any

from .path_parts import PARTS
from .shared_prefix_workload import Point
from .sides import markdown_table

Raw = dict[str, dict[str, list[Any]]]  # side -> point key -> one value per timed repetition


def paired_ratio(baseline: Sequence[float], side: Sequence[float]) -> dict[str, Any]:
    """Median, min and max of ``baseline[i] / side[i]`` (repetition i of both ran the same prompts)."""
    if not baseline:
        raise ValueError("no repetitions to pair")
    ratios = [b / s for b, s in zip(baseline, side, strict=True)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "all": ratios}


def tabulate(
    points: Sequence[Point],
    sides: Sequence[str],
    baseline: str | None,
    seconds: Raw,
    out_tokens: Raw,
    cached: Raw,
) -> list[dict[str, Any]]:
    """One row per point with timed repetitions: each side's seconds (median, min, max), output tokens/s
    where a point generates more than one token, whether the prefix cache served what it should, and
    each other side's paired ratio to ``baseline`` (None or absent: no ratios)."""
    table = []
    for point in points:
        if not seconds[sides[0]].get(point.key):
            continue  # not reached (the run stopped first)
        row: dict[str, Any] = dict(key=point.key, scenario=point.scenario, prefix_len=point.prefix_len)
        row.update(batch=point.batch, new_tokens=point.new_tokens, max_tokens=point.max_tokens)
        row.update(reps=len(seconds[sides[0]][point.key]), sides={}, ratios={})
        for side in sides:
            times = seconds[side][point.key]
            cell: dict[str, Any] = dict(median_s=statistics.median(times), min_s=min(times), max_s=max(times))
            if point.max_tokens > 1:
                rates = [n / t for n, t in zip(out_tokens[side][point.key], times, strict=True)]
                cell["output_tokens_per_s"] = statistics.median(rates)
            hits = cached[side][point.key]
            cell["cached_tokens"] = sorted(set(hits), key=lambda v: (v is None, v))
            cell["cache_as_planned"] = None if None in hits else all(h == point.cached_tokens() for h in hits)
            row["sides"][side] = cell
            if baseline in seconds and side != baseline:
                row["ratios"][side] = paired_ratio(seconds[baseline][point.key], times)
        table.append(row)
    return table


def _seconds_cell(cell: dict[str, Any]) -> str:
    text = f"{cell['median_s']:.3f}"
    if "output_tokens_per_s" in cell:
        text += f" ({cell['output_tokens_per_s']:.0f} out tok/s)"
    return text


def markdown(table: Sequence[dict[str, Any]], sides: Sequence[str], baseline: str | None) -> list[str]:
    """The table in Markdown: seconds are medians; a ratio is ``median [min-max]`` of the paired ratios."""
    others = [s for s in sides if s != baseline] if baseline in sides else []
    columns = ["scenario", "P", "B", "N", *(f"{s} s" for s in sides), *(f"{s} x {baseline}" for s in others)]
    rows = []
    for row in table:
        n = f"{row['new_tokens']}" + (f" (+{row['max_tokens']} out)" if row["max_tokens"] > 1 else "")
        cells = [row["scenario"], str(row["prefix_len"]), str(row["batch"]), n]
        cells += [_seconds_cell(row["sides"][s]) for s in sides]
        for s in others:
            r = row["ratios"][s]
            cells.append(f"{r['median']:.3f} [{r['min']:.3f}-{r['max']:.3f}]")
        rows.append(cells)
    return markdown_table(columns, rows)


def _timed(seconds: Raw, side: str, key: str, reps: int) -> bool:
    """Whether ``side`` timed point ``key`` in each of the ``reps`` repetitions (pairs need as many)."""
    return len(seconds.get(side, {}).get(key) or ()) == reps > 0


def lifetime_table(seconds: Raw, sides: Sequence[str], stock: Sequence[str]) -> list[str]:
    """Each side against every stock lifetime, per point (Markdown; none with fewer than two stock
    lifetimes timed there): the stock lifetimes' paired medians among themselves (every ordered pair:
    what one configuration's lifetimes differ by in this run), then each other side's paired median
    against each stock lifetime, its lowest and highest, and how far its lowest lies below stock's own
    lowest. That last column is above 0 only for a side slower than every stock lifetime (were all
    engines alike, one side in k + 1 would be, with k stock lifetimes): 0 says the side is not the
    slowest, not that it equals stock. A ratio to the first stock engine alone carries that engine's
    own place in the spread. A side (a stock lifetime too) not timed in every repetition of a point is
    left out there."""
    stock = [s for s in stock if s in seconds]
    keys = list(dict.fromkeys(key for s in stock for key in seconds[s]))
    rows = []

    def median_vs(base: str, side: str, key: str) -> float:
        return paired_ratio(seconds[base][key], seconds[side][key])["median"]

    for key in keys:
        reps = max(len(seconds[s].get(key) or ()) for s in stock)  # one cut short is left out, not all
        timed = [s for s in stock if _timed(seconds, s, key, reps)]
        if len(timed) < 2:
            continue
        among = [median_vs(a, b, key) for a in timed for b in timed if a != b]
        floor = min(among)
        rows.append([key, "stock lifetimes among themselves", f"{floor:.3f}", f"{max(among):.3f}", "-"])
        for side in sides:
            if side in stock or not _timed(seconds, side, key, reps):
                continue
            ratios = [median_vs(base, side, key) for base in timed]
            below = max(0.0, floor - min(ratios))
            rows.append([key, side, f"{min(ratios):.3f}", f"{max(ratios):.3f}", f"{below:.3f}"])
    if not rows:
        return []
    columns = ["point", "side", "lowest vs a stock lifetime", "highest", "below stock's own lowest by"]
    return markdown_table(columns, rows)


def bootstrap_interval(values: Sequence[float], resamples: int, seed: str) -> tuple[float, float]:
    """A 95% percentile bootstrap interval of the median of ``values``: the 2.5th and 97.5th percentiles
    of the medians of ``resamples`` draws with replacement (seeded by ``seed``: the same record, the same
    interval, whatever else the table holds)."""
    if resamples < 40:
        raise ValueError(f"at least 40 resamples for a 95% interval, not {resamples}")
    rng = random.Random(seed)
    medians = [statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples)]
    cuts = statistics.quantiles(medians, n=40)  # 2.5% steps
    return cuts[0], cuts[-1]


def pause_table(
    seconds: Raw, hosts: dict[str, str], whole: dict[str, str] | None = None, resamples: int = 2000
) -> list[str]:
    """Each pause side against the side whose engine ran its calls (``hosts``: pause side -> host), per
    point (Markdown; none without pause sides): the paired ratio host seconds / pause seconds, median
    with a 95% bootstrap interval of that median (:func:`bootstrap_interval`), and its min-max. Above 1:
    the calls ran faster with those parts paused (what the parts cost in that one engine lifetime); the
    interval's width is what the run can resolve. ``whole`` (host -> its side with every part paused):
    each row's share of the whole path's gain, (paused - host) / (all paused - host) of median seconds."""
    rows = []
    whole = whole or {}
    keys = list(dict.fromkeys(key for pause in hosts for key in seconds.get(pause) or {}))
    for key in keys:
        for pause, host in hosts.items():
            times = (seconds.get(pause) or {}).get(key) or []
            if not times or not _timed(seconds, host, key, len(times)):
                continue
            ratios = [h / p for h, p in zip(seconds[host][key], times, strict=True)]
            low, high = bootstrap_interval(ratios, resamples, seed=f"{key}|{pause}")
            interval = f"{statistics.median(ratios):.3f} [{low:.3f}-{high:.3f}]"
            spread = f"{min(ratios):.3f}-{max(ratios):.3f}"
            rows.append(
                [
                    key,
                    f"{host} / {pause}",
                    str(len(ratios)),
                    interval,
                    spread,
                    _share(seconds, key, host, pause, whole),
                ]
            )
    if not rows:
        return []
    columns = [
        "point",
        "host / pause side",
        "pairs",
        "median [95% interval]",
        "min-max",
        "share of the path's gain",
    ]
    return markdown_table(columns, rows)


def _share(seconds: Raw, key: str, host: str, pause: str, whole: dict[str, str]) -> str:
    """``pause``'s share of the whole path's gain at ``key`` (:func:`pause_table`); "-" where the host has
    no side with every part paused timed there, or pausing everything gained nothing to share."""
    everything = (seconds.get(whole.get(host, "")) or {}).get(key) or []
    if not everything:
        return "-"
    on, paused, off = (statistics.median(seconds[s][key]) for s in (host, pause, whole[host]))
    return f"{100 * (paused - on) / (off - on):.0f}%" if off > on else "-"


COMPARISONS = {
    "against_stock_lifetimes": "against every stock lifetime (paired medians)",
    "pause_vs_host": "the path on / paused, in one engine lifetime",
}
"""The comparisons of a run's sides beyond the ratio to stock: the JSON key of each, and its title."""


def comparisons(seconds: Raw, sides: Sequence[dict[str, Any]]) -> dict[str, list[str]]:
    """A run's :data:`COMPARISONS` (each table's lines, empty where it has none), from its raw seconds and
    its sides as the run records them (``label``, ``backend``, ``engine``: the side whose engine ran a
    pause side's calls)."""
    labels = [s["label"] for s in sides]
    stock = [s["label"] for s in sides if s.get("backend") == "stock"]
    hosts = {s["label"]: s["engine"] for s in sides if s.get("engine")}
    whole = {
        s["engine"]: s["label"] for s in sides if s.get("engine") and set(s.get("pause") or ()) >= set(PARTS)
    }
    return {
        "against_stock_lifetimes": lifetime_table(seconds, labels, stock),
        "pause_vs_host": pause_table(seconds, hosts, whole),
    }


def comparison_lines(tables: dict[str, list[str]]) -> list[str]:
    """The non-empty tables of :func:`comparisons`, each under its title."""
    return [line for key, lines in tables.items() if lines for line in (COMPARISONS[key], *lines)]


def cache_notes(table: Sequence[dict[str, Any]]) -> list[str]:
    """A line for each side and point where the prefix cache did not serve exactly the cached prefixes
    (then that row does not measure what it says)."""
    notes = []
    for row in table:
        expected = row["batch"] * row["prefix_len"]
        for side, cell in row["sides"].items():
            if cell["cache_as_planned"] is False:
                notes.append(
                    f"{side}, {row['key']}: the prefix cache served {cell['cached_tokens']} tokens "
                    f"per run, not {expected}"
                )
            elif cell["cache_as_planned"] is None:
                notes.append(f"{side}, {row['key']}: vLLM reported no cached-token counts")
    return notes
