"""Activation: vLLM calls :func:`activate` in every process it starts.

The entry point ``mla_prefill_ext = mla_prefill_ext:activate`` in the group
``vllm.general_plugins`` makes vLLM run it in the front end, the engine core and
each worker (Ray workers included, after vLLM has applied the environment it
copies to them) before the model is built. Activation is cheap: it checks the vLLM
version and arms ``wrapt`` post-import hooks, so the patch lands when vLLM's MLA
module is imported, whether that happened before activation or happens after it.
The patch's own modules load only then: processes that never import the MLA
module (an API server front end, a model without MLA) never pay for them.
"""

from __future__ import annotations

import logging
import sys
import threading
from types import ModuleType

from mla_prefill_ext.settings import DISABLE_ENV, ask_vllm_to_copy_to_ray, is_disabled

__all__ = ["DISABLE_ENV", "activate", "deactivate", "is_active", "is_disabled"]

ARG_UTILS_MODULE = "vllm.engine.arg_utils"

_LOCK = threading.Lock()
_active = False
_hooks_registered = False


def is_active() -> bool:
    return _active


def _on_mla_module_imported(module: ModuleType) -> None:
    # wrapt keeps post-import hooks for the life of the process; this one is
    # disarmed by deactivate() rather than removed.
    if _active:
        from mla_prefill_ext import patches

        patches.instrument(module)


def _on_arg_utils_imported(module: ModuleType) -> None:
    if _active:
        from mla_prefill_ext.patches import engine_config

        engine_config.instrument(module)


def _vllm_missing() -> bool:
    if "vllm" in sys.modules:
        return False
    import importlib.util

    return importlib.util.find_spec("vllm") is None


def activate() -> None:
    """Arm the patch in this process (idempotent; all or nothing; a no-op when disabled).

    On an unsupported vLLM the hook is armed all the same: it then patches nothing
    and only guards against an explicit backend choice (see ``patches.skip``).
    """
    global _active, _hooks_registered
    if _vllm_missing():
        logging.getLogger("mla_prefill_ext").warning(
            "mla-prefill-ext: vLLM is not installed in this environment; nothing to activate."
        )
        return
    # Before the disable check: the switch itself must reach Ray workers too.
    ask_vllm_to_copy_to_ray()
    if is_disabled():
        return
    from mla_prefill_ext.patches import MLA_MODULE
    from mla_prefill_ext.patches.version import unsupported_reason

    with _LOCK:
        if _active:
            return
        _active = True
        try:
            reason = unsupported_reason()
            if reason is not None:
                from mla_prefill_ext.patches import skip

                skip(reason)  # says why now, and refuses an explicit choice in the environment
            if not _hooks_registered:
                import wrapt

                # Both fire at once when the module is already imported.
                if reason is None:
                    wrapt.register_post_import_hook(_on_arg_utils_imported, ARG_UTILS_MODULE)
                wrapt.register_post_import_hook(_on_mla_module_imported, MLA_MODULE)
                _hooks_registered = True
                return
        except BaseException:
            _active = False  # all or nothing: a retry starts from scratch
            raise
    for name, hook in ((ARG_UTILS_MODULE, _on_arg_utils_imported), (MLA_MODULE, _on_mla_module_imported)):
        module = sys.modules.get(name)
        if module is not None:
            try:
                hook(module)
            except BaseException:
                deactivate()
                raise


def deactivate() -> None:
    """Remove every wrapper and disarm the hooks (idempotent)."""
    global _active
    from mla_prefill_ext import patches

    with _LOCK:
        _active = False
    if "mla_prefill_ext.patches.engine_config" in sys.modules:
        module = sys.modules.get(ARG_UTILS_MODULE)
        if module is not None:
            from mla_prefill_ext.patches import engine_config

            engine_config.uninstrument(module)
    module = sys.modules.get(patches.MLA_MODULE)
    if module is not None and "mla_prefill_ext.patches.instrumentor" in sys.modules:
        patches.uninstrument(module)  # nothing to remove where the patch never loaded
