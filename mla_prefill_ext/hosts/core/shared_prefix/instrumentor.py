"""The shared-prefix path's wrappers: all or none, symmetric and idempotent, on the core's bookkeeping.

Three wrappers: the MLA metadata builder's ``build`` (:func:`.step.after_build`), the MLA impl's
``_compute_prefill_context`` (:func:`.layer.compute_prefill_context`) and the runner block
table's ``get_device_tensor`` (:func:`.block_tables.remember_host_twin`); and, once vLLM's GPU
model runner module is imported, its ``_may_reorder_batch`` (:func:`.routing.may_reorder_batch`:
short extends that share a prefix routed to the prefill path) and its ``_update_states`` with the input
batch's ``add_request`` (:mod:`.prompt_rows`: a shared prefix's prompt tokens copied from a request already
in the batch), each with its own shape check. Applied when vLLM's MLA
module is imported, after the host's own patch (vLLM 0.20) or bridge (0.23+), and only when
:mod:`.targets` finds the shape they were written for; otherwise one INFO line says why and
vLLM's context path runs as it always does.
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
    prompt_rows,
    routing,
    step,
    switch,
    targets,
)


class SharedPrefixInstrumentor:
    def __init__(self) -> None:
        self.wrappers = Wrappers()
        self.instrumented = False
        self.routing = False  # short extends routed (the runner's reorder wrapped)
        self.prompts = False  # new requests' prompts take lenders' rows (the runner's batch wrapped)
        self.problem: str | None = None  # why nothing is wrapped (None: wrapped, or not tried yet)
        self._lock = threading.RLock()

    def instrument(self, mla_module: ModuleType) -> bool:
        """Wrap vLLM's context path (all or none; idempotent). True when in place."""
        with self._lock:
            if self.instrumented:
                return True
            try:
                block_table_module = importlib.import_module(targets.BLOCK_TABLE_MODULE)
                problem = targets.problem(mla_module, block_table_module)
            except ImportError as e:
                problem = f"{targets.BLOCK_TABLE_MODULE} does not import ({e})"
            if problem is None:
                problem = self.wrappers.wrap_all(
                    mla_module,
                    [
                        (targets.BUILD, step.after_build),
                        (targets.context_path(mla_module), layer.compute_prefill_context),
                    ],
                )
            if problem is None:
                problem = self.wrappers.wrap_all(
                    block_table_module, [(targets.DEVICE_TENSOR, block_tables.remember_host_twin)]
                )
                if problem is not None:
                    self.wrappers.unwrap_all()
            if problem is not None:
                self.problem = f"vLLM {versions.installed_vllm_version()}: {problem}"
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
        # Routing short extends is an addition the path works without: its own target, its own line.
        wrapt.register_post_import_hook(self._instrument_runner, targets.RUNNER_MODULE)
        return True

    def _instrument_runner(self, runner_module: ModuleType) -> None:
        with self._lock:
            if not self.instrumented:
                return
            self._instrument_prompts(runner_module)
            if self.routing:
                return
            problem = targets.routing_problem(runner_module)
            if problem is None:
                problem = self.wrappers.wrap_all(
                    runner_module, [(targets.REORDER, routing.may_reorder_batch)]
                )
            if problem is not None:
                log_once(
                    logging.INFO,
                    ("shared-prefix-routing", problem),
                    "MLA shared-prefix prefill (mla-prefill-ext): short extends stay on vLLM's decode path "
                    "(%s).",
                    problem,
                )
                return
            self.routing = True

    def _instrument_prompts(self, runner_module: ModuleType) -> None:
        # Another addition the path works without: its own targets, its own line.
        if self.prompts:
            return
        try:
            input_batch_module = importlib.import_module(targets.INPUT_BATCH_MODULE)
            problem = targets.prompts_problem(runner_module, input_batch_module)
        except ImportError as e:
            problem = f"{targets.INPUT_BATCH_MODULE} does not import ({e})"
        except Exception as e:  # inside vLLM's import of its runner: never let it fail there
            problem = f"its shape could not be read ({type(e).__name__}: {e})"
        if problem is None:
            problem = self.wrappers.wrap_each(
                [
                    (runner_module, targets.UPDATE_STATES, prompt_rows.update_states),
                    (input_batch_module, targets.ADD_REQUEST, prompt_rows.add_request),
                ]
            )
        if problem is not None:
            log_once(
                logging.INFO,
                ("shared-prefix-prompts", problem),
                "MLA shared-prefix prefill (mla-prefill-ext): each new request's prompt is copied into the "
                "runner's batch as vLLM does (%s).",
                problem,
            )
            return
        self.prompts = True

    def uninstrument(self) -> None:
        """Remove every wrapper (idempotent)."""
        with self._lock:
            self.wrappers.unwrap_all()
            block_tables.forget()
            self.instrumented = False
            self.routing = False
            self.prompts = False
            self.problem = None

    def report(self) -> dict[str, object]:
        """The path's state in this process: wrapped, routing, why not, steps planned and routed."""
        return {
            "instrumented": self.instrumented,
            "routing": self.routing,
            "problem": self.problem,
            "steps_with_segments": step.PLANNED[0],
            "steps_routed": routing.ROUTED[0],
            "prompts": self.prompts,
            "prompts_copied": prompt_rows.COPIED[0],  # requests whose prompt took a lender's row
            "prompt_tokens_copied": prompt_rows.COPIED[1],
            "steps": routing.STEPS[0],
            "step_shapes": [list(shape) for shape in list(routing.SHAPES)],  # a copy: the runner appends
            "paused": [part for part in switch.PARTS if switch.paused(part)],  # switch.pause: benchmarks
        }


INSTRUMENTOR = SharedPrefixInstrumentor()
