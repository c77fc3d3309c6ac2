"""Parts of the add-on's shared-prefix path paused in a running engine, for benchmarks only.

Engine lifetimes of one configuration differ by a few percent at some points, so a benchmark compares
the path on and off (or one part off) call by call in one lifetime. A part is paused by a ``wrapt``
wrapper over the add-on function that does that part, making it do what the path off does; resuming
removes the wrapper. Runs in the process where the parts run (``collective_rpc`` into the workers; on
one GPU the worker's process holds the engine core too). The add-on itself knows nothing of this.

Each part, paused, runs vLLM's own code for that step or request: no plan (``step.plan_step``), vLLM's
decode threshold (``routing.route_threshold``), vLLM's hasher alone (``ReusingHasher.__call__``), vLLM's
lookup alone (``PrefixHits.find``), no waiting for a burst (``arrivals._window``). Every part is exact
either way and none keeps state that a pause makes wrong (a remembered hit is checked block by block
before it is lent; remembered hashes are a function of the tokens).
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Iterable
from typing import Any

import wrapt

PARTS = ("plan", "route", "hashes", "hits", "gather")
IMPLIED = {"plan": ("route",), "hashes": ("gather",)}
"""Pausing the plan pauses routing (a routed step without its plan would up-project every short
extend's whole context: neither the path on nor off); pausing the hash reuse pauses the gathering (it
waits only for requests the hash reuse saw sharing a prefix)."""

_PACKAGE = "mla_prefill_ext.hosts.core.shared_prefix"


# Each paused part's replacement (wrapt's wrapped, instance, args, kwargs): no plan (vLLM's chunks stay on
# the step), vLLM's decode threshold, vLLM's hasher, vLLM's lookup (passed as the first argument), no window
# (an idle engine core steps at its first request).
TARGETS: dict[str, tuple[str, str, Callable[..., Any]]] = {
    "plan": ("step", "plan_step", lambda w, i, a, k: None),
    "route": ("routing", "route_threshold", lambda w, i, a, k: None),
    "hashes": ("prefix_hashes", "ReusingHasher.__call__", lambda w, i, a, k: i.inner(*a, **k)),
    "hits": ("prefix_hits", "PrefixHits.find", lambda w, i, a, k: a[0](*a[1:], **k)),
    "gather": ("arrivals", "_window", lambda w, i, a, k: 0.0),
}
"""Per part: the add-on module (in its shared-prefix package), the function called by name at each use
(so that a wrapper put there takes effect at the next call), and what it does while paused."""

_paused: dict[str, tuple[Any, str, Any]] = {}  # part -> (module, path, wrapper)
_lock = threading.Lock()


def with_implied(parts: Iterable[str]) -> list[str]:
    """``parts`` and what they imply, in :data:`PARTS`' order; an unknown part is refused."""
    wanted = set(parts)
    unknown = sorted(wanted - set(PARTS))
    if unknown:
        raise ValueError(f"unknown shared-prefix part(s) {unknown}: the parts are {', '.join(PARTS)}")
    for part in list(wanted):
        wanted.update(IMPLIED.get(part, ()))
    return [p for p in PARTS if p in wanted]


def pause(parts: Iterable[str]) -> list[str]:
    """Pause ``parts`` (with what they imply) in this process from the next step or request on, and
    resume the others; ``pause(())`` resumes all. Returns the parts paused now."""
    wanted = with_implied(parts)
    with _lock:
        for part in [p for p in _paused if p not in wanted]:
            module, path, wrapper = _paused.pop(part)
            wrapt.unwrap_object(module, path, wrapper)
        for part in [p for p in wanted if p not in _paused]:
            name, path, replacement = TARGETS[part]
            module = importlib.import_module(f"{_PACKAGE}.{name}")
            _paused[part] = (module, path, wrapt.wrap_function_wrapper(module, path, replacement))
        return [p for p in PARTS if p in _paused]


def paused() -> list[str]:
    """The parts paused in this process now."""
    return [p for p in PARTS if p in _paused]
