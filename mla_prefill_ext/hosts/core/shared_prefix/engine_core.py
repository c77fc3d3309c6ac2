"""The engine core's part of the shared-prefix path: a shared prefix's block hashes and lookup done once,
and a burst of requests over it started in one step.

Wrappers in ``vllm.v1.engine.core`` (``hosts.VLLM_ENGINE_CORE_MODULE``, hooked by activation; as
in vLLM 0.20.2, 0.25.1, 0.33.0 and 0.34.0) and two in ``vllm.v1.core.kv_cache_coordinator``, all or none:
``EngineCore._initialize_kv_caches(vllm_config)``, which ``EngineCore.__init__`` calls after vLLM
loaded its plugins (the add-on activates there) and before it makes the block hasher, notes the
engine's configuration; the module's binding of ``get_request_block_hasher`` then returns a
:class:`~.prefix_hashes.ReusingHasher` around vLLM's hasher when :func:`.switch.decide_hash_reuse`
says so, one INFO line per process and decision. ``UnitaryKVCacheCoordinator.__init__`` notes the
coordinators the engine core's scheduler makes in between, and with the same decision each that can
serve it gets a :class:`~.prefix_hits.PrefixHits`, which its ``find_longest_cache_hit`` then goes
through. ``EngineCoreProc._process_input_queue`` gathers a burst over a shared prefix that reaches an
idle engine core, timed by ``EngineCoreProc.preprocess_add_request`` (:mod:`.arrivals`), when the busy
loop has the shape checked by :func:`arrival_problem` (else one INFO line, and the reuse stays). When a
module has another shape nothing is wrapped and one INFO line says why: vLLM hashes and looks up every
request's blocks and steps at its first request.

The shapes are the rows of :data:`.needs.NEEDS` for the parts ``hashes``, ``hits`` and ``gather``
(signatures and attributes, nothing read from vLLM's bytecode). What the reuse relies on beyond them is
checked against vLLM itself in each engine: its first reused hashes against vLLM's hasher, its
coordinator's first lent hits against vLLM's lookup; a difference turns that engine's reuse off with one
INFO line (:mod:`.prefix_hashes`, :mod:`.prefix_hits`).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import threading
from types import ModuleType
from typing import Any

from mla_prefill_ext import versions
from mla_prefill_ext._logging import log_once
from mla_prefill_ext.hosts.core.instrumentor import Instrumentor
from mla_prefill_ext.hosts.core.shared_prefix import arrivals, counters, needs, prefix_hits, switch
from mla_prefill_ext.hosts.core.shared_prefix.prefix_hashes import ReusingHasher
from mla_prefill_ext.settings import gather_window_ms

KV_CACHE_UTILS_MODULE = "vllm.v1.core.kv_cache_utils"
KV_INIT = "EngineCore._initialize_kv_caches"
FACTORY = "get_request_block_hasher"
LOOKAHEAD = "num_hash_lookahead_tokens"  # vLLM 0.33+: hashes that also cover the drafter's next tokens

_LOCAL = threading.local()  # the configuration of the engine core being built on this thread


def problem() -> str | None:
    """Why vLLM's engine core has not the shape the hash reuse's wrappers were written for (None: it has):
    the ``hashes`` rows of :data:`.needs.NEEDS` that do not hold here.

    Signatures and attributes only: that the reused hashes are vLLM's is compared at each engine's first
    reuse (:class:`~.prefix_hashes.ReusingHasher`), and that the configuration is noted before the
    hasher is made is seen as it happens (:func:`make_hasher`)."""
    return "; ".join(needs.problems("hashes", needs.ANY)) or None


def arrival_problem(core_module: ModuleType | None = None) -> str | None:
    """Why vLLM's engine core process has not the shape the gathering was written for (None: it has):
    the ``gather`` rows of :data:`.needs.NEEDS` that do not hold here (they name the engine core's module
    themselves: ``core_module`` is accepted for callers that pass it)."""
    return "; ".join(needs.problems("gather", needs.ANY)) or None


def note_engine_config(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    """``EngineCore._initialize_kv_caches``: the configuration noted for the hasher made after it."""
    config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
    # The gathering's window, checked at start-up rather than at the first request, in every MLA
    # engine whose busy loop is wrapped (also where it would not gather: one rule, as info states it).
    model = getattr(config, "model_config", None)
    if getattr(model, "use_mla", False) and getattr(INSTRUMENTOR, "arrival_problem", "") is None:
        try:
            gather_window_ms()
        except ValueError as e:
            raise RuntimeError(f"mla-prefill-ext: {e}") from None
    _LOCAL.config = config
    prefix_hits.collect(True)  # the scheduler's coordinator is made next, before the block hasher
    return wrapped(*args, **kwargs)


def make_hasher(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    """``get_request_block_hasher``: vLLM's hasher, inside a reusing one when the decision says so."""
    inner = wrapped(*args, **kwargs)
    config, _LOCAL.config = getattr(_LOCAL, "config", None), None
    bound = inspect.signature(wrapped).bind(*args, **kwargs)
    bound.apply_defaults()
    block_size = next(iter(bound.arguments.values()), None)
    if config is None:
        # EngineCore.__init__ notes it first (_initialize_kv_caches); any other order or caller is
        # left to vLLM, and the line below says so.
        decision = switch.PathDecision(
            False, "the engine's configuration was not seen before its block hasher"
        )
    elif not isinstance(block_size, int) or block_size <= 0:
        decision = switch.PathDecision(
            False, f"{FACTORY}'s first argument is not a block size ({block_size!r})"
        )
    elif bound.arguments.get(LOOKAHEAD):
        # Each hash then covers tokens after its block too: equal blocks are not enough.
        decision = switch.PathDecision(
            False, "the hashes look ahead for speculative decoding (not served yet)"
        )
    else:
        try:
            decision = switch.decide_hash_reuse(config)
        except ValueError as e:  # an invalid switch stops the engine, naming it
            raise RuntimeError(f"mla-prefill-ext: {e}") from None
    attached = prefix_hits.attach(decision.on)
    problems = attached.problems
    log_once(
        logging.INFO,
        ("shared-prefix-hashes", decision, tuple(problems)),
        "MLA shared-prefix prefill (mla-prefill-ext): block hashes and prefix-cache hits of shared "
        "prefixes %s (%s)%s.",
        "reused" if decision.on else "not reused",
        decision.reason,
        f"; prefix-cache hits not reused: {'; '.join(problems)}" if problems else "",
    )
    if not decision.on:
        return inner
    utils = importlib.import_module(KV_CACHE_UTILS_MODULE)
    # Every chain starts from vLLM's NONE_HASH, which another engine in this process may draw again.
    hasher = ReusingHasher(inner, block_size, epoch=lambda: getattr(utils, "NONE_HASH", None))
    hasher.followers.extend(attached.hits)  # this engine's hits stop with its hash reuse
    HASHERS.append(hasher)
    del HASHERS[:-4]  # the latest engines' hashers, for reports and tests
    return hasher


HASHERS: list[ReusingHasher] = []


class EngineCoreInstrumentor(Instrumentor):
    """The wrappers over ``vllm.v1.engine.core``, all or none (the core's :class:`Instrumentor`); the
    gathering's two only where its own shape check passes."""

    def check(self, module: ModuleType) -> str | None:
        """The ``hashes`` and ``hits`` rows of :data:`.needs.NEEDS` (the modules they name; ``module``
        is the engine core's, which they name too)."""
        return problem() or prefix_hits.coordinator_problem()

    def wrappers(self, module: ModuleType) -> list[tuple[str, Any]]:
        wrappers: list[tuple[str, Any]] = [(KV_INIT, note_engine_config), (FACTORY, make_hasher)]
        # The gathering is checked apart: a vLLM whose busy loop has another shape keeps the reuse.
        self.arrival_problem = arrival_problem()
        if self.arrival_problem is None:
            wrappers += [
                (arrivals.TARGET, arrivals.process_input_queue),
                (arrivals.INPUT_TARGET, arrivals.preprocess_add_request),
            ]
        else:
            log_once(
                logging.INFO,
                ("shared-prefix-gather-shape", self.arrival_problem),
                "MLA shared-prefix prefill (mla-prefill-ext): vLLM %s: an idle engine core steps at its "
                "first request as vLLM does (%s).",
                versions.installed_vllm_version(),
                self.arrival_problem,
            )
        return wrappers

    def complete(self, module: ModuleType) -> str | None:
        """The coordinator's two wrappers, with the engine core's or not at all."""
        coordinators = importlib.import_module(prefix_hits.COORDINATOR_MODULE)
        cls = prefix_hits.COORDINATOR
        return self._state.wrappers.wrap_all(
            coordinators,
            [
                (f"{cls}.__init__", prefix_hits.note_coordinator),
                (f"{cls}.find_longest_cache_hit", prefix_hits.find_longest_cache_hit),
            ],
        )

    def skip(self, reason: str, module: ModuleType | None = None) -> None:
        reason = f"vLLM {versions.installed_vllm_version()}: {reason}"
        super().skip(reason, module)
        log_once(
            logging.INFO,
            ("shared-prefix-hashes-shape", reason),
            "MLA shared-prefix prefill (mla-prefill-ext): block hashes and prefix-cache hits not reused "
            "(%s); vLLM hashes and looks up every request's blocks.",
            reason,
        )

    def report(self) -> dict[str, object]:
        """Wrapped or why not; the blocks the latest hasher reused and hashed, and the cache hits the
        latest coordinator reused and looked up, in this process."""
        latest = HASHERS[-1] if HASHERS else None
        hits = prefix_hits.latest()
        return {
            "instrumented": self.is_instrumented(),
            "problem": self.state().skipped_reason,
            "reused_blocks": latest.reused_blocks if latest else 0,
            "hashed_blocks": latest.hashed_blocks if latest else 0,
            "reused_hits": hits.reused_hits if hits else 0,
            "looked_up_hits": hits.looked_up if hits else 0,
            "gather_problem": getattr(self, "arrival_problem", None) if self.is_instrumented() else None,
            # Why the latest engine's reuse stopped at its first comparison with vLLM's (None: it did not).
            "hashes_off": latest.off if latest else None,
            "hits_off": hits.off if hits else None,
            "gathers": counters.get("gathers"),
            "gathered": counters.get("gathered"),
        }


INSTRUMENTOR = EngineCoreInstrumentor()
