"""Activation: vLLM calls :func:`activate` in every process it starts.

The entry point ``mla_prefill_ext = mla_prefill_ext:activate`` in the group
``vllm.general_plugins`` makes vLLM run it in the front end, the engine core and
each worker before the model is built. Activation is cheap: it checks the vLLM
version and arms a ``wrapt`` post-import hook, so the patch lands when vLLM's MLA
module is imported, whether that happened before activation or happens after it.
The patch's own modules load only then: processes that never import the MLA
module (an API server front end, a model without MLA) never pay for them.
"""

from __future__ import annotations

import os
import sys
import threading
from types import ModuleType

DISABLE_ENV = "MLA_PREFILL_EXT_DISABLE"

_LOCK = threading.Lock()
_active = False
_hook_registered = False


def is_disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def is_active() -> bool:
    return _active


def _on_mla_module_imported(module: ModuleType) -> None:
    # wrapt keeps post-import hooks for the life of the process; this one is
    # disarmed by deactivate() rather than removed.
    if _active:
        from mla_prefill_ext import patches

        patches.instrument(module)


def activate() -> None:
    """Arm the patch in this process (idempotent; a no-op when disabled).

    On an unsupported vLLM the hook is armed all the same: it then patches nothing
    and only guards against an explicit backend choice (see ``patches.skip``).
    """
    global _active, _hook_registered
    if is_disabled():
        return
    from mla_prefill_ext.patches import MLA_MODULE
    from mla_prefill_ext.patches.version import unsupported_reason

    with _LOCK:
        if _active:
            return
        _active = True
        reason = unsupported_reason()
        if reason is not None:
            from mla_prefill_ext.patches import skip

            try:
                skip(reason)  # says why now, and refuses an explicit choice in the environment
            except RuntimeError:
                _active = False
                raise
        if not _hook_registered:
            import wrapt

            _hook_registered = True
            # Fires at once when the module is already imported.
            wrapt.register_post_import_hook(_on_mla_module_imported, MLA_MODULE)
            return
    module = sys.modules.get(MLA_MODULE)
    if module is not None:
        _on_mla_module_imported(module)


def deactivate() -> None:
    """Remove every wrapper and disarm the hook (idempotent)."""
    global _active
    from mla_prefill_ext import patches

    with _LOCK:
        _active = False
    module = sys.modules.get(patches.MLA_MODULE)
    if module is not None and "mla_prefill_ext.patches.instrumentor" in sys.modules:
        patches.uninstrument(module)  # nothing to remove where the patch never loaded
