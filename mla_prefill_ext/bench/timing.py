"""How ``bench`` times a call: the median of repetitions after warm-up, with the device synchronised.

The checkout's kernel benchmark (``scripts/bench/kernel.py``) times with it too. One timed call
sizes a repetition (enough calls back to back that it lasts about ``min_repetition_s``, at most
``max_calls``), so that the clock and the synchronisation cost little next to the work; each
repetition is timed from a synchronised device to a synchronised device; the result is the median
over the repetitions, per call.
``size_repetition`` and ``time_repetition`` are its two halves, for a caller that takes turns
with another measurement repetition by repetition.
Needs neither vLLM nor PyTorch: the clock and the synchronisation are arguments.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import NamedTuple

MIN_REPETITION_S = 0.02
MAX_CALLS = 200


class Timing(NamedTuple):
    """Seconds per call: the median, and each repetition's."""

    median_s: float
    samples_s: list[float]
    calls_per_repetition: int


def size_repetition(
    fn: Callable[[], object],
    *,
    sync: Callable[[], None],
    warmup: int,
    min_repetition_s: float = MIN_REPETITION_S,
    max_calls: int = MAX_CALLS,
    clock: Callable[[], float] = time.perf_counter,
) -> int:
    """``warmup`` untimed calls, then one timed call: how many calls back to back make a repetition."""
    for _ in range(warmup):
        fn()
    sync()
    start = clock()
    fn()
    sync()
    once = clock() - start
    return max(1, min(max_calls, int(min_repetition_s / max(once, 1e-9))))


def time_repetition(
    fn: Callable[[], object],
    *,
    sync: Callable[[], None],
    calls: int,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """One repetition from a synchronised device to a synchronised device: seconds per call."""
    start = clock()
    for _ in range(calls):
        fn()
    sync()
    return (clock() - start) / calls


def median_time(
    fn: Callable[[], object],
    *,
    sync: Callable[[], None],
    repeat: int,
    warmup: int,
    min_repetition_s: float = MIN_REPETITION_S,
    max_calls: int = MAX_CALLS,
    clock: Callable[[], float] = time.perf_counter,
) -> Timing:
    """``fn``'s time per call: ``warmup`` untimed calls, then the median of ``repeat`` repetitions."""
    if repeat < 1 or warmup < 0:
        raise ValueError(f"repeat must be at least 1 and warmup at least 0, got {repeat} and {warmup}")
    calls = size_repetition(
        fn, sync=sync, warmup=warmup, min_repetition_s=min_repetition_s, max_calls=max_calls, clock=clock
    )
    samples = [time_repetition(fn, sync=sync, calls=calls, clock=clock) for _ in range(repeat)]
    return Timing(statistics.median(samples), samples, calls)
