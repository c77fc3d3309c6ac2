"""The process ``info`` runs in: vLLM's platform there, and whether modules load from bytecode."""

from __future__ import annotations

import os
import sys
from typing import Any

from mla_prefill_ext.cli.common import Finding, describe_exception

# vLLM's platform predicates, in order, and the name info shows for each.
_PLATFORMS = (
    ("is_cuda", "CUDA"),
    ("is_rocm", "ROCm"),
    ("is_xpu", "XPU"),
    ("is_tpu", "TPU"),
    ("is_cpu", "CPU"),
    ("is_unspecified", "none"),
)


def bytecode_findings(packages: dict[str, str] | None = None, can_write: bool | None = None) -> list[Finding]:
    """A note when the add-on's or wrapt's modules must be compiled from source in every process.

    That happens where packages were installed without bytecode (``pip install --no-compile``)
    and Python may not write it (``PYTHONDONTWRITEBYTECODE``, common in container images).
    Measured on an H200 host: the add-on costs 11 ms of a vLLM process's start-up with
    bytecode, 18 ms with its own modules compiled from source each time, and 39 ms with
    wrapt's too (docs/benchmarks.md).
    """
    from importlib.util import cache_from_source
    from pathlib import Path

    if packages is None:
        import wrapt

        import mla_prefill_ext

        packages = {
            "mla_prefill_ext": os.path.dirname(mla_prefill_ext.__file__),
            "wrapt": os.path.dirname(wrapt.__file__),
        }
    if can_write is None:
        can_write = not sys.dont_write_bytecode
    if can_write:
        return []  # the first process that imports a module writes its bytecode
    missing = [
        name
        for name, folder in packages.items()
        if any(not Path(cache_from_source(str(f))).exists() for f in Path(folder).rglob("*.py"))
    ]
    if not missing:
        return []
    # Every folder, as the README's command has it: compiling what has bytecode costs nothing.
    folders = " ".join(packages.values())
    have = "has" if len(missing) == 1 else "have"
    return [
        Finding(
            "note",
            f"{' and '.join(missing)} {have} modules without bytecode and this Python may not write it "
            "(PYTHONDONTWRITEBYTECODE): every vLLM process compiles them from source, which adds "
            f"milliseconds to each start-up. Compile them once: {sys.executable} -m compileall -q {folders}",
        )
    ]


def platform_report() -> tuple[dict[str, Any], list[Finding]]:
    """vLLM's platform in this process, and whether the add-on takes over MLA prefill there."""
    from mla_prefill_ext.hosts.core.platform import platform_reason

    try:
        from vllm.platforms import current_platform

        name = type(current_platform).__name__
        for predicate, label in _PLATFORMS:
            test = getattr(current_platform, predicate, None)
            if callable(test) and test():
                name = label
                break
        reason = platform_reason()
    except Exception as e:  # vLLM cannot tell its platform: nothing it starts would run
        error = describe_exception(e)
        info = {"name": None, "vllm_platform": None, "served": None, "reason": None, "error": error}
        return info, [Finding("problem", f"vLLM cannot determine its platform here ({error}).")]
    info = {
        "name": name,
        "vllm_platform": type(current_platform).__name__,
        "served": reason is None,
        "reason": reason,
        "error": None,
    }
    return info, []


def platform_line(info: dict[str, Any], addon_serves: bool, disabled: bool) -> str:
    """The ``platform:`` line of ``info`` (``addon_serves``: active and vLLM's layer patched)."""
    from mla_prefill_ext.settings import BACKEND_ENV

    if info["error"] is not None:
        return "platform: unknown (see the findings)"
    name = info["name"]
    if name == "none":
        name = "none (vLLM detected no GPU platform)"
    if not info["served"]:
        return (
            f"platform: {name}: vLLM's own MLA prefill stays ({info['reason']}); an explicit "
            f"{BACKEND_ENV} is honoured if a backend can serve it"
        )
    if addon_serves:
        return f"platform: {name}: the add-on serves MLA prefill here"
    why = "it is disabled" if disabled else "it is not active: see the add-on line"
    return f"platform: {name}: the add-on would serve MLA prefill here ({why})"
