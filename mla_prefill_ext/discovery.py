"""Backend packages: installing one is registering it.

A package declares its backend in the entry-point group ``mla_prefill_ext.backends``::

    [project.entry-points."mla_prefill_ext.backends"]
    MY_PREFILL = "my_pkg.prefill:MyPrefillBackend"

The entry's name is the name users select (and must equal the class's
``get_name()``, checked when the class loads). Every process discovers the
installed entries itself, as vLLM's own plugins do, so they are there on every node
that has the package: nothing travels between processes.

This module is a scanner: :func:`scan` reads package metadata and returns what it
found, each entry with the problem that makes it unusable (None: usable). It
registers nothing and imports nothing of the add-on: the registry
(``registry.discover_installed``) scans once per process, the first time a backend
name is not found, every name is listed or a selection runs, and registers the
usable entries. A class is imported when it is selected or inspected,
and by automatic selection, to read its claim. A
registration by call wins over an entry of the same name; entries cannot replace a
built-in backend. A broken entry is recorded (``info`` shows it) and never stops
an engine that does not select it (automatic selection leaves it out with one warning
per package, ``selector.claims``): :func:`entry_problem` is where an entry is judged
unusable.
"""

from __future__ import annotations

import os
import sys
from importlib.metadata import Distribution, EntryPoint
from typing import NamedTuple

ENTRY_POINT_GROUP = "mla_prefill_ext.backends"


class EntryPointStatus(NamedTuple):
    name: str
    value: str
    distribution: str | None
    class_path: str | None  # None when the entry is unusable
    problem: str | None  # None: usable (after registration: registered)


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


def entry_problem(entry: EntryPoint, same_name: list[EntryPoint]) -> str | None:
    """Why an installed entry point cannot be registered (None: it can be).

    ``same_name``: every installed entry point with its name (itself included). Only what
    metadata tells is judged here; the registry adds its own refusals (a built-in's name).
    """
    if len(same_name) > 1:
        dists = {str(getattr(getattr(e, "dist", None), "name", "?")) for e in same_name}
        return f"declared by several packages ({', '.join(sorted(dists))}); none is registered"
    if _class_path(entry.value) is None:
        return f"value '{entry.value}' is not of the form 'package.module:ClassName'"
    return None


def scan() -> list[EntryPointStatus]:
    """Every installed entry point of the group, by name, with the problem that makes it unusable."""
    by_name: dict[str, list[EntryPoint]] = {}
    for ep in _installed_entry_points():
        by_name.setdefault(ep.name, []).append(ep)
    return [
        EntryPointStatus(
            name,
            ep.value,
            getattr(getattr(ep, "dist", None), "name", None),
            _class_path(ep.value),
            entry_problem(ep, eps),
        )
        for name, eps in sorted(by_name.items())
        for ep in eps
    ]
