"""The shape vLLM's context path must have for the shared-prefix path to take its place.

As in vLLM 0.20.2, 0.25.1 and 0.33.0: ``_compute_prefill_context(q, kv_c_and_k_pe_cache,
attn_metadata, k_scale)`` defined on ``MLACommonImpl`` (on ``MLACommonBaseImpl`` from 0.29), gathering with
``gather_and_maybe_dequant_cache``; the metadata builder's ``build(common_prefix_len,
common_attn_metadata)`` sizing chunks from ``chunked_prefill_workspace_size``; the prefill
metadata a dataclass with ``block_table`` and ``chunked_context``; the runner's
``BlockTable.get_device_tensor(num_reqs)``. vLLM 0.29+ plans its own context chunks as objects
(``plan_mla_context_chunks``); the path replaces that loop whole, so those do not matter to it.
"""

from __future__ import annotations

import dataclasses
import inspect
from types import ModuleType
from typing import Any

BLOCK_TABLE_MODULE = "vllm.v1.worker.block_table"
RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
INPUT_BATCH_MODULE = "vllm.v1.worker.gpu_input_batch"

CONTEXT_OWNERS = ("MLACommonImpl", "MLACommonBaseImpl")  # 0.20-0.27; 0.29+ moved it to the base
BUILD = "MLACommonMetadataBuilder.build"
DEVICE_TENSOR = "BlockTable.get_device_tensor"
REORDER = "GPUModelRunner._may_reorder_batch"
UPDATE_STATES = "GPUModelRunner._update_states"
ADD_REQUEST = "InputBatch.add_request"


def _defined(module: ModuleType, path: str) -> Any:
    owner_name, _, name = path.rpartition(".")
    owner = getattr(module, owner_name, None)
    if owner is None:
        raise LookupError(f"{module.__name__}.{owner_name} not found")
    if name not in owner.__dict__:
        raise LookupError(f"{module.__name__}.{path} is not defined there")
    obj = owner.__dict__[name]
    return getattr(obj, "__wrapped__", obj)


def _params(obj: Any, path: str, *names: str) -> None:
    params = list(inspect.signature(obj).parameters)
    missing = [n for n in names if n not in params]
    if missing:
        raise LookupError(f"{path} lacks parameters {missing}")


def _refers(obj: Any, path: str, *names: str) -> None:
    code = getattr(obj, "__code__", None)
    missing = [n for n in names if code is None or n not in code.co_names]
    if missing:
        raise LookupError(f"{path} no longer refers to {missing}")


def context_path(mla_module: ModuleType) -> str:
    """Where vLLM defines ``_compute_prefill_context`` (``MLACommonImpl`` up to 0.27, its base from 0.29)."""
    for owner in CONTEXT_OWNERS:
        if "_compute_prefill_context" in getattr(getattr(mla_module, owner, None), "__dict__", {}):
            return f"{owner}._compute_prefill_context"
    return f"{CONTEXT_OWNERS[0]}._compute_prefill_context"


def problem(mla_module: ModuleType, block_table_module: ModuleType) -> str | None:
    """Why these vLLM modules do not have the shape the path patches (None: they do)."""
    context_target = context_path(mla_module)
    try:
        context = _defined(mla_module, context_target)
        _params(context, context_target, "q", "kv_c_and_k_pe_cache", "attn_metadata", "k_scale")
        _refers(context, context_target, "gather_and_maybe_dequant_cache")
        build = _defined(mla_module, BUILD)
        _params(build, BUILD, "common_prefix_len", "common_attn_metadata")
        _refers(build, BUILD, "chunked_prefill_workspace_size")
        for name in ("_concat_k_nope_k_pe",):
            if not callable(getattr(mla_module.MLACommonImpl, name, None)):
                raise LookupError(f"MLACommonImpl.{name} not found")
        prefill = getattr(mla_module, "MLACommonPrefillMetadata", None)
        fields = {f.name for f in dataclasses.fields(prefill)} if dataclasses.is_dataclass(prefill) else set()
        missing = {"block_table", "chunked_context", "query_start_loc", "q_data_type"} - fields
        if missing:
            raise LookupError(f"MLACommonPrefillMetadata lacks fields {sorted(missing)}")
        device_tensor = _defined(block_table_module, DEVICE_TENSOR)
        _params(device_tensor, DEVICE_TENSOR, "num_reqs")
    except (LookupError, TypeError, ValueError) as e:
        return str(e)
    return None


def routing_problem(runner_module: ModuleType) -> str | None:
    """Why short extends cannot be routed through this runner (None: they can)."""
    try:
        reorder = _defined(runner_module, REORDER)
        _params(reorder, REORDER, "scheduler_output")
        _refers(reorder, REORDER, "reorder_batch_to_split_decodes_and_prefills", "reorder_batch_threshold")
    except (LookupError, TypeError, ValueError) as e:
        return str(e)
    return None


def prompts_problem(runner_module: ModuleType, input_batch_module: ModuleType) -> str | None:
    """Why new requests' prompts cannot take a lender's row in this runner's input batch (None: they can).

    As in vLLM 0.20.2, 0.25.1 and 0.33.0: ``_update_states(scheduler_output)`` adds the step's new
    requests through ``InputBatch.add_request(request)``, which copies ``request.prompt_token_ids``
    into ``token_ids_cpu`` and keeps rows by ``req_id_to_index``, ``req_output_token_ids``,
    ``num_prompt_tokens`` and ``num_tokens_no_spec``; a ``CachedRequestState`` holds ``block_ids`` per
    KV cache group.
    """
    try:
        update = _defined(runner_module, UPDATE_STATES)
        _params(update, UPDATE_STATES, "scheduler_output")
        _refers(update, UPDATE_STATES, "add_request")
        add = _defined(input_batch_module, ADD_REQUEST)
        _params(add, ADD_REQUEST, "request")
        _refers(
            add,
            ADD_REQUEST,
            "token_ids_cpu",
            "prompt_token_ids",
            "req_id_to_index",
            "req_output_token_ids",
            "num_prompt_tokens",
            "num_tokens_no_spec",
        )
        state = getattr(input_batch_module, "CachedRequestState", None)
        fields = {f.name for f in dataclasses.fields(state)} if dataclasses.is_dataclass(state) else set()
        missing = {"req_id", "prompt_token_ids", "block_ids", "output_token_ids"} - fields
        if missing:
            raise LookupError(f"CachedRequestState lacks fields {sorted(missing)}")
    except (LookupError, TypeError, ValueError) as e:
        return str(e)
    return None
