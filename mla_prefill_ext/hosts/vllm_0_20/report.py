"""What the patch host reports to ``mla-prefill-ext info`` (vLLM 0.20.x; on 0.21-0.22, where nothing is
patched, its targets as found there and the core's stock guard)."""

from __future__ import annotations

from types import ModuleType

from mla_prefill_ext.hosts.core.report import HostReport


def host_report(mla_module: ModuleType | None) -> HostReport:
    """The MLA patch set's state, and its targets as found in ``mla_module`` (None: not importable)."""
    from mla_prefill_ext.hosts.core.stock_guard import STOCK_GUARD
    from mla_prefill_ext.hosts.vllm_0_20 import mla
    from mla_prefill_ext.hosts.vllm_0_20.targets import inspect_targets

    state = mla.state()
    targets = state.targets or (inspect_targets(mla_module) if mla_module is not None else [])
    # On 0.21-0.22 activation arms only the core's stock guard: its reason is why nothing is patched.
    skipped = state.skipped_reason or STOCK_GUARD.reason
    return HostReport(state.instrumented, skipped, targets, None, [], [])
