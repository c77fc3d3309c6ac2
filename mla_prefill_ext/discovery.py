"""Backend packages: installing one is registering it.

A package declares its backend in the entry-point group ``mla_prefill_ext.backends``::

    [project.entry-points."mla_prefill_ext.backends"]
    MY_PREFILL = "my_pkg.prefill:MyPrefillBackend"

The entry's name is the name users select (and must equal the class's
``get_name()``, checked when the class loads). Every process discovers the
installed entries itself, as vLLM's own plugins do, so they are there on every node
that has the package: nothing travels between processes. Discovery runs once per
process, the first time a backend name is not found, every name is listed or a
selection runs; it reads package metadata only. A class is imported when it is
selected or inspected, and by automatic selection, to read its claim. A registration by
call (:func:`register_mla_prefill_backend`) wins over an entry of the same name; entries
cannot replace a built-in backend. A broken entry is recorded (``info`` shows it) and
never stops an engine that does not select it: automatic selection leaves it out with one
warning per process (``selector.claims``).
"""

from __future__ import annotations

import os
import sys
import threading
from importlib.metadata import Distribution, EntryPoint
from typing import NamedTuple

ENTRY_POINT_GROUP = "mla_prefill_ext.backends"


class EntryPointStatus(NamedTuple):
    name: str
    value: str
    distribution: str | None
    class_path: str | None  # None when the entry is unusable
    problem: str | None  # None: registered


# Reentrant: registering an entry point may look a name up, and a missed name discovers.
_LOCK = threading.RLock()
_DISCOVERED: list[EntryPointStatus] | None = None
_RUNNING = False  # only the thread holding _LOCK can see it True
_SECTION = f"[{ENTRY_POINT_GROUP}]"


def _installed_entry_points() -> list[EntryPoint]:
    """The group's entry points of the distributions on ``sys.path``.

    ``importlib.metadata.entry_points()`` parses every installed distribution's entry
    points (about 10 ms with vLLM's 200 dependencies, in every engine process); this
    reads each ``entry_points.txt`` as text and parses only those naming the group.
    """
    found: list[EntryPoint] = []
    seen: set[str] = set()
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for name in names:
            if not name.endswith((".dist-info", ".egg-info")):
                continue
            path = os.path.join(entry or ".", name)
            try:
                with open(os.path.join(path, "entry_points.txt"), encoding="utf-8") as f:
                    if _SECTION not in f.read():
                        continue
            except OSError:
                continue
            dist = Distribution.at(path)
            key = (dist.metadata["Name"] or name).lower().replace("_", "-")
            if key in seen:  # the first on sys.path wins, as for imports
                continue
            seen.add(key)
            found.extend(ep for ep in dist.entry_points if ep.group == ENTRY_POINT_GROUP)
    return found


def _class_path(value: str) -> str | None:
    module, sep, attr = value.partition(":")
    module, attr = module.strip(), attr.strip()
    if not sep or not module or not attr or " " in attr:
        return None
    return f"{module}.{attr}"


def discover(refresh: bool = False) -> list[EntryPointStatus]:
    """Register every installed backend entry point once per process; the outcome of each.

    The registry calls it at the first name it cannot find (and before listing every
    name); the selector before its first selection. Another thread waits for the
    discovery in progress; a lookup made by the discovery itself gets what is known.
    """
    global _DISCOVERED, _RUNNING
    with _LOCK:
        if _RUNNING:
            return _DISCOVERED or []
        if _DISCOVERED is not None and not refresh:
            return _DISCOVERED
        _RUNNING = True
        try:
            _DISCOVERED = _register_installed()
        finally:
            _RUNNING = False
        return _DISCOVERED


def _register_installed() -> list[EntryPointStatus]:
    """Register each installed entry point with the registry; the outcome of each."""
    from mla_prefill_ext import registry

    found = _installed_entry_points()
    by_name: dict[str, list] = {}
    for ep in found:
        by_name.setdefault(ep.name, []).append(ep)
    statuses = []
    for name, eps in sorted(by_name.items()):
        for ep in eps:
            dist = getattr(getattr(ep, "dist", None), "name", None)
            path = _class_path(ep.value)
            problem = None
            if len(eps) > 1:
                dists = {str(getattr(getattr(e, "dist", None), "name", "?")) for e in eps}
                others = ", ".join(sorted(dists))
                problem = f"declared by several packages ({others}); none is registered"
            elif path is None:
                problem = f"value '{ep.value}' is not of the form 'package.module:ClassName'"
            else:
                problem = registry.register_entry_point(name, path, dist)
            statuses.append(EntryPointStatus(name, ep.value, dist, path, problem))
    return statuses
