"""Where a worker step's time goes, from the traces of vLLM's own torch profiler.

    python -m scripts.bench step_profile TRACE [TRACE ...] [--label NAME ...] [--json out.json]

TRACE: a worker's trace as vLLM writes it (``profiler_config={"profiler": "torch", "torch_profiler_dir":
DIR}``, then ``LLM.start_profile()`` ... ``stop_profile()``; ``DIR/*.pt.trace.json.gz``), or a folder of
them; ``shared_prefix_engine --profile DIR`` makes one folder per side. Each worker step starts where vLLM
annotates its ``execute_model`` as ``execute_context_C(c)_generation_G(g)`` (C requests with c new tokens in
prefill, G decoding). Its host time is that span; "between" is the host time from its end to the next
step's start (the sampler, which vLLM calls after ``execute_model``, the engine core's scheduling and
output processing, and any wait on the GPU). Its GPU work is every kernel, copy and set launched from its
start to the next step's (linked by the trace's correlation ids, so work the GPU runs after the host has
moved on still counts for its step). Per kind of step (decode: no prefill request; prefill: no decoding
one; mixed) the median step: host ms, between ms, GPU busy ms (the union of its kernels' intervals), the
GPU's idle share between its first and last kernel, launches, and GPU ms per group of kernels (attention,
merge, GEMM, MoE, copies, other). A step whose host time is well above its GPU busy time is bound by the
host (Python, launches); one whose GPU is busy throughout is bound by its kernels. The profiler's own
overhead lengthens host time on every side alike: compare sides profiled the same way, not a profiled step
with a timed one.
"""

from __future__ import annotations

import bisect
import gzip
import json
import re
import statistics
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from . import common
from .sides import markdown_table

STEP = re.compile(r"^execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)$")
# First match wins: vLLM's merge kernel names "attn" too, FA3's combine kernel is attention's.
GROUPS = (
    ("merge", re.compile(r"merge_attn_states", re.I)),
    ("attention", re.compile(r"flash|fmha|mla|attn|attention", re.I)),
    ("moe", re.compile(r"moe|expert", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|matmul", re.I)),
    ("copies", re.compile(r"^Memcpy|^Memset|copy", re.I)),
)
GROUP_NAMES = (*(name for name, _ in GROUPS), "other")
GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
LAUNCH_CATEGORIES = {"cuda_runtime", "cuda_driver"}


class Step(NamedTuple):
    kind: str  # decode, prefill or mixed
    host_ms: float
    gap_ms: float | None  # host time since the previous step's annotation ended (None: the first)
    gpu_busy_ms: float
    gpu_span_ms: float  # first kernel's start to last kernel's end
    groups_ms: dict[str, float]
    launches: int  # launches with GPU work (a CUDA graph's replay: one)


def group_of(kernel: str) -> str:
    return next((name for name, pattern in GROUPS if pattern.search(kernel)), "other")


def step_kind(ctx_requests: int, gen_requests: int) -> str:
    if ctx_requests == 0:
        return "decode" if gen_requests else "empty"
    return "prefill" if gen_requests == 0 else "mixed"


def busy_ms(intervals: Iterable[tuple[float, float]]) -> float:
    """The union's length of ``(start, end)`` intervals in microseconds, in ms."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total / 1000


def steps_of(trace: dict[str, Any]) -> list[Step]:
    """Every annotated worker step of one trace, in order. A step's GPU work is what the host launched from
    its annotation's start to the next one's (the sampler, which vLLM calls after the annotated
    ``execute_model``, included); a CUDA graph's replay is one launch whose kernels share its correlation."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    gpu: dict[Any, list[dict[str, Any]]] = {}
    for e in events:
        if e.get("cat") in GPU_CATEGORIES and "correlation" in e.get("args", {}):
            gpu.setdefault(e["args"]["correlation"], []).append(e)
    launches = sorted(
        (e["ts"], e["args"]["correlation"])
        for e in events
        if e.get("cat") in LAUNCH_CATEGORIES and e.get("args", {}).get("correlation") in gpu
    )
    marks = sorted(
        (e for e in events if e.get("cat") == "user_annotation" and STEP.match(e.get("name", ""))),
        key=lambda e: e["ts"],
    )
    steps = []
    for i, e in enumerate(marks):
        m = STEP.match(e["name"])
        begin = e["ts"]
        until = marks[i + 1]["ts"] if i + 1 < len(marks) else float("inf")
        window = launches[bisect.bisect_left(launches, (begin,)) : bisect.bisect_left(launches, (until,))]
        kernels = [k for _, c in window for k in gpu[c]]
        groups = dict.fromkeys(GROUP_NAMES, 0.0)
        for k in kernels:
            groups[group_of(k["name"])] += k["dur"] / 1000
        spans = [(k["ts"], k["ts"] + k["dur"]) for k in kernels]
        span = (max(s for _, s in spans) - min(s for s, _ in spans)) / 1000 if spans else 0.0
        gap = None if i == 0 else (begin - marks[i - 1]["ts"] - marks[i - 1]["dur"]) / 1000
        kind = step_kind(int(m.group(1)), int(m.group(3)))
        steps.append(Step(kind, e["dur"] / 1000, gap, busy_ms(spans), span, groups, len(window)))
    return steps


def profiler_config(folder: Path, delay: int = 0, count: int = 0) -> dict[str, Any]:
    """vLLM's ``profiler_config`` (``LLM(profiler_config=...)``, ``vllm serve --profiler-config``) for the
    workers' torch traces in ``folder``, skipping ``delay`` worker steps and recording ``count`` (0: every
    step until ``stop_profile``); vLLM starts at the step its count reaches ``delay_iterations``, which it
    records, hence ``delay + 1``. No stacks (smaller traces), no front-end trace (0.34's API server)."""
    config = dict(profiler="torch", torch_profiler_dir=str(folder.resolve()), torch_profiler_with_stack=False)
    return {
        **config,
        "ignore_frontend": True,
        "delay_iterations": delay + 1 if delay else 0,
        "max_iterations": count,
    }


def read_trace(path: Path) -> dict[str, Any]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def traces_in(folder: Path) -> list[Path]:
    """The traces in a folder (vLLM's ``*.pt.trace.json[.gz]``; none if the folder is not there)."""
    return sorted([*folder.glob("*.json.gz"), *folder.glob("*.json")])


def new_traces(folder: Path, before: set[Path]) -> list[Path]:
    """The traces in ``folder`` that were not among ``before`` (what one profiled run wrote)."""
    return sorted(set(traces_in(folder)) - before)


def trace_files(path: Path) -> list[Path]:
    """A trace file, or the traces in a folder."""
    if path.is_dir():
        if not (found := traces_in(path)):
            raise FileNotFoundError(f"{path}: no trace (*.json, *.json.gz) in it")
        return found
    return [path]


def summarize(steps: Sequence[Step]) -> dict[str, dict[str, Any]]:
    """Per kind of step: how many, and the median of each measure over them."""
    out: dict[str, dict[str, Any]] = {}
    for kind in sorted({s.kind for s in steps}):
        mine = [s for s in steps if s.kind == kind]
        host = statistics.median(s.host_ms for s in mine)
        gaps = [s.gap_ms for s in mine if s.gap_ms is not None]
        busy = statistics.median(s.gpu_busy_ms for s in mine)
        span = statistics.median(s.gpu_span_ms for s in mine)
        out[kind] = dict(
            steps=len(mine),
            host_ms=host,
            gap_ms=statistics.median(gaps) if gaps else None,
            gpu_busy_ms=busy,
            gpu_idle_share=1 - busy / span if span else None,
            launches=statistics.median(s.launches for s in mine),
            groups_ms={g: statistics.median(s.groups_ms[g] for s in mine) for g in GROUP_NAMES},
        )
    return out


def summarize_files(paths: Iterable[Path]) -> dict[str, dict[str, Any]]:
    """:func:`summarize` over the steps of these traces (one worker's, or several workers' alike)."""
    return summarize([s for path in paths for s in steps_of(read_trace(path))])


def profile_lines(summaries: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """One markdown row per side and kind of step (medians)."""
    head = ["side", "kind", "steps", "host ms", "between ms", "GPU busy ms", "GPU idle", "launches"]
    rows = []
    for side, kinds in summaries.items():
        for kind, s in kinds.items():
            idle = "-" if s["gpu_idle_share"] is None else f"{s['gpu_idle_share']:.0%}"
            gap = "-" if s["gap_ms"] is None else f"{s['gap_ms']:.2f}"
            cells = [side, kind, str(s["steps"]), f"{s['host_ms']:.2f}", gap, f"{s['gpu_busy_ms']:.2f}", idle]
            rows.append([*cells, f"{s['launches']:.0f}", *(f"{s['groups_ms'][g]:.2f}" for g in GROUP_NAMES)])
    return markdown_table([*head, *(f"{g} ms" for g in GROUP_NAMES)], rows)


def profile_sides(paths: dict[str, Path]) -> dict[str, dict[str, dict[str, Any]]]:
    """Each side's steps summarized, from its trace or folder of traces (one worker each)."""
    return {side: summarize_files(trace_files(path)) for side, path in paths.items()}


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(__doc__)
    parser.add_argument("traces", nargs="+", type=Path, help="trace files or folders of them, one per side")
    parser.add_argument("--label", action="append", help="each trace's side, in order (default: its name)")
    parser.add_argument("--json", help="write the summaries here")
    args = parser.parse_args(argv)
    labels = args.label or [p.name for p in args.traces]
    if len(labels) != len(args.traces):
        parser.error(f"{len(args.traces)} traces, {len(labels)} labels")
    summaries = profile_sides(dict(zip(labels, args.traces, strict=True)))
    print("\n".join(profile_lines(summaries)), flush=True)
    common.write_json(args.json, {"command": " ".join(sys.argv), "profile": summaries})
    return 0


if __name__ == "__main__":
    sys.exit(main())
