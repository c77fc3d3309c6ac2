"""What the shared-prefix path did in this process, counted in one place (evidence for benchmarks,
``info`` and tests): steps planned with shared segments, steps routed, steps seen, bursts gathered."""

from __future__ import annotations

import collections
import threading

_COUNTS: collections.Counter[str] = collections.Counter()
_LOCK = threading.Lock()  # the engine core's threads and the worker's count at once


def add(name: str, n: int = 1) -> int:
    """Add ``n`` to ``name``'s count; the count after."""
    with _LOCK:
        _COUNTS[name] += n
        return _COUNTS[name]


def get(name: str) -> int:
    return _COUNTS[name]
