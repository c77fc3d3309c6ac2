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

import importlib
import logging
import threading
from types import ModuleType

import wrapt

from mla_prefill_ext import versions
from mla_prefill_ext._logging import log_once
from mla_prefill_ext.hosts.core.instrumentor import Wrappers
from mla_prefill_ext.hosts.core.shared_prefix import (
    block_tables,
    layer,
    needs,
    routing,
    step,
    switch,
)


class SharedPrefixInstrumentor:
    def __init__(self) -> None:
        self.wrappers = Wrappers()
        self.instrumented = False
        self.routing = False  # V1: short extends routed (the runner's reorder wrapped)
        self.problem: str | None = None  # why nothing is wrapped (None: wrapped, or not tried yet)
        self._lock = threading.RLock()

    def _wrap_rows(self, part: str, runner: str) -> str | None:
        """Wrap what the rows of ``part`` for ``runner`` wrap (all or none): None, or why not."""
        problems = needs.problems(part, runner)
        if problems:
            return "; ".join(problems)
        table = []
        for need in needs.rows(part, runner):
            if need.wraps:
                module = importlib.import_module(need.module)
                path, _ = needs.resolve(need, module)
                table.append((module, path, _WRAPPERS[need.attributes[0]]))
        return self.wrappers.wrap_each(table)

    def instrument(self, mla_module: ModuleType) -> bool:
        """Wrap vLLM's context path and the block tables of each runner that has the shape (all of the
        context path and at least one runner, or none; idempotent). True when in place."""
        with self._lock:
            if self.instrumented:
                return True
            problem = self._wrap_rows("plan", needs.ANY)
            if problem is None:
                for runner in needs.RUNNERS:
                    block_tables.RUNNER_PROBLEMS[runner] = self._wrap_rows("plan", runner)
                if all(block_tables.RUNNER_PROBLEMS.values()):
                    problem = "; ".join(f"{r}: {why}" for r, why in block_tables.RUNNER_PROBLEMS.items())
                    self.wrappers.unwrap_all()
            if problem is not None:
                self.problem = f"vLLM {versions.installed_vllm_version()}: {problem}"
                block_tables.RUNNER_PROBLEMS.clear()
                log_once(
                    logging.INFO,
                    ("shared-prefix-shape", self.problem),
                    "MLA shared-prefix prefill (mla-prefill-ext): not available (%s); vLLM's own context "
                    "path runs.",
                    self.problem,
                )
                return False
            self.problem = None
            self.instrumented = True
        # Routing short extends on the V1 runner is an addition the path works without: its own line.
        wrapt.register_post_import_hook(self._instrument_runner, needs.V1_RUNNER_MODULE)
        return True

    def _instrument_runner(self, runner_module: ModuleType) -> None:
        with self._lock:
            if not self.instrumented or block_tables.RUNNER_PROBLEMS.get(needs.V1):
                return
            if self.routing:
                return
            try:
                problem = self._wrap_rows("route", needs.V1)
            except Exception as e:  # inside vLLM's import of its runner: never let it fail there
                problem = f"its shape could not be read ({type(e).__name__}: {e})"
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

    def uninstrument(self) -> None:
        """Remove every wrapper (idempotent)."""
        with self._lock:
            self.wrappers.unwrap_all()
            block_tables.forget()
            block_tables.RUNNER_PROBLEMS.clear()
            self.instrumented = False
            self.routing = False
            self.problem = None

    def report(self) -> dict[str, object]:
        """The path's state in this process: wrapped, routing, why not, steps planned and routed."""
        return {
            "instrumented": self.instrumented,
            "routing": self.routing,
            "runners": {r: why for r, why in block_tables.RUNNER_PROBLEMS.items()},  # None: served
            "problem": self.problem,
            "steps_with_segments": step.PLANNED[0],
            "steps_routed": routing.ROUTED[0],
            "steps": routing.STEPS[0],
            "step_shapes": [list(shape) for shape in list(routing.SHAPES)],  # a copy: the runner appends
            "paused": [part for part in switch.PARTS if switch.paused(part)],  # switch.pause: benchmarks
        }


_WRAPPERS = {
    needs.BUILD: step.after_build,
    f"{needs.CONTEXT_OWNERS[0]}._compute_prefill_context": layer.compute_prefill_context,
    needs.DEVICE_TENSOR: block_tables.remember_host_twin,
    needs.APPEND_BLOCK_IDS: block_tables.mirror_block_ids,
    needs.REORDER: routing.may_reorder_batch,
}
"""The add-on's wrapper for each wrapped row of :data:`.needs.NEEDS` (by its first attribute)."""

INSTRUMENTOR = SharedPrefixInstrumentor()
