"""The hosts: how the add-on enters vLLM, one package per vLLM line, on one shared core.

* :mod:`~mla_prefill_ext.hosts.core`: what both hosts do, on every vLLM (refusing an
  explicit choice the add-on cannot honour, the instrumentor, the builder life cycle).
* :mod:`~mla_prefill_ext.hosts.vllm_0_20`: vLLM 0.20.x, patches vLLM's MLA layer. On
  0.21-0.22 the add-on does nothing but the core's explicit-choice guard
  (:mod:`~mla_prefill_ext.hosts.core.stock_guard`).
* :mod:`~mla_prefill_ext.hosts.vllm_0_23`: vLLM 0.23 and later, bridges the add-on's
  backends into vLLM's own MLA prefill registry.

The two hosts import nothing from each other; the core imports neither. Code outside the
hosts that reports on them (the CLI) asks :func:`host_report` here, never a host's modules.
Importing this package loads nothing else: activation reads it in every vLLM process.
"""

from __future__ import annotations

import importlib
from typing import Any

PATCH_HOST = f"{__name__}.vllm_0_20"
BRIDGE_HOST = f"{__name__}.vllm_0_23"
STOCK_GUARD_MODULE = f"{__name__}.core.stock_guard"
SHARED_PREFIX_MODULE = f"{__name__}.core.shared_prefix.instrumentor"
ENGINE_CORE_PATH_MODULE = f"{__name__}.core.shared_prefix.engine_core"
VLLM_ENGINE_CORE_MODULE = "vllm.v1.engine.core"  # where the engine core makes its block hasher

__all__ = [
    "BRIDGE_HOST",
    "ENGINE_CORE_PATH_MODULE",
    "PATCH_HOST",
    "SHARED_PREFIX_MODULE",
    "STOCK_GUARD_MODULE",
    "VLLM_ENGINE_CORE_MODULE",
    "host_report",
    "shared_prefix_report",
]


def host_report(mode: str, mla_module: Any = None) -> Any:
    """What the host in force for ``mode`` (``versions.PATCH``, ``BRIDGE`` or ``NONE``) reports.

    A :class:`~mla_prefill_ext.hosts.core.report.HostReport`; in mode ``none`` the patch
    host's report says what its targets would be and why nothing is patched.
    """
    from mla_prefill_ext import versions

    host = BRIDGE_HOST if mode == versions.BRIDGE else PATCH_HOST
    return importlib.import_module(f"{host}.report").host_report(mla_module)


def shared_prefix_report(disabled: bool) -> dict[str, Any]:
    """Whether the shared-prefix path runs in this process's engines, and why (for ``info``).

    ``on``; ``reason`` in words; ``problem``: True when the setting itself is invalid. Read
    after the add-on activated and vLLM's MLA module was imported (the path wraps it then).
    """
    from mla_prefill_ext.settings import gather_window_ms, shared_prefix_setting

    if disabled:
        return {"on": False, "reason": "the add-on is disabled", "problem": False}
    try:
        on, source = shared_prefix_setting(None)
    except ValueError as e:
        return {"on": False, "reason": str(e), "problem": True}
    if not on:
        return {"on": False, "reason": f"turned off by {source}", "problem": False}
    try:
        gather_window_ms()
    except ValueError as e:  # checked at start in every MLA engine core whose busy loop is wrapped
        return {
            "on": False,
            "reason": f"{e}; an engine core of an MLA model stops at start with it",
            "problem": True,
        }
    report = _shared_prefix_state()
    report["needs"] = _needs_rows()
    return report


def _needs_rows() -> list[dict[str, Any]]:
    """Each row of the path's table (:mod:`.core.shared_prefix.needs`) for the runners this vLLM has,
    with its outcome here (``problem`` None: it holds) and, where it will not be read here, why not
    (``unused``: vLLM does not pick its runner here, or the part is turned off)."""
    from mla_prefill_ext.hosts.core.shared_prefix import needs, switch
    from mla_prefill_ext.settings import SHARED_DECODE_ENV, shared_decode_setting

    here, picked = needs.runners_here(), switch.runners_picked()
    decode_on, _ = shared_decode_setting()

    def unused(need: needs.Need) -> str | None:
        if need.runner != needs.ANY and need.runner not in picked:
            return f"vLLM does not pick its {need.runner} runner here"
        if need.part == "decode" and not decode_on:
            return f"decode rows are off: {SHARED_DECODE_ENV}=1 turns them on"
        return None

    return [
        {
            "part": need.part,
            "runner": need.runner,
            "unused": unused(need),
            "module": need.module,
            "attribute": " or ".join(need.attributes),
            "what": need.what,
            "problem": problem,
        }
        for need, problem in needs.outcomes()
        if need.runner == needs.ANY or need.runner in here
    ]


def _shared_prefix_state() -> dict[str, Any]:
    import sys

    from mla_prefill_ext.settings import SHARED_PREFIX_ENV

    module = sys.modules.get(SHARED_PREFIX_MODULE)
    path = getattr(module, "INSTRUMENTOR", None)
    if path is None or not path.is_instrumented():
        why = (path and path.state().skipped_reason) or "vLLM's MLA layer is not patched or bridged here"
        return {
            "on": False,
            "reason": (
                f"not available ({why}); vLLM's own context path runs; "
                f"{_hashes_outlook(_engine_core_problem())}"
            ),
            "problem": False,
        }
    from mla_prefill_ext.hosts.core.shared_prefix.switch import runner_outlook

    served, runner = runner_outlook()
    if not served:
        return {
            "on": False,
            "reason": f"off here: {runner}; {_hashes_outlook(_engine_core_problem())}",
            "problem": False,
        }
    core_problem = _engine_core_problem()
    return {
        "on": True,
        "reason": (
            f"requests sharing a cached prefix do its work once per layer ({SHARED_PREFIX_ENV}=0 turns "
            "it off); with a backend that takes shared segments (the built-ins do), not in an engine "
            f"with an FP8 KV cache, context parallelism or dual-batch overlap{runner}; "
            f"{_hashes_outlook(core_problem)}; {_gather_outlook(core_problem)}"
        ),
        "problem": False,
    }


def _engine_core_problem() -> str | None:
    """Why engine cores here would not take the add-on's wrappers (the check instrument() runs, now)."""
    from mla_prefill_ext.hosts.core.shared_prefix import engine_core

    try:
        core = importlib.import_module(VLLM_ENGINE_CORE_MODULE)
    except Exception as e:  # info reports, it does not fail
        return f"{VLLM_ENGINE_CORE_MODULE} does not import ({type(e).__name__}: {e})"
    return engine_core.INSTRUMENTOR.check(core) or None


def _gather_outlook(core_problem: str | None) -> str:
    """Whether an idle engine core here gathers a burst over a shared prefix into one step (for ``info``;
    the window's value was checked before; ``core_problem``: :func:`_engine_core_problem`)."""
    from mla_prefill_ext.hosts.core.shared_prefix import engine_core
    from mla_prefill_ext.settings import GATHER_ENV, gather_window_ms

    ms, source = gather_window_ms()
    if ms <= 0:
        return f"an idle engine core steps at its first request (turned off by {source})"
    # The engine core's wrappers go in all or none: the reuse's shape first, then the gathering's.
    problem = core_problem or engine_core.arrival_problem(importlib.import_module(VLLM_ENGINE_CORE_MODULE))
    if problem is not None:
        return f"an idle engine core steps at its first request ({problem})"
    off = f"{GATHER_ENV}=0 turns it off" if source != GATHER_ENV else f"{GATHER_ENV}={ms:g}"
    return (
        f"an idle engine core takes a burst of requests over a shared prefix into one step, waiting up to "
        f"{ms:g} ms while they arrive ({off}; not with data parallelism)"
    )


def _hashes_outlook(core_problem: str | None) -> str:
    """Whether engine cores here will reuse a shared prefix's block hashes (``core_problem``:
    :func:`_engine_core_problem`)."""
    if core_problem is not None:
        return f"block hashes and prefix-cache hits not reused ({core_problem})"
    return (
        "the engine core reuses a shared prefix's block hashes (MLA models; requests without LoRA, cache "
        "salt, multimodal inputs or prompt embeddings; either model runner) and its prefix-cache hits (one "
        "full-attention KV cache group, without EAGLE or context parallelism)"
    )
