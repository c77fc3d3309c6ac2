"""How busy the GPU was during a profiled call, and what the host did while it was idle.

Reads a ``torch.profiler`` Chrome trace (``prof.export_chrome_trace``; plain or gzipped JSON):

    python -m scripts.bench gpu_timeline TRACE.json[.gz] [--gap-ms 0.2] [--top 15]

Device events (kernels, memcpy, memset) are merged into busy intervals; the window runs from the
first host event to the last device event. Printed: the window, the device's busy time within
it, the idle gaps of at least ``--gap-ms`` (largest first) with the host events that overlap each
gap the most, the host's waits on the device (synchronize calls, blocking copies) by name, and
next to them its asynchronous copies: one between the device and pinned memory returns at once; one
from pageable memory is staged by the host, and one into pageable memory waits for the device, so
their host time may be waiting too.

Host events nest (``aten::to`` > ``aten::_to_copy`` > ``aten::copy_`` > ``cudaMemcpyAsync``, all on one
thread): a gap credits each event with its own time only (less its children's), named with the op it
ran in (``cudaMemcpyAsync in aten::copy_``). A gap with an ``aten::`` or ``cuda*`` event's own time over
it is the host launching or waiting; one with a Python function's own time, or nothing, over it is
Python between ops.
"""

from __future__ import annotations

import gzip
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from . import common

DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
HOST_CATEGORIES = frozenset({"cpu_op", "cuda_runtime", "cuda_driver", "python_function", "user_annotation"})
RUNTIME_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})


def is_wait(name: str) -> bool:
    """A runtime call in which the host waits for the device: a synchronize or a blocking copy
    (``cudaStreamWaitEvent`` makes the device wait, not the host)."""
    return "Synchronize" in name or ("Memcpy" in name and "Async" not in name)


def is_async_copy(name: str) -> bool:
    return "Memcpy" in name and "Async" in name


def load(path: str | Path) -> list[dict[str, Any]]:
    """The trace's complete events (``ph`` "X"), in µs as the profiler writes them."""
    raw = Path(path).read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    data = json.loads(raw)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]


def merge(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Overlapping or touching ``(start, end)`` intervals joined, in order."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def own_time(host: list[dict[str, Any]]) -> list[tuple[str, list[tuple[float, float]]]]:
    """Each host event's own time: its interval less its children's (the events of its thread that
    begin inside it), labelled with the innermost ``cpu_op`` around it (``cudaMemcpyAsync in
    aten::copy_``). An event that outlives its parent counts as its child up to the parent's end, and
    as a child of every event open around it (no time is counted twice)."""
    threads: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
    for e in host:
        threads.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    out = []
    for events in threads.values():
        events.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))
        # Open events: (end, the op a child runs in, the children's intervals)
        stack: list[tuple[float, str | None, list[tuple[float, float]]]] = []
        entries = []
        for e in events:
            start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
            stack = [entry for entry in stack if entry[0] > start]  # every ended one, not only the top
            op = stack[-1][1] if stack else None
            for open_end, _, children_of_open in stack:  # every open event: a child that outlives its
                children_of_open.append((start, min(end, open_end)))  # parent still runs inside the rest
            children: list[tuple[float, float]] = []
            stack.append((end, e["name"] if e.get("cat") == "cpu_op" else op, children))
            label = f"{e['name']} in {op}" if op and op != e["name"] else e["name"]
            entries.append((label, (start, end), children))
        for label, (start, end), children in entries:
            own, at = [], start
            for c0, c1 in merge(children):
                if c0 > at:
                    own.append((at, c0))
                at = max(at, c1)
            if end > at:
                own.append((at, end))
            out.append((label, own))
    return out


def summarize(events: list[dict[str, Any]], gap_us: float = 200.0, top: int = 15) -> dict[str, Any]:
    """Window, busy time, idle gaps and host waits of one trace (times in ms)."""
    device = [e for e in events if e.get("cat") in DEVICE_CATEGORIES]
    host = [e for e in events if e.get("cat") in HOST_CATEGORIES]
    if not device or not host:
        raise ValueError("the trace holds no device events or no host events")
    busy = merge((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in device)
    begin = min(float(e["ts"]) for e in host)
    end = busy[-1][1]
    gaps = []
    previous = begin
    for start, stop in busy:
        if start - previous >= gap_us:
            gaps.append((previous, start))
        previous = max(previous, stop)
    gaps.sort(key=lambda g: g[1] - g[0], reverse=True)
    by_label: dict[str, list[tuple[float, float]]] = {}  # 30 launches of 15 us are one 0.45 ms entry
    for name, spans in own_time(host):
        by_label.setdefault(name, []).extend(spans)
    listed = []
    for g0, g1 in gaps[:top]:
        over = sorted(
            ((sum(_overlap(g0, g1, a, b) for a, b in spans), name) for name, spans in by_label.items()),
            reverse=True,
        )
        listed.append(
            {
                "at_ms": (g0 - begin) / 1e3,
                "ms": (g1 - g0) / 1e3,
                "host": [{"name": name[:100], "ms": ms / 1e3} for ms, name in over[:4] if ms > 0],
            }
        )
    waits: dict[str, list[float]] = {}
    copies: dict[str, list[float]] = {}
    for e in host:
        if e.get("cat") in RUNTIME_CATEGORIES:
            if is_wait(e["name"]):
                waits.setdefault(e["name"], []).append(float(e["dur"]))
            elif is_async_copy(e["name"]):
                copies.setdefault(e["name"], []).append(float(e["dur"]))

    def by_name(calls: dict[str, list[float]]) -> dict[str, dict[str, Any]]:
        return {
            name: {"calls": len(d), "ms": sum(d) / 1e3, "longest_ms": max(d) / 1e3}
            for name, d in sorted(calls.items(), key=lambda kv: -sum(kv[1]))
        }

    return {
        "window_ms": (end - begin) / 1e3,
        "device_busy_ms": sum(b - a for a, b in busy) / 1e3,
        "idle_ms": sum(g1 - g0 for g0, g1 in gaps) / 1e3,
        "gaps_counted": len(gaps),
        "gap_threshold_ms": gap_us / 1e3,
        "largest_gaps": listed,
        "host_waits": by_name(waits),
        "host_async_copies": by_name(copies),
    }


def lines(summary: dict[str, Any]) -> list[str]:
    """The summary as printed."""
    out = [
        f"window {summary['window_ms']:.1f} ms, device busy {summary['device_busy_ms']:.1f} ms, "
        f"idle in gaps >= {summary['gap_threshold_ms']:.2f} ms: {summary['idle_ms']:.1f} ms "
        f"({summary['gaps_counted']} gaps)"
    ]
    for g in summary["largest_gaps"]:
        over = "; ".join(f"{h['name']} {h['ms']:.2f}" for h in g["host"]) or "(no host event)"
        out.append(f"  gap {g['ms']:7.2f} ms at {g['at_ms']:7.1f} ms: {over}")
    for name, w in summary["host_waits"].items():
        out.append(f"  wait {name}: {w['calls']} calls, {w['ms']:.2f} ms, longest {w['longest_ms']:.2f} ms")
    for name, w in summary.get("host_async_copies", {}).items():
        out.append(
            f"  async copy {name}: {w['calls']} calls, {w['ms']:.2f} ms on the host, "
            f"longest {w['longest_ms']:.2f} ms"
        )
    return out


def make_parser():
    parser = common.parser(__doc__)
    parser.add_argument("trace", type=Path)
    parser.add_argument("--gap-ms", type=float, default=0.2, help="smallest idle gap listed")
    parser.add_argument("--top", type=int, default=15, help="gaps listed, largest first")
    parser.add_argument("--json", help="write the summary here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        summary = summarize(load(args.trace), gap_us=args.gap_ms * 1e3, top=args.top)
    except ValueError as e:
        print(f"gpu_timeline: {args.trace}: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines(summary)))
    common.write_json(args.json, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
