"""The adapter classes, by backend name: ``mla_prefill_ext.hosts.vllm_0_23.adapter_classes.NAME``.

This is the module vLLM's registry points at for an add-on backend. An attribute is
made on first access in each process (vLLM's ``resolve_obj_by_qualname``, or pickle
resolving a class by reference in a spawned engine core), from the add-on's
registry there: built-ins, registrations mirrored through the environment, and
installed backend packages.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    from mla_prefill_ext.hosts.vllm_0_23 import shape
    from mla_prefill_ext.hosts.vllm_0_23.adapter import adapter_class
    from mla_prefill_ext.registry import MLAPrefillBackendEnum, discover_installed

    discover_installed()  # installed backend packages are names too
    if name not in MLAPrefillBackendEnum.__members__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}: no MLA prefill backend {name}")
    found, problems = shape.current()
    if found is None:
        raise ImportError(f"mla-prefill-ext cannot bridge this vLLM: {'; '.join(problems)}")
    try:
        return adapter_class(name, found)
    except (TypeError, ValueError) as e:
        # vLLM's selector turns an ImportError into a reason; anything else would escape it raw.
        raise ImportError(str(e)) from e
