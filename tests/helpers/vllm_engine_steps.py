"""vLLM's engine core scheduler and a model runner's block tables, stepped together on the CPU.

:class:`TwinSchedulers`: two of vLLM's real schedulers fed the same requests, aborts and model outputs.
One is made inside an engine core's build with the add-on's engine-core wrappers on, so its block
hasher is the add-on's reusing hasher and its coordinator looks up through the add-on's hits; the
other is stock (vLLM's own hasher and lookup): what vLLM itself computes for the same life.

:class:`V1Rows` and :class:`V2Rows`: a model runner's block tables (vLLM's ``InputBatch``; or its V2
``BlockTables`` with the request slots of its ``RequestState``), written from each scheduler output
the way the runner writes them (V1 ``GPUModelRunner._update_states``; V2 ``finish_requests``,
``add_requests``, ``update_requests``), batch order as the runner puts it. Each step gives the tensor a
metadata builder gets. The V2 runner's write and gather kernels need a GPU: their torch doubles from
:mod:`vllm_runner_objects` stand in.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch
from vllm_runner_objects import (
    accepted,
    empty_input_batch,
    unpinned,
    v2_apply,
    v2_gather,
    v2_on_cpu,
    v2_tables,
)
from vllm_scheduler_objects import engine_core_request, scheduler

SAMPLED = 7  # the token every finished prefill or decode samples (both schedulers see the same)


class TwinSchedulers:
    """The add-on's engine core scheduler (``ours``) and a stock one (``stock``), in lockstep."""

    def __init__(self, core_module: Any, vllm_config: Any, num_blocks: int, block_size: int) -> None:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core import kv_cache_utils

        hash_fn = get_hash_fn_by_name("sha256")
        kv_cache_utils.init_none_hash(hash_fn)
        # What EngineCore.__init__ does: _initialize_kv_caches (the add-on's wrapper notes the
        # configuration; vLLM's own method then stops here, without an executor), the scheduler, its
        # request block hasher (the wrapper attaches the hits to the scheduler's coordinator).
        engine = object.__new__(core_module.EngineCore)
        try:
            engine._initialize_kv_caches(vllm_config)
        except AttributeError:
            pass
        self.ours = scheduler(vllm_config, num_blocks, block_size)
        self.hasher = core_module.get_request_block_hasher(block_size, hash_fn)
        self.stock = scheduler(vllm_config, num_blocks, block_size)
        factory = kv_cache_utils.get_request_block_hasher
        self.stock_hasher = getattr(factory, "__wrapped__", factory)(block_size, hash_fn)

    def add(self, request_id: str, tokens: list[int], max_tokens: int = 1) -> tuple[Any, Any]:
        """One client request, as the engine core makes it from what its input thread decoded."""
        from vllm.v1.request import Request

        sent = engine_core_request(request_id, tokens, max_tokens)
        ours = Request.from_engine_core_request(sent, self.hasher)
        stock = Request.from_engine_core_request(sent, self.stock_hasher)
        self.ours.add_request(ours)
        self.stock.add_request(stock)
        return ours, stock

    def abort(self, *request_ids: str) -> None:
        from vllm.v1.request import RequestStatus

        for sched in (self.ours, self.stock):
            sched.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)

    def schedule(self) -> tuple[Any, Any]:
        return self.ours.schedule(), self.stock.schedule()

    def finish_step(self, outputs: tuple[Any, Any]) -> None:
        """The model's output for each scheduler's step: a token for each request whose prefill is done."""
        from vllm.v1.outputs import ModelRunnerOutput

        for sched, output in zip((self.ours, self.stock), outputs, strict=True):
            ids = list(output.num_scheduled_tokens)
            sampled = []
            for rid in ids:
                request = sched.requests[rid]
                sampled.append([SAMPLED] if request.num_computed_tokens >= request.num_tokens else [])
            result = ModelRunnerOutput(
                **accepted(
                    ModelRunnerOutput,
                    req_ids=ids,
                    req_id_to_index={rid: i for i, rid in enumerate(ids)},
                    sampled_token_ids=sampled,
                )
            )
            sched.update_from_output(output, result)


def scheduled(output: Any) -> dict[str, Any]:
    """What a scheduler output tells the runner about blocks and tokens, comparable across schedulers."""

    def ids(groups: Any) -> Any:
        return None if groups is None else tuple(tuple(g) for g in groups)

    cached = output.scheduled_cached_reqs
    return {
        "new": {r.req_id: (ids(r.block_ids), r.num_computed_tokens) for r in output.scheduled_new_reqs},
        "cached": {
            rid: (ids(new), n)
            for rid, new, n in zip(
                cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
            )
        },
        "tokens": dict(output.num_scheduled_tokens),
        "finished": set(output.finished_req_ids),
        "preempted": set(output.preempted_req_ids or ()),
    }


def computed_before(output: Any) -> dict[str, int]:
    """Each scheduled request's cached tokens before this step (its context in this step)."""
    cached = output.scheduled_cached_reqs
    before = dict(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
    before.update({r.req_id: r.num_computed_tokens for r in output.scheduled_new_reqs})
    return before


class RunnerStep(NamedTuple):
    table: torch.Tensor  # what the runner hands a metadata builder (rows in batch order)
    req_idx: np.ndarray | None  # V2: each batch row's request slot (the builder's metadata carries it)
    req_ids: list[str]  # batch order


class V1Rows:
    """The V1 runner's persistent batch (vLLM's ``InputBatch`` and its block table)."""

    def __init__(self, block_size: int, max_model_len: int = 2048, max_num_reqs: int = 16) -> None:
        self.batch = empty_input_batch(block_size, max_model_len, max_num_reqs)
        self.states: dict[str, Any] = {}

    def slot(self, request_id: str) -> int | None:
        return self.batch.req_id_to_index.get(request_id)

    def apply(self, output: Any, decode_threshold: int = 1) -> RunnerStep:
        """``GPUModelRunner._update_states`` for the block table, then its reorder and commit."""
        from vllm.v1.attention.backends.utils import reorder_batch_to_split_decodes_and_prefills
        from vllm.v1.worker.gpu_input_batch import CachedRequestState

        batch = self.batch
        for rid in output.finished_req_ids:
            self.states.pop(rid, None)
            batch.remove_request(rid)
        cached = output.scheduled_cached_reqs
        resumed = set(getattr(cached, "resumed_req_ids", ()) or ())
        scheduled = set(output.num_scheduled_tokens)
        for rid in set(batch.req_id_to_index) - (scheduled - resumed):  # preempted or not scheduled
            batch.remove_request(rid)
        to_add = []
        for new in output.scheduled_new_reqs:
            state = CachedRequestState(
                **accepted(
                    CachedRequestState,
                    req_id=new.req_id,
                    prompt_token_ids=new.prompt_token_ids,
                    mm_features=[],
                    sampling_params=new.sampling_params,
                    generator=None,
                    block_ids=tuple(list(g) for g in new.block_ids),
                    num_computed_tokens=new.num_computed_tokens,
                    output_token_ids=[],
                )
            )
            self.states[new.req_id] = state
            to_add.append(state)
        for rid, new_ids, computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            state = self.states[rid]
            state.num_computed_tokens = computed
            if rid in resumed:
                state.block_ids = tuple(list(g) for g in new_ids)
            elif new_ids is not None:
                for have, more in zip(state.block_ids, new_ids, strict=True):
                    have.extend(more)
            index = batch.req_id_to_index.get(rid)
            if index is None:
                to_add.append(state)
                continue
            batch.num_computed_tokens_cpu[index] = computed
            if new_ids is not None:
                batch.block_table.append_row(new_ids, index)
        for state in to_add:
            batch.add_request(state)
        batch.condense()
        reorder_batch_to_split_decodes_and_prefills(batch, output, decode_threshold=decode_threshold)
        batch.refresh_metadata()  # the step's removals and additions taken (the next step's go on a new list)
        n = batch.num_reqs
        with unpinned():  # vLLM 0.33 pins the host rows it copies where its platform says so
            batch.block_table.commit_block_table(n)
        return RunnerStep(batch.block_table[0].get_device_tensor(n), None, list(batch.req_ids[:n]))


class V2Rows:
    """The V2 runner's block tables (vLLM's ``BlockTables``) and request slots (its ``RequestState``)."""

    def __init__(self, block_size: int, max_model_len: int = 2048, max_num_reqs: int = 16) -> None:
        from vllm.v1.worker.gpu.states import RequestState

        self.tables = v2_tables(block_size, max_num_reqs=max_num_reqs, max_blocks=max_model_len // block_size)
        with v2_on_cpu():
            self.states = RequestState(
                **accepted(
                    RequestState,
                    max_num_reqs=max_num_reqs,
                    max_model_len=max_model_len,
                    max_num_batched_tokens=max_model_len,
                    num_speculative_steps=0,
                    vocab_size=1000,
                    device=torch.device("cpu"),
                )
            )

    def slot(self, request_id: str) -> int | None:
        return self.states.req_id_to_index.get(request_id)

    def apply(self, output: Any, decode_threshold: int = 1) -> RunnerStep:
        """The runner's ``finish_requests``, ``add_requests`` and ``update_requests`` for the block
        tables (request state staged only: its kernel needs a GPU), the step's batch order and gather."""
        from vllm.v1.worker.gpu.model_runner import sort_batch_req_ids

        states = self.states
        for rid in sorted(set(output.finished_req_ids) | set(output.preempted_req_ids or ())):
            states.remove_request(rid)
        for new in output.scheduled_new_reqs:
            states.remove_request(new.req_id)  # as add_requests does (a streaming input's next chunk)
            tokens = list(new.prefill_token_ids or new.prompt_token_ids)
            states.add_request(
                req_id=new.req_id,
                prompt_len=len(new.prompt_token_ids),
                all_token_ids=tokens,
                num_computed_tokens=new.num_computed_tokens,
                max_tokens=new.sampling_params.max_tokens,
            )
            self.tables.append_block_ids(states.req_id_to_index[new.req_id], new.block_ids, overwrite=True)
        cached = output.scheduled_cached_reqs
        for rid, new_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if new_ids is not None:
                self.tables.append_block_ids(states.req_id_to_index[rid], new_ids, overwrite=False)
        v2_apply(self.tables)
        # Decodes (one token: no speculative decoding here), short extends, prefills.
        order = sort_batch_req_ids(
            dict(output.num_scheduled_tokens), dict(output.scheduled_spec_decode_tokens), 1
        )
        req_idx = np.array([states.req_id_to_index[rid] for rid in order], dtype=np.int32)
        return RunnerStep(v2_gather(self.tables, req_idx), req_idx, list(order))
