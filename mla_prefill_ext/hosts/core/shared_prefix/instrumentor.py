"""The shared-prefix path's wrappers: all or none, symmetric and idempotent, on the core's bookkeeping.

What is wrapped is the table's (:mod:`.needs`): the MLA metadata builder's ``build``
(:func:`.step.after_build`) and the context loop ``_compute_prefill_context``
(:func:`.layer.compute_prefill_context`), all or none; then each model runner's block tables, where its
rows hold: the V1 runner's ``BlockTable.get_device_tensor`` (:func:`.block_tables.remember_host_twin`), the
V2 runner's ``BlockTables.append_block_ids`` (:func:`.block_tables.mirror_block_ids`), at least one of
them; and once vLLM's V1 runner module is imported, its ``_may_reorder_batch``
(:func:`.routing.may_reorder_batch`: short extends that share a prefix routed to the prefill path; on the
V2 runner the builder decides that itself). Applied when vLLM's MLA module is imported, after the host's
own patch (vLLM 0.20) or bridge (0.23+); where a row does not hold, one INFO line says which and vLLM's
context path runs as it always does.
"""

from __future__ import annotations

import functools
import importlib
import logging
from types import ModuleType
from typing import Any

import wrapt

from mla_prefill_ext import versions
from mla_prefill_ext._logging import log_once
from mla_prefill_ext.hosts.core.instrumentor import Instrumentor
from mla_prefill_ext.hosts.core.shared_prefix import (
    block_tables,
    counters,
    decode_rows,
    layer,
    needs,
    routing,
    step,
)
from mla_prefill_ext.settings import shared_decode_setting


class SharedPrefixInstrumentor(Instrumentor):
    """The path over vLLM's MLA module (the core's :class:`Instrumentor`: all or none, symmetric,
    idempotent): the context path's rows in :meth:`wrappers`, each runner's block tables in :meth:`complete`
    (at least one runner), the V1 runner's routing once its module is imported."""

    def __init__(self) -> None:
        super().__init__()
        self.routing = False  # V1: short extends routed (the runner's reorder wrapped)

    def check(self, module: ModuleType) -> str | None:
        return "; ".join(needs.problems("plan", needs.ANY)) or None

    def wrappers(self, module: ModuleType) -> list[tuple[str, Any]]:
        return [(path, wrapper) for _, path, wrapper in _wrapped_rows("plan", needs.ANY)]

    def complete(self, module: ModuleType) -> str | None:
        """Each runner's block tables, all of its rows or none; None when at least one runner's landed."""
        for runner in needs.RUNNERS:
            problems = needs.problems("plan", runner)
            block_tables.RUNNER_PROBLEMS[runner] = "; ".join(problems) or self._state.wrappers.wrap_each(
                _wrapped_rows("plan", runner)
            )
        if all(block_tables.RUNNER_PROBLEMS.values()):
            return "; ".join(f"{r}: {why}" for r, why in block_tables.RUNNER_PROBLEMS.items())
        return None

    def skip(self, reason: str, module: ModuleType | None = None) -> None:
        reason = f"vLLM {versions.installed_vllm_version()}: {reason}"
        super().skip(reason, module)
        block_tables.RUNNER_PROBLEMS.clear()
        log_once(
            logging.INFO,
            ("shared-prefix-shape", reason),
            "MLA shared-prefix prefill (mla-prefill-ext): not available (%s); vLLM's own context path runs.",
            reason,
        )

    def on_instrumented(self, module: ModuleType) -> None:
        # Routing short extends on the V1 runner is an addition the path works without: its own line.
        wrapt.register_post_import_hook(self._instrument_runner, needs.V1_RUNNER_MODULE)
        # So are decode rows, where the user turned them on (each decode layer call passes the wrapper):
        # FLASH_ATTN_MLA's forward_mqa, and the V2 runner's graph choice for the steps they serve.
        if shared_decode_setting()[0]:
            for runner, module in (
                (needs.ANY, needs.FA_MLA_MODULE),
                (needs.V2, needs.RUNNER_MODULES[needs.V2]),
            ):
                wrapt.register_post_import_hook(functools.partial(self._instrument_decode, runner), module)

    def _instrument_decode(self, runner: str, module: ModuleType) -> None:
        with self._lock:
            if not self.is_instrumented() or decode_rows.WRAP_PROBLEMS[runner] is None:
                return
            decode_rows.WRAP_PROBLEMS[runner] = self._wrap_part("decode", runner)

    def _instrument_runner(self, runner_module: ModuleType) -> None:
        with self._lock:
            if not self.is_instrumented() or self.routing or block_tables.RUNNER_PROBLEMS.get(needs.V1):
                return
            problem = self._wrap_part("route", needs.V1)
            if problem is not None:
                log_once(
                    logging.INFO,
                    ("shared-prefix-routing", problem),
                    "MLA shared-prefix prefill (mla-prefill-ext): on the V1 model runner, short extends stay "
                    "on vLLM's decode path (%s).",
                    problem,
                )
                return
            self.routing = True

    def _wrap_part(self, part: str, runner: str) -> str | None:
        """Wrap the rows of ``part`` for ``runner`` where they all hold, all or none: why not (None: wrapped).
        Runs inside vLLM's import of the module (a post-import hook): it never raises there."""
        try:
            return "; ".join(needs.problems(part, runner)) or self._state.wrappers.wrap_each(
                _wrapped_rows(part, runner)
            )
        except Exception as e:
            return f"its shape could not be read ({type(e).__name__}: {e})"

    def on_uninstrumented(self, module: ModuleType) -> None:
        block_tables.forget()
        block_tables.RUNNER_PROBLEMS.clear()
        self.routing = False
        decode_rows.WRAP_PROBLEMS.update(decode_rows.NOT_WRAPPED)

    def report(self) -> dict[str, object]:
        """The path's state in this process: wrapped, routing, why not, steps planned and routed."""
        return {
            "instrumented": self.is_instrumented(),
            "routing": self.routing,
            "runners": dict(block_tables.RUNNER_PROBLEMS),  # runner -> None (served) or why not
            "problem": self._state.skipped_reason,
            "steps_with_segments": counters.get("steps_with_segments"),
            "steps_routed": counters.get("steps_routed"),
            "steps_with_decode_groups": counters.get("steps_with_decode_groups"),
            "decode_problems": dict(decode_rows.WRAP_PROBLEMS),
            "steps_dispatched_piecewise": counters.get("steps_dispatched_piecewise"),
            "steps": counters.get("steps"),  # the V1 runner's reorders (every scheduled step there)
            "step_shapes": [list(shape) for shape in list(routing.SHAPES)],  # a copy: the runner appends
        }


def _wrapped_rows(part: str, runner: str) -> list[tuple[ModuleType, str, Any]]:
    """(module, path, the add-on's wrapper) of each wrapped row of ``part`` for ``runner``."""
    table = []
    for need in needs.rows(part, runner):
        if need.wraps:
            module = importlib.import_module(need.module)
            table.append((module, needs.resolve(need, module)[0], _WRAPPERS[need.attributes[0]]))
    return table


_WRAPPERS = {
    needs.BUILD: step.after_build,
    f"{needs.CONTEXT_OWNERS[0]}._compute_prefill_context": layer.compute_prefill_context,
    needs.DEVICE_TENSOR: block_tables.remember_host_twin,
    needs.APPEND_BLOCK_IDS: block_tables.mirror_block_ids,
    needs.REORDER: routing.may_reorder_batch,
    needs.FORWARD_MQA: decode_rows.forward_mqa,
    needs.GATHER_BATCH: decode_rows.uniform_unless_served,
}
"""The add-on's wrapper for each wrapped row of :data:`.needs.NEEDS` (by its first attribute)."""

INSTRUMENTOR = SharedPrefixInstrumentor()
