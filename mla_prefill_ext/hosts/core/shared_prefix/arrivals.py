"""Requests over a shared prefix that reach an idle engine core together, started in one step (on by default).

vLLM's engine core (``EngineCoreProc``, the engine core in its own process, as ``LLM`` and the server
run it) steps as soon as the first request reaches it while idle; the rest of a burst lands during
that step and runs in the next. On the H200, 16 requests over a cached 32k prefix sent by one
``LLM.generate`` ran as two forward passes in nearly every call (1 + 15, 2 + 14, 5 + 11, ...
requests; docs/results/h200-2026-12-04-shared-prefix-steps): each forward costs its fixed part
again, and the shared segment is worked once per step, so twice, or the small part takes the absorbed
path alone. With the engine core in the driver's process the same call is one step and took 0.181 s
against 0.27-0.33 s.

With the path on (and ``MLA_PREFILL_SHARED_PREFIX_GATHER_MS`` not 0; default 100): when the engine
core was idle and the requests its wait took include one whose leading blocks equal a recent
request's for at least :data:`MIN_SHARED_TOKENS` (the reusing hasher found them,
:mod:`.prefix_hashes`), it keeps taking requests from its input queue until its input thread (which
decodes and preprocesses each request before queueing it) has been quiet for :data:`QUIET_S` with
nothing queued, for at most the window, then steps. A running engine takes new requests at its step
boundaries as vLLM does; a request that shares nothing, or reaches a busy engine, is never held; a lone
request over a shared prefix starts at most :data:`QUIET_S` after its preprocessing ended. Not with
data parallelism (engines step together there).

Measured on the H200 (docs/results/h200-2026-12-04-arrivals): a trace of each request showed the driver
sending a 16-request burst within 5-9 ms and the engine core's input thread queueing one every 1.7-3 ms
(27-68 ms for the burst), while the busy loop, waiting here, at times ran only 10-35 ms after a request
was queued; an earlier version timed the quiet gap from its own wake-up and had a 25 ms window, and split
about half the calls. Timed from the input thread, with 100 ms: one step in every 16 x 128 and 16 x 512
call (vLLM 0.20.2 and 0.25.1, eager and compiled); eager 16 x 128 2.35x stock against 1.63x without it in
the same run.
"""

from __future__ import annotations

import logging
import math
import queue
import time
from collections.abc import Callable
from typing import Any

from mla_prefill_ext._logging import log_once
from mla_prefill_ext.hosts.core.shared_prefix import counters, switch
from mla_prefill_ext.hosts.core.shared_prefix.prefix_hashes import ReusingHasher
from mla_prefill_ext.settings import GATHER_ENV, gather_window_ms

TARGET = "EngineCoreProc._process_input_queue"
INPUT_TARGET = "EngineCoreProc.preprocess_add_request"
QUIET_S = 0.003
"""A burst ends when the engine core's input thread has been quiet this long with no request waiting
(on the H200 it decoded and preprocessed a 32k-token request over a shared prefix every 1.7-3 ms,
0.3-1.5 ms of it between one request's end and the next one's beginning)."""
MIN_SHARED_TOKENS = 2048
"""Leading tokens a request must share with a recent one for an idle engine core to wait for more."""

# Counted (counters.py): "gathers", gatherings begun (one that took nothing counts too), and "gathered",
# the client calls they took (requests, and an abort or utility call that came within the burst).


def decide(vllm_config: Any) -> tuple[float, str]:
    """(window in seconds, why): 0 where the engine core does not gather. Raises ValueError on an
    invalid window or switch (the engine stops, naming it)."""
    decision = switch.decide(vllm_config)
    if not decision.on:
        return 0.0, f"the shared-prefix path is off: {decision.reason}"
    parallel = getattr(vllm_config, "parallel_config", None)
    if (getattr(parallel, "data_parallel_size", 1) or 1) > 1:
        return 0.0, "data parallelism is on (its engines step together)"
    ms, source = gather_window_ms()
    if ms <= 0:
        return (
            0.0,
            f"turned off by {source}" if source == GATHER_ENV else f"{source} says {ms:g} ms",
        )
    how = f"{GATHER_ENV}=0 turns it off" if source != GATHER_ENV else source
    return ms / 1000.0, f"up to {ms:g} ms ({how})"


class InputActivity:
    """When the engine core's input thread last showed life: it began or ended a request's
    preprocessing (``EngineCoreProc.preprocess_add_request``: decoded, block hashes next)."""

    def __init__(self) -> None:
        self.busy = 0  # requests being preprocessed now
        self.last = -math.inf  # time.monotonic() of the last beginning or end

    def began(self) -> None:
        self.busy += 1
        self.last = time.monotonic()

    def ended(self) -> None:
        self.last = time.monotonic()  # first: a reader seeing busy 0 must not see the beginning's time
        self.busy -= 1

    def idle_s(self) -> float:
        """Seconds since the input thread's last sign of life (0 while it is preprocessing)."""
        return 0.0 if self.busy > 0 else time.monotonic() - self.last


def gather(
    take: Callable[[float], Any],
    handle: Callable[[Any], bool],
    window_s: float,
    running: Callable[[], bool],
    input_idle_s: Callable[[], float],
) -> int:
    """Take and handle items until the input thread has been quiet for :data:`QUIET_S` with none
    waiting, ``window_s`` passed, or ``handle`` returned False (an item that ends the burst); how many
    were taken. ``take(timeout)`` raises ``queue.Empty`` when none came.

    The quiet gap is timed from the input thread's last sign of life, not from when this thread
    last woke: on the H200 the busy loop's thread, waiting here, at times got to run only 10-35 ms
    after a request was queued (the input thread decoding and hashing the rest of the burst); timed
    from its own wake-up it ended bursts the input thread was still delivering, every 2-3 ms."""
    deadline = time.monotonic() + window_s
    taken = 0
    while running():
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            item = take(max(0.0, min(QUIET_S - input_idle_s(), left)))
        except queue.Empty:
            if input_idle_s() >= QUIET_S:
                break
            continue
        taken += 1
        if not handle(item):
            break
    return taken


def preprocess_add_request(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    """``EngineCoreProc.preprocess_add_request`` (the input thread): stamped for :func:`gather`."""
    activity = _activity(instance)
    activity.began()
    try:
        return wrapped(*args, **kwargs)
    finally:
        activity.ended()


def _activity(instance: Any) -> InputActivity:
    # dict.setdefault is atomic: the input thread and the busy loop may both be first.
    return instance.__dict__.setdefault("_mla_input_activity", InputActivity())


def shares_a_prefix(hasher: Any, request_ids: Any) -> bool:
    """Whether one of ``request_ids`` has at least :data:`MIN_SHARED_TOKENS` leading tokens in common
    with a recent request (the reusing hasher's ``sharing``; vLLM's own hasher, or a reusing one turned
    off: never)."""
    if not isinstance(hasher, ReusingHasher):
        return False
    # A reusing hasher turned off cleared its record and adds nothing more to it.
    return any(tokens >= MIN_SHARED_TOKENS and rid in request_ids for rid, tokens in tuple(hasher.sharing))


def _window(instance: Any) -> float:
    window = instance.__dict__.get("_mla_gather_s")
    if window is None:
        try:
            window, reason = decide(instance.vllm_config)
        except ValueError as e:
            raise RuntimeError(f"mla-prefill-ext: {e}") from None
        log_once(
            logging.INFO,
            ("shared-prefix-gather", window, reason),
            "MLA shared-prefix prefill (mla-prefill-ext): an idle engine core %s (%s).",
            "takes a burst of requests over a shared prefix into one step"
            if window
            else "steps at its first request as vLLM does",
            reason,
        )
        instance._mla_gather_s = window
    return window


def _handle_request(instance: Any, item: Any) -> bool:
    """One client call taken while gathering; True while the burst goes on. Anything but a new request
    (an abort, a utility call such as ``collective_rpc``, a wake-up) ends it, handled as vLLM would."""
    instance._handle_client_request(*item)
    return getattr(item[0], "name", None) == "ADD"


def process_input_queue(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    """``EngineCoreProc._process_input_queue()``: vLLM's wait for work; from idle, a burst over a
    shared prefix gathered after it."""
    hasher = getattr(instance, "request_block_hasher", None)
    scheduler = getattr(instance, "scheduler", None)
    requests = getattr(instance, "input_queue", None)
    # Busy: new requests join at step boundaries, as in vLLM. vLLM's hasher (not an MLA model, the
    # path off, hashes that look ahead, a reuse turned off): nothing is known about shared prefixes,
    # nothing to wait for. An engine core without the scheduler, queue or configuration this reads (a
    # vLLM of another shape) runs as vLLM's too.
    if (
        instance.has_work()
        or not isinstance(hasher, ReusingHasher)
        or hasher.off is not None
        or not hasattr(scheduler, "requests")
        or not callable(getattr(requests, "get", None))
        or not hasattr(instance, "vllm_config")
    ):
        return wrapped(*args, **kwargs)
    # Only what the wait takes counts (an idle scheduler can still hold finished requests' entries).
    idle = set(scheduler.requests)
    result = wrapped(*args, **kwargs)
    if not instance.is_running() or not _window(instance):
        return result
    new = set(scheduler.requests) - idle
    if not shares_a_prefix(hasher, new):
        return result
    taken = gather(
        lambda timeout: requests.get(timeout=timeout),
        lambda item: _handle_request(instance, item),
        instance._mla_gather_s,
        instance.is_running,
        _activity(instance).idle_s,
    )
    counters.add("gathers")
    counters.add("gathered", taken)
    return result
