"""Every vLLM internal the shared-prefix path reads, declared once: the part that reads it, the model
runner whose code it is, the module and attribute, and what is checked.

The instrumentor wraps a part only where its rows hold (:func:`problems`); ``info`` prints each row's
outcome (:func:`outcomes`). Each check is of behaviour a test can break: a signature, a dataclass's
fields, a callable; what the path relies on beyond that (the same blocks, hashes, outputs as vLLM's)
is checked against vLLM's own code in the tests, through vLLM's real classes. A row that does not hold
turns its part off with one line naming the row: nothing is guessed.

Runners: ``any`` (the MLA layer's code, whichever runner builds the step), ``V1`` (``vllm.v1.worker``,
vLLM up to 0.33), ``V2`` (``vllm.v1.worker.gpu``, the only runner of 0.34 and 0.33's default).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from mla_prefill_ext.mla_layers import MLA_MODULE

ANY, V1, V2 = "any", "V1", "V2"
RUNNERS = (V1, V2)

ATTENTION_MODULE = "vllm.v1.attention.backend"  # CommonAttentionMetadata (0.20.2-0.34.0)
V1_BLOCK_TABLE_MODULE = "vllm.v1.worker.block_table"
V2_BLOCK_TABLE_MODULE = "vllm.v1.worker.gpu.block_table"
V1_RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
RUNNER_MODULES = {V1: V1_RUNNER_MODULE, V2: "vllm.v1.worker.gpu.model_runner"}

CONTEXT_OWNERS = ("MLACommonBaseImpl", "MLACommonImpl")  # 0.29+ moved the context loop to the base
BUILD = "MLACommonMetadataBuilder.build"
DEVICE_TENSOR = "BlockTable.get_device_tensor"
APPEND_BLOCK_IDS = "BlockTables.append_block_ids"
REORDER = "GPUModelRunner._may_reorder_batch"
FA_MLA_MODULE = "vllm.v1.attention.backends.mla.flashattn_mla"  # FLASH_ATTN_MLA, Hopper's decode default
FORWARD_MQA = "FlashAttnMLAImpl.forward_mqa"
GATHER_BATCH = "GPUModelRunner.gather_batch_req_state"


def takes(*names: str) -> Callable[[Any], str | None]:
    def check(obj: Any) -> str | None:
        params = list(inspect.signature(obj).parameters)
        missing = [n for n in names if n not in params]
        return f"lacks parameters {missing}" if missing else None

    return check


def has_fields(*names: str) -> Callable[[Any], str | None]:
    def check(obj: Any) -> str | None:
        if not dataclasses.is_dataclass(obj):
            return "is not a dataclass"
        missing = sorted(set(names) - {f.name for f in dataclasses.fields(obj)})
        return f"lacks fields {missing}" if missing else None

    return check


def is_callable(obj: Any) -> str | None:
    return None if callable(obj) else "is not callable"


class Need(NamedTuple):
    part: str  # the path's part that reads it: "plan" (the step's plan and each layer) or "route"
    runner: str  # ANY, V1 or V2
    module: str
    attributes: tuple[str, ...]  # dotted in the module; the first defined one is read (versions differ)
    what: str  # what is checked, in words
    check: Callable[[Any], str | None]  # the attribute -> why it does not do (None: it does)
    wraps: bool = False  # the path wraps it: then it must be defined on that class, not inherited


NEEDS: tuple[Need, ...] = (
    Need(
        "plan",
        ANY,
        MLA_MODULE,
        (BUILD,),
        "the builder's build(common_prefix_len, common_attn_metadata): wrapped, the step planned after it",
        takes("common_prefix_len", "common_attn_metadata"),
        True,
    ),
    Need(
        "plan",
        ANY,
        MLA_MODULE,
        tuple(f"{owner}._compute_prefill_context" for owner in CONTEXT_OWNERS),
        "the context loop (q, kv_c_and_k_pe_cache, attn_metadata, k_scale): wrapped, replaced when planned",
        takes("q", "kv_c_and_k_pe_cache", "attn_metadata", "k_scale"),
        True,
    ),
    Need(
        "plan",
        ANY,
        MLA_MODULE,
        ("MLACommonPrefillMetadata",),
        "prefill metadata fields block_table, chunked_context, query_start_loc, q_data_type",
        has_fields("block_table", "chunked_context", "query_start_loc", "q_data_type"),
    ),
    Need(
        "plan",
        ANY,
        MLA_MODULE,
        ("MLACommonImpl._concat_k_nope_k_pe",),
        "the impl's K concatenation, called for the shared segments",
        is_callable,
    ),
    Need(
        "plan",
        ANY,
        MLA_MODULE,
        ("merge_attn_states",),
        "vLLM's LSE merge, called for the shared segments",
        is_callable,
    ),
    Need(
        "plan",
        ANY,
        "vllm._custom_ops",
        ("gather_and_maybe_dequant_cache",),
        "vLLM's latent gather, called for the shared segments",
        is_callable,
    ),
    Need(
        "plan",
        ANY,
        ATTENTION_MODULE,
        ("CommonAttentionMetadata",),
        "step fields num_reqs, query_start_loc_cpu, seq_lens_cpu_upper_bound, block_table_tensor",
        has_fields("num_reqs", "query_start_loc_cpu", "seq_lens_cpu_upper_bound", "block_table_tensor"),
    ),
    Need(
        "plan",
        V1,
        V1_BLOCK_TABLE_MODULE,
        (DEVICE_TENSOR,),
        "get_device_tensor(num_reqs): wrapped, its host twin noted",
        takes("num_reqs"),
        True,
    ),
    Need(
        "plan",
        V2,
        V2_BLOCK_TABLE_MODULE,
        (APPEND_BLOCK_IDS,),
        "append_block_ids(req_index, new_block_ids, overwrite): wrapped, the ids mirrored on the host",
        takes("req_index", "new_block_ids", "overwrite"),
        True,
    ),
    Need(
        "plan",
        V2,
        ATTENTION_MODULE,
        ("CommonAttentionMetadata",),
        "step field req_idx: each row's request in the runner (vLLM 0.33+)",
        has_fields("req_idx"),
    ),
    Need(
        "route",
        V1,
        V1_RUNNER_MODULE,
        (REORDER,),
        "_may_reorder_batch(scheduler_output): wrapped, the step's decode threshold lowered when routed",
        takes("scheduler_output"),
        True,
    ),
    # Decode rows (decode_rows), FLASH_ATTN_MLA's decode; vLLM 0.20.2-0.34.0.
    Need(
        "decode",
        ANY,
        FA_MLA_MODULE,
        (FORWARD_MQA,),
        "forward_mqa(q, kv_c_and_k_pe_cache, attn_metadata, layer): wrapped, a step's decode groups served",
        takes("q", "kv_c_and_k_pe_cache", "attn_metadata", "layer"),
        True,
    ),
    Need(
        "decode",
        ANY,
        FA_MLA_MODULE,
        ("FlashAttnMLADecodeMetadata",),
        "decode metadata fields block_table, seq_lens, query_start_loc, max_query_len",
        has_fields("block_table", "seq_lens", "query_start_loc", "max_query_len"),
    ),
    Need(
        "decode",
        ANY,
        FA_MLA_MODULE,
        ("flash_attn_varlen_func",),
        "FA3's paged call (q_v, seqused_k, block_table, return_softmax_lse), called for the groups' calls",
        takes("q_v", "seqused_k", "block_table", "return_softmax_lse", "fa_version"),
    ),
    Need(
        "decode",
        V2,
        RUNNER_MODULES[V2],
        (GATHER_BATCH,),
        "gather_batch_req_state(scheduler_output, dummy_run) -> (batch state, uniform decode token count): "
        "wrapped, no uniform count for a step whose decode rows are served (dispatched to piecewise graphs)",
        takes("scheduler_output", "dummy_run"),
        True,
    ),
    Need(
        "decode",
        V2,
        RUNNER_MODULES[V2],
        ("BatchReqState",),
        "the batch state's idx_mapping_np: each batch row's request index in the runner",
        lambda state: has_attributes("idx_mapping_np")(state),  # the helper is defined at the end
    ),
    # The engine core's parts: block hashes (prefix_hashes), prefix-cache hits (prefix_hits), the
    # gathering of a burst (arrivals); vLLM 0.20.2-0.34.0.
    Need(
        "hashes",
        ANY,
        "vllm.v1.engine.core",
        ("EngineCore._initialize_kv_caches",),
        "_initialize_kv_caches(vllm_config): wrapped, the engine's configuration noted for the block "
        "hasher made after it (a hasher made without one is vLLM's, said in one line)",
        takes("vllm_config"),
        True,
    ),
    Need(
        "hashes",
        ANY,
        "vllm.v1.engine.core",
        ("get_request_block_hasher",),
        "the engine core's hasher factory (block size, caching_hash_fn[, lookahead]): wrapped, its hasher "
        "inside a reusing one, whose first reuse is compared with that hasher's own hashes",
        takes("caching_hash_fn"),
        True,
    ),
    Need(
        "hashes",
        ANY,
        "vllm.v1.core.kv_cache_utils",
        ("init_none_hash",),
        "NONE_HASH, every hash chain's start, drawn by each engine: donors of an earlier one are dropped",
        is_callable,
    ),
    Need(
        "hashes",
        ANY,
        "vllm.v1.request",
        ("Request",),
        "a request's block-hash inputs beyond its tokens (mm_features, lora_request, cache_salt, "
        "prompt_embeds; all empty: a plain request, the only kind that lends or takes hashes) and its "
        "block_hasher",
        takes("mm_features", "lora_request", "cache_salt", "prompt_embeds", "block_hasher"),
    ),
    Need(
        "hits",
        ANY,
        "vllm.v1.core.kv_cache_coordinator",
        ("UnitaryKVCacheCoordinator.__init__",),
        "the one-group coordinator (use_eagle, enable_caching, dcp/pcp_world_size, read back before hits "
        "are reused): wrapped, those its engine core makes noted",
        takes("use_eagle", "enable_caching", "dcp_world_size", "pcp_world_size"),
        True,
    ),
    Need(
        "hits",
        ANY,
        "vllm.v1.core.kv_cache_coordinator",
        ("UnitaryKVCacheCoordinator.find_longest_cache_hit",),
        "find_longest_cache_hit(block_hashes, max_cache_hit_length): wrapped, remembered hits lent, the "
        "first lend compared with vLLM's own lookup",
        takes("block_hashes", "max_cache_hit_length"),
        True,
    ),
    Need(
        "hits",
        ANY,
        "vllm.v1.core.single_type_kv_cache_manager",
        ("FullAttentionManager",),
        "the full-attention manager (MLA's spec is a full-attention spec): hits reused only over one",
        is_callable,
    ),
    Need(
        "hits",
        ANY,
        "vllm.v1.core.block_pool",
        ("BlockPool",),
        "the pool's enable_caching and hash_block_size, read before hits are reused",
        takes("enable_caching", "hash_block_size"),
    ),
    Need(
        "hits",
        ANY,
        "vllm.v1.core.kv_cache_utils",
        ("KVCacheBlock",),
        "a cached block's hash object, block_hash (None once evicted): a remembered block is lent while "
        "it holds the very object it was found with",
        lambda block: has_attributes("block_hash")(block),  # the helper is defined at the end
    ),
    Need(
        "gather",
        ANY,
        "vllm.v1.engine.core",
        ("EngineCoreProc._process_input_queue",),
        "the busy loop's wait for work: wrapped, a burst over a shared prefix gathered after it",
        is_callable,
        True,
    ),
    Need(
        "gather",
        ANY,
        "vllm.v1.engine.core",
        # EngineCore's up to 0.34, wrapped on EngineCoreProc alone (whose input thread calls it).
        ("EngineCoreProc.preprocess_add_request", "EngineCore.preprocess_add_request"),
        "preprocess_add_request(request), the input thread's work per request: wrapped on EngineCoreProc, "
        "timed (where the input thread does not call it, a gathering ends at once)",
        takes("request"),
        True,
    ),
    Need(
        "gather",
        ANY,
        "vllm.v1.engine.core",
        ("EngineCoreProc._handle_client_request",),
        "_handle_client_request(request_type, request): each call taken while gathering handled by it",
        takes("request_type", "request"),
    ),
    Need(
        "gather",
        ANY,
        "vllm.v1.engine.core",
        ("EngineCoreProc.has_work",),
        "has_work(): only an idle engine core gathers",
        is_callable,
    ),
    Need(
        "gather",
        ANY,
        "vllm.v1.engine.core",
        ("EngineCoreProc.is_running",),
        "is_running(): a gathering stops at shutdown",
        is_callable,
    ),
)
"""The table. On the V2 runner routing needs nothing of its own: the runner orders short extends before
prefills already, and the builder's split (its ``build``, above) takes the lowered threshold."""


def resolve(need: Need, module: Any) -> tuple[str, Any]:
    """(the attribute's path, the object) of the first of ``need.attributes`` defined in ``module``.

    A method the path wraps must be defined on the class itself (a wrapper on an inherited one would land
    on the base class, for every subclass).
    """
    for path in need.attributes:
        obj: Any = module
        parts = path.split(".")
        for i, name in enumerate(parts):
            owner = obj
            if need.wraps and i == len(parts) - 1 and inspect.isclass(owner) and name not in owner.__dict__:
                obj = None
                break
            obj = getattr(owner, name, None)
            if obj is None:
                break
        if obj is not None:
            return path, getattr(obj, "__wrapped__", obj)
    raise LookupError(f"{need.module}.{' or '.join(need.attributes)} not found")


def outcome(need: Need) -> str | None:
    """Why ``need`` does not hold in this vLLM (None: it does)."""
    try:
        module = importlib.import_module(need.module)
    except Exception as e:  # a vLLM without that module, or one that fails to import it
        return f"{need.module} does not import ({type(e).__name__}: {e})"
    try:
        path, obj = resolve(need, module)
        why = need.check(obj)
    except (LookupError, TypeError, ValueError) as e:
        return str(e)
    return None if why is None else f"{need.module}.{path} {why}"


def rows(part: str, runner: str) -> list[Need]:
    """The rows of ``part`` for ``runner`` (ANY: those every runner needs)."""
    return [n for n in NEEDS if n.part == part and n.runner == runner]


def problems(part: str, runner: str) -> list[str]:
    """Why the rows of ``part`` for ``runner`` do not hold here (empty: they all do)."""
    return [why for why in map(outcome, rows(part, runner)) if why is not None]


def runners_here() -> list[str]:
    """The model runners this vLLM has (0.34: V2 only), found without importing them."""
    import importlib.util

    return [
        runner for runner, module in RUNNER_MODULES.items() if importlib.util.find_spec(module) is not None
    ]


def outcomes(needs: Iterable[Need] = NEEDS) -> list[tuple[Need, str | None]]:
    """Each row with its outcome (for ``info``)."""
    return [(n, outcome(n)) for n in needs]


def has_attributes(*names: str) -> Callable[[Any], str | None]:
    """A class with each of ``names``: a dataclass field, a property or any other attribute (vLLM 0.34
    made ``KVCacheBlock.block_hash`` a field; before, a property over a field of another name)."""

    def check(obj: Any) -> str | None:
        fields = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else set()
        missing = [n for n in names if n not in fields and not hasattr(obj, n)]
        return f"lacks attributes {missing}" if missing else None

    return check
