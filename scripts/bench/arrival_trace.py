"""When each request of a timed call left the driver, reached the engine core, and which step took it.

``shared_prefix_engine --trace-arrivals``: the driver stamps each request it sends to the engine core
(``engine_core.add_request``, on the side's LLM); the engine core's process (reached through
``collective_rpc``: on one GPU the worker shares it) stamps when its input thread began and ended a
request's preprocessing (``EngineCoreProc.preprocess_add_request``: decode done, block hashes), when its
busy loop took it (``_handle_client_request``), and when each step began and ended
(``_process_engine_step``). All stamps are ``time.monotonic()`` (one clock for every process of the
host), printed in ms from the call's first send. What it answers: whether a call splits into two steps
because the driver sends its requests slowly, because the engine core's input thread takes long over
each, or because of pauses in either.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

EVENTS: list[tuple[str, str | None, float]] = []  # (kind, request id or None, monotonic time)
_LOCK = threading.Lock()


def _stamp(kind: str, request_id: str | None) -> None:
    with _LOCK:
        EVENTS.append((kind, request_id, time.monotonic()))


def install_in_engine_core(worker: Any = None) -> bool:
    """collective_rpc target: stamps in this process's ``EngineCoreProc`` (idempotent). False where
    no engine core runs in this process (more than one GPU: the workers are processes of their own)."""
    import sys

    core = sys.modules.get("vllm.v1.engine.core")
    proc = getattr(core, "EngineCoreProc", None)
    if proc is None:
        return False
    if getattr(proc, "_mla_arrival_trace", False):
        return True
    preprocess = proc.preprocess_add_request
    handle = proc._handle_client_request
    step = proc._process_engine_step

    def traced_preprocess(self, request):
        _stamp("ready0", request.request_id)
        try:
            return preprocess(self, request)
        finally:
            _stamp("ready1", request.request_id)

    def traced_handle(self, request_type, request):
        if isinstance(request, tuple) and request and hasattr(request[0], "request_id"):
            _stamp("taken", request[0].request_id)
        return handle(self, request_type, request)

    def traced_step(self, *args, **kwargs):
        _stamp("step0", None)
        try:
            return step(self, *args, **kwargs)
        finally:
            _stamp("step1", None)

    proc.preprocess_add_request = traced_preprocess
    proc._handle_client_request = traced_handle
    proc._process_engine_step = traced_step
    proc._mla_arrival_trace = True
    return True


def take_events(worker: Any = None) -> list[tuple[str, str | None, float]]:
    """collective_rpc target: this process's stamps since the last take."""
    with _LOCK:
        events = list(EVENTS)
        EVENTS.clear()
    return events


def install_in_driver(llm: Any) -> None:
    """Stamps each ``add_request`` the driver sends through one LLM's engine-core client."""
    client = llm.llm_engine.engine_core
    send = client.add_request

    def traced(request, *args, **kwargs):
        _stamp("sent", request.request_id)
        return send(request, *args, **kwargs)

    client.add_request = traced


def timeline(driver: Sequence[tuple], core: Sequence[tuple]) -> dict[str, Any]:
    """One call's stamps in ms from its first send: per request (sent, ready0, ready1, taken) in the
    order sent, and the steps (begin, end) that began after the first send."""
    events = sorted([*driver, *core], key=lambda e: e[2])
    sends = [e for e in events if e[0] == "sent"]
    if not sends:
        return {"requests": [], "steps": []}
    t0 = sends[0][2]
    per: dict[str, dict[str, float]] = {}
    for kind, rid, t in events:
        if rid is not None:
            per.setdefault(rid, {})[kind] = round((t - t0) * 1e3, 2)
    steps, begin = [], None
    for kind, _, t in events:
        if kind == "step0" and t >= t0:
            begin = t
        elif kind == "step1" and begin is not None:
            steps.append((round((begin - t0) * 1e3, 2), round((t - t0) * 1e3, 2)))
            begin = None
    order = [rid for _, rid, _ in sends]
    keys = ("sent", "ready0", "ready1", "taken")
    return {"requests": [[per[r].get(k) for k in keys] for r in order], "steps": steps}


def arrival_steps(trace: dict[str, Any]) -> list[tuple[int, float, float]] | None:
    """Per step that took any of a call's requests, in order: (how many, when it began, how long it
    took; ms from the call's first send). The first step that began after the busy loop took a
    request schedules it; later steps of a chunked request and steps that took none are left out.
    None where the trace cannot say: no request, or one the busy loop was never seen taking, or
    taken after the last step began."""
    steps = trace["steps"]
    requests = trace["requests"]
    if not requests or any(r[3] is None for r in requests):
        return None
    per_step: dict[int, int] = {}
    for request in requests:
        first = next((i for i, (b, _) in enumerate(steps) if b >= request[3]), None)
        if first is None:
            return None
        per_step[first] = per_step.get(first, 0) + 1
    return [(per_step[i], steps[i][0], round(steps[i][1] - steps[i][0], 2)) for i in sorted(per_step)]


def arrival_split(trace: dict[str, Any]) -> list[int] | None:
    """How a call's requests arrived in steps (:func:`arrival_steps`' counts): ``[16]``: all in one
    step; ``[10, 6]``: split by arrival; None where the trace cannot say."""
    steps = arrival_steps(trace)
    return None if steps is None else [n for n, _, _ in steps]


def timeline_lines(label: str, trace: dict[str, Any]) -> list[str]:
    """A call's trace as five lines (ms): sends, preprocessing begun and ended (the request is queued
    right after), taken by the busy loop, steps."""

    def row(i: int) -> str:
        return " ".join("-" if r[i] is None else f"{r[i]:.1f}" for r in trace["requests"])

    steps = " ".join(f"[{b:.1f}-{e:.1f}]" for b, e in trace["steps"])
    return [
        f"{label}: sent   {row(0)}",
        f"  preprocess began {row(1)}",
        f"  preprocessed     {row(2)}",
        f"  taken            {row(3)}",
        f"  steps            {steps}",
    ]
