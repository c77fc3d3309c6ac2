"""Activation: vLLM calls :func:`activate` in every process it starts.

The entry point ``mla_prefill_ext = mla_prefill_ext:activate`` in the group
``vllm.general_plugins`` makes vLLM run it in the front end, the engine core and
each worker (Ray workers included, after vLLM has applied the environment it
copies to them) before the model is built. Activation is cheap: it checks the vLLM
version and arms the host for it (:mod:`mla_prefill_ext.hosts`): on vLLM 0.20 one
``wrapt`` post-import hook per patch set (``hosts.vllm_0_20.PATCH_SETS``), on 0.23+ one
per module that binds vLLM's prefill selector (``hosts.vllm_0_23.BINDING_MODULES``), so
each lands when its vLLM module is imported, whether that happened before activation or
happens after it. A host's own modules load only then: processes that never import the
MLA module (an API server front end, a model without MLA) never pay for them. On both hosts one more hook,
on ``vllm.v1.engine.core``, gives the engine core's block hasher the shared-prefix path's hash
reuse (:mod:`mla_prefill_ext.hosts.core.shared_prefix.engine_core`).
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

from mla_prefill_ext.settings import DISABLE_ENV, ask_vllm_to_copy_to_ray, is_disabled

__all__ = ["DISABLE_ENV", "activate", "deactivate", "is_active", "is_disabled"]

_LOCK = threading.Lock()
_active = False
_mode: str | None = None  # what the active process armed: versions.PATCH, BRIDGE or NONE
_HOOKED: set[str] = set()  # the modes whose post-import hooks wrapt holds


def is_active() -> bool:
    return _active


def _on_imported(module: ModuleType) -> None:
    # wrapt keeps post-import hooks for the life of the process; they are disarmed by
    # deactivate() rather than removed.
    if _active and _mode == "patch":
        from mla_prefill_ext.hosts import vllm_0_20

        patched = vllm_0_20.instrumentor_for(module.__name__).instrument(module)
        if patched and module.__name__ == vllm_0_20.MLA_MODULE:
            _instrument_shared_prefix(module)


def _instrument_shared_prefix(mla_module: ModuleType) -> None:
    """The shared-prefix path, on either host, after the host's own wrappers (it reads what they set)."""
    from mla_prefill_ext.hosts.core.shared_prefix.instrumentor import INSTRUMENTOR
    from mla_prefill_ext.settings import shared_decode_setting, shared_prefix_setting

    try:  # the environment's switches: refused at start, not on a first step
        shared_prefix_setting(None)
        shared_decode_setting()
    except ValueError as e:
        raise RuntimeError(f"mla-prefill-ext: {e}") from None
    INSTRUMENTOR.instrument(mla_module)


def _on_engine_core_imported(module: ModuleType) -> None:
    """The engine core's part of the shared-prefix path (both hosts): its block hasher."""
    if _active and _mode in ("patch", "bridge"):
        from mla_prefill_ext.hosts.core.shared_prefix.engine_core import INSTRUMENTOR

        INSTRUMENTOR.instrument(module)


def _vllm_missing() -> bool:
    if "vllm" in sys.modules:
        return False
    import importlib.util

    return importlib.util.find_spec("vllm") is None


def activate() -> None:
    """Arm the patch or the bridge in this process (idempotent; all or nothing; a no-op when disabled).

    The mode comes from the installed vLLM (:mod:`mla_prefill_ext.versions`): on vLLM
    0.20 the patch (:mod:`mla_prefill_ext.hosts.vllm_0_20`), on 0.23+ the bridge
    (:mod:`mla_prefill_ext.hosts.vllm_0_23`); on a vLLM without a mode only the core's
    guard against an explicit backend choice
    (:mod:`mla_prefill_ext.hosts.core.stock_guard`).
    """
    global _active
    if _vllm_missing():
        logging.getLogger("mla_prefill_ext").warning(
            "mla-prefill-ext: vLLM is not installed in this environment; nothing to activate."
        )
        return
    # Before the disable check: the switch itself must reach Ray workers too.
    ask_vllm_to_copy_to_ray()
    if is_disabled():
        return
    from mla_prefill_ext import versions

    global _mode
    decision = versions.decide()
    if decision.mode == versions.BRIDGE:
        _activate_bridge(decision)  # the patch's package is never imported there
        return
    if decision.mode == versions.NONE:
        _activate_stock_guard(decision.reason or "vLLM is not supported")
        return
    from mla_prefill_ext.hosts import VLLM_ENGINE_CORE_MODULE, vllm_0_20

    with _LOCK:
        if _active:
            return
        _register_hooks_once("patch", _on_imported, vllm_0_20.PATCH_SETS)
        _register_hooks_once("engine-core", _on_engine_core_imported, [VLLM_ENGINE_CORE_MODULE])
        _active, _mode = True, versions.PATCH
    _run_for_imported(_on_imported, vllm_0_20.PATCH_SETS)
    _run_for_imported(_on_engine_core_imported, [VLLM_ENGINE_CORE_MODULE])


def _register_hooks_once(host: str, hook: Callable[[ModuleType], None], module_names: Iterable[str]) -> None:
    """Register ``hook`` for each module, once per process and host (call it holding _LOCK).

    Registered while inactive: wrapt fires a hook at once for a module already imported,
    and the hook does nothing then; :func:`_run_for_imported` handles those modules after
    the checks, so that a failure can undo everything.
    """
    if host in _HOOKED:
        return
    import wrapt

    for name in module_names:
        wrapt.register_post_import_hook(hook, name)
    _HOOKED.add(host)


def _run_for_imported(hook: Callable[[ModuleType], None], module_names: Iterable[str]) -> None:
    """Run ``hook`` for each module vLLM has imported already; all or nothing."""
    for name in module_names:
        module = sys.modules.get(name)
        if module is not None:
            try:
                hook(module)
            except BaseException:
                deactivate()  # a retry starts from scratch
                raise


# --- no mode (vLLM 0.21-0.22): vLLM runs stock, an explicit choice is refused ------------------

_stock_reason = ""


def _on_unserved_module_imported(module: ModuleType) -> None:
    if _active and _mode == "none":
        from mla_prefill_ext.hosts.core.stock_guard import STOCK_GUARD

        STOCK_GUARD.arm(_stock_reason, module)


def _activate_stock_guard(reason: str) -> None:
    """Say why nothing is patched, refuse an explicit choice now, guard the MLA layer when it loads."""
    global _active, _mode, _stock_reason
    from mla_prefill_ext.hosts.core.stock_guard import STOCK_GUARD
    from mla_prefill_ext.mla_layers import MLA_MODULE

    with _LOCK:
        if _active:
            return
        _register_hooks_once("none", _on_unserved_module_imported, [MLA_MODULE])
        _active, _mode, _stock_reason = True, "none", reason
        try:
            STOCK_GUARD.arm(reason)  # says why now, and refuses an explicit choice in the environment
        except BaseException:
            _active, _mode = False, None  # all or nothing: a retry starts from scratch
            raise
    _run_for_imported(_on_unserved_module_imported, [MLA_MODULE])


# --- bridge mode (vLLM 0.23+): the add-on's backends in vLLM's own registry ---------------------


def _on_bridge_module_imported(module: ModuleType) -> None:
    if not (_active and _mode == "bridge"):
        return
    from mla_prefill_ext.hosts import vllm_0_23
    from mla_prefill_ext.mla_layers import MLA_MODULE

    if module.__name__ == vllm_0_23.PREFILL_PACKAGE:
        reason = vllm_0_23.instrument()
        if reason is not None:
            vllm_0_23.refuse_if_explicit(reason)  # an explicit choice in the environment fails now
    else:
        vllm_0_23.instrument_binding(module)
        if module.__name__ == MLA_MODULE and vllm_0_23.is_instrumented():
            _instrument_shared_prefix(module)


def _activate_bridge(decision: Any) -> None:
    """Arm the bridge: it lands when vLLM's MLA prefill package is imported (at once, usually)."""
    global _active, _mode
    from mla_prefill_ext.hosts import VLLM_ENGINE_CORE_MODULE, vllm_0_23

    with _LOCK:
        if _active:
            return
        _register_hooks_once("bridge", _on_bridge_module_imported, vllm_0_23.BINDING_MODULES)
        _register_hooks_once("engine-core", _on_engine_core_imported, [VLLM_ENGINE_CORE_MODULE])
        _active, _mode = True, "bridge"
    if decision.warning is not None:
        from mla_prefill_ext._logging import logger

        logger.warning("mla-prefill-ext: %s", decision.warning)
    _run_for_imported(_on_bridge_module_imported, vllm_0_23.BINDING_MODULES)
    _run_for_imported(_on_engine_core_imported, [VLLM_ENGINE_CORE_MODULE])


# -------------------------------------------------------------------------------------------------


def deactivate() -> None:
    """Remove every wrapper and disarm the hooks (idempotent).

    A host that was never imported armed nothing: it is not imported here either.
    """
    global _active, _mode
    from mla_prefill_ext.hosts import (
        BRIDGE_HOST,
        ENGINE_CORE_PATH_MODULE,
        PATCH_HOST,
        SHARED_PREFIX_MODULE,
        STOCK_GUARD_MODULE,
        VLLM_ENGINE_CORE_MODULE,
    )

    with _LOCK:
        _active, _mode = False, None
    if ENGINE_CORE_PATH_MODULE in sys.modules and VLLM_ENGINE_CORE_MODULE in sys.modules:
        sys.modules[ENGINE_CORE_PATH_MODULE].INSTRUMENTOR.uninstrument(sys.modules[VLLM_ENGINE_CORE_MODULE])
    if SHARED_PREFIX_MODULE in sys.modules:
        from mla_prefill_ext.mla_layers import MLA_MODULE

        sys.modules[SHARED_PREFIX_MODULE].INSTRUMENTOR.uninstrument(sys.modules.get(MLA_MODULE))
    if f"{BRIDGE_HOST}.bridge" in sys.modules:
        sys.modules[BRIDGE_HOST].uninstrument()
    if STOCK_GUARD_MODULE in sys.modules:
        from mla_prefill_ext.mla_layers import MLA_MODULE

        sys.modules[STOCK_GUARD_MODULE].STOCK_GUARD.disarm(sys.modules.get(MLA_MODULE))
    patch_host = sys.modules.get(PATCH_HOST)
    if patch_host is None:
        return
    for name, patch_set in patch_host.PATCH_SETS.items():
        module = sys.modules.get(name)
        # Nothing to remove where the patch set never loaded.
        if module is not None and patch_set in sys.modules:
            patch_host.instrumentor_for(name).uninstrument(module)
