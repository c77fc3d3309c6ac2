"""The engine core's part of the shared-prefix path: a shared prefix's block hashes and lookup done once,
and a burst of requests over it started in one step.

Wrappers in ``vllm.v1.engine.core`` (``hosts.VLLM_ENGINE_CORE_MODULE``, hooked by activation; as
in vLLM 0.20.2, 0.25.1 and 0.33.0) and two in ``vllm.v1.core.kv_cache_coordinator``, all or none:
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
"""

from __future__ import annotations

import importlib
import inspect
import logging
import threading
import types
from types import ModuleType
from typing import Any

from mla_prefill_ext import versions
from mla_prefill_ext._logging import log_once
from mla_prefill_ext.hosts.core.instrumentor import Instrumentor
from mla_prefill_ext.hosts.core.shared_prefix import arrivals, prefix_hits, switch
from mla_prefill_ext.hosts.core.shared_prefix.prefix_hashes import ReusingHasher
from mla_prefill_ext.settings import gather_window_ms

KV_CACHE_UTILS_MODULE = "vllm.v1.core.kv_cache_utils"
KV_INIT = "EngineCore._initialize_kv_caches"
FACTORY = "get_request_block_hasher"
LOOKAHEAD = "num_hash_lookahead_tokens"  # vLLM 0.33+: hashes that also cover the drafter's next tokens

# Every name the hasher vLLM's factory returns reads (0.20.2, 0.25.1; 0.33.0 adds its lookahead and
# multimodal window), those it must read, and what each source of vLLM's extra keys reads: a name
# outside these sets is a vLLM this was not written for (a new input to a block's hash would make two
# plain requests' equal tokens hash differently), so nothing is wrapped there.
HASHER_MUST_READ = frozenset(
    {"block_hashes", "num_tokens", "all_token_ids", "generate_block_hash_extra_keys", "hash_block_tokens"}
)
HASHER_MAY_READ = HASHER_MUST_READ | {
    "append",
    "len",
    "generate_lookahead_block_hash_extra_keys",
    "get_mm_features_in_window",
    "mm_features",
    "mm_position",
    "offset",
    "length",
}
EXTRA_KEYS_READ = frozenset(
    {
        "_gen_mm_extra_hash_keys",
        "_gen_lora_extra_hash_keys",
        "_gen_prompt_embeds_extra_hash_keys",
        "cache_salt",
        "tuple",
    }
)
# Each source, what it may read (the request field it starts from is one of those a plain request has
# empty, prefix_hashes.is_plain).
EXTRA_KEY_SOURCES = {
    "_gen_mm_extra_hash_keys": {
        "mm_features",
        "append",
        "identifier",
        "len",
        "length",
        "mm_position",
        "offset",
    },
    "_gen_lora_extra_hash_keys": {"lora_request", "lora_name", "lora_path"},
    "_gen_prompt_embeds_extra_hash_keys": {
        "prompt_embeds",
        "_prompt_embeds_per_block_hashes",
        "digest",
        "get",
        "hashlib",
        "sha256",
        "tensor_data",
    },
}

_LOCAL = threading.local()  # the configuration of the engine core being built on this thread


def _code_names(obj: Any) -> tuple[str, ...]:
    code = getattr(getattr(obj, "__wrapped__", obj), "__code__", None)
    return code.co_names if code is not None else ()


def problem(core_module: ModuleType, kv_cache_utils: ModuleType) -> str | None:
    """Why these modules do not have the shape the wrappers were written for (None: they do)."""
    engine_core = getattr(core_module, "EngineCore", None)
    if engine_core is None or "_initialize_kv_caches" not in engine_core.__dict__:
        return f"{core_module.__name__}.{KV_INIT} is not defined there"
    if "vllm_config" not in inspect.signature(engine_core.__dict__["_initialize_kv_caches"]).parameters:
        return f"{KV_INIT} takes no vllm_config"
    init_names = _code_names(engine_core.__init__)
    if FACTORY not in init_names or "_initialize_kv_caches" not in init_names:
        return f"EngineCore.__init__ no longer calls {FACTORY} and _initialize_kv_caches"
    if init_names.index("_initialize_kv_caches") > init_names.index(FACTORY):
        return f"EngineCore.__init__ makes the block hasher before {KV_INIT}"
    factory = getattr(core_module, FACTORY, None)
    vllms_factory = getattr(factory, "__wrapped__", factory)
    if vllms_factory is not getattr(kv_cache_utils, FACTORY, None):
        return f"{core_module.__name__}.{FACTORY} is not vLLM's {KV_CACHE_UTILS_MODULE}.{FACTORY}"
    params = list(inspect.signature(factory).parameters)
    if len(params) not in (2, 3) or params[2:] not in ([], [LOOKAHEAD]):
        return f"{FACTORY} does not take (block size, hash function[, {LOOKAHEAD}])"
    code = getattr(vllms_factory, "__code__", None)
    hashers = [c for c in (code.co_consts if code else ()) if isinstance(c, types.CodeType)]
    if len(hashers) != 1:
        return f"{FACTORY} no longer makes one hasher"
    reads = set(hashers[0].co_names)
    if HASHER_MUST_READ - reads or reads - HASHER_MAY_READ:
        return (
            f"the hasher {FACTORY} returns reads {sorted(reads - HASHER_MAY_READ)} (unknown here), "
            f"not {sorted(HASHER_MUST_READ - reads)}"
        )
    extra = set(_code_names(getattr(kv_cache_utils, "generate_block_hash_extra_keys", None)))
    if not extra or extra - EXTRA_KEYS_READ:
        return f"vLLM's block extra keys read {sorted(extra - EXTRA_KEYS_READ) or 'nothing known'}"
    for name, may_read in EXTRA_KEY_SOURCES.items():
        source_reads = set(_code_names(getattr(kv_cache_utils, name, None)))
        if not source_reads or source_reads - may_read:
            return f"vLLM's {name} reads {sorted(source_reads - may_read) or 'nothing known'}"
    return None


# What the gathering (:mod:`.arrivals`) reads and calls on vLLM's engine core process.
PROC_METHODS = ("_process_input_queue", "has_work", "is_running", "_handle_client_request")
INPUT_QUEUE_READS = frozenset({"input_queue", "has_work", "_handle_client_request"})


def arrival_problem(core_module: ModuleType) -> str | None:
    """Why vLLM's engine core process has not the shape the gathering was written for (None: it has)."""
    proc = getattr(core_module, "EngineCoreProc", None)
    if proc is None or "_process_input_queue" not in proc.__dict__:
        return f"{core_module.__name__}.{arrivals.TARGET} is not defined there"
    missing = [name for name in PROC_METHODS if not callable(getattr(proc, name, None))]
    if missing:
        return f"EngineCoreProc has no {', '.join(missing)}"
    unread = INPUT_QUEUE_READS - set(_code_names(proc.__dict__["_process_input_queue"]))
    if unread:
        return f"{arrivals.TARGET} no longer reads {sorted(unread)}"
    init_names = set(_code_names(core_module.EngineCore.__init__))
    if not {"request_block_hasher", "vllm_config", "scheduler"} <= init_names:
        return "EngineCore.__init__ no longer keeps request_block_hasher, vllm_config and scheduler"
    if not callable(getattr(proc, "preprocess_add_request", None)):
        return f"{core_module.__name__}.{arrivals.INPUT_TARGET} is not defined there"
    if "preprocess_add_request" not in _code_names(getattr(proc, "process_input_sockets", None)):
        return "EngineCoreProc.process_input_sockets no longer calls preprocess_add_request"
    return None


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
    block_size = next(iter(bound.arguments.values()))
    if config is None:
        decision = switch.PathDecision(
            False, "the engine's configuration was not seen before its block hasher"
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
    problems = prefix_hits.attach(decision.on)
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
    hasher = ReusingHasher(inner, int(block_size), epoch=lambda: getattr(utils, "NONE_HASH", None))
    HASHERS.append(hasher)
    del HASHERS[:-4]  # the latest engines' hashers, for reports and tests
    return hasher


HASHERS: list[ReusingHasher] = []


class EngineCoreInstrumentor(Instrumentor):
    """The wrappers over ``vllm.v1.engine.core``, all or none (the core's :class:`Instrumentor`); the
    gathering's two only where its own shape check passes."""

    def check(self, module: ModuleType) -> str | None:
        try:
            return problem(module, importlib.import_module(KV_CACHE_UTILS_MODULE)) or (
                prefix_hits.coordinator_problem(importlib.import_module(prefix_hits.COORDINATOR_MODULE))
            )
        except (ImportError, TypeError, ValueError) as e:
            return f"its shape could not be read ({type(e).__name__}: {e})"

    def wrappers(self, module: ModuleType) -> list[tuple[str, Any]]:
        wrappers: list[tuple[str, Any]] = [(KV_INIT, note_engine_config), (FACTORY, make_hasher)]
        # The gathering is checked apart: a vLLM whose busy loop has another shape keeps the reuse.
        self.arrival_problem = arrival_problem(module)
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
            "gathers": arrivals.GATHERS[0],
            "gathered": arrivals.GATHERS[1],
        }


INSTRUMENTOR = EngineCoreInstrumentor()
