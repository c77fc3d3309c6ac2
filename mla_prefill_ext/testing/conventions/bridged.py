"""vLLM 0.23+'s calling convention, through the bridge: a backend as the installed vLLM runs it.

The backend is built as the bridge registers it (:func:`mla_prefill_ext.hosts.vllm_0_23.adapter.make_adapter`:
a subclass of vLLM's own ``MLAPrefillBackend`` around the add-on class) and driven with the
keywords vLLM's ``forward_mha`` passes:

* ``run_prefill_new_tokens(q=, k=, v=, return_softmax_lse=, out=None, output_scale=None)``;
* vLLM 0.23-0.27: ``run_prefill_context_chunk(chunk_idx=i, q=q, k=, v=)``, on the problem's own
  metadata (vLLM's ``MLACommonPrefillMetadata`` with the per-chunk lists of those releases);
* vLLM 0.29+: ``run_prefill_context_chunk(chunk=chunk, q=q[chunk.token_slice], k=, v=)`` with
  vLLM's own ``ContextChunk`` objects, one per chunk of the problem, in vLLM's own
  ``MLACommonPrefillMetadata`` (its ``ChunkedContextMetadata``, host query lengths included).
  The chunks are the problem's (every request in each, as the checks expect), not those vLLM's
  planner would cut; vLLM's planner and ``forward_mha`` run in the bridge's CPU tests.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from mla_prefill_ext.backends.base import MLAPrefillBackend, context_chunks
from mla_prefill_ext.hosts.vllm_0_23.shape import CHUNK_OBJECT, Shape
from mla_prefill_ext.mla_layers import MLA_MODULE
from mla_prefill_ext.testing.conventions.base import StepResult, drive_step
from mla_prefill_ext.testing.problem import PrefillProblem


def _build(cls: type, **values: Any) -> Any:
    """A vLLM dataclass from the fields it has here (they differ between releases)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in names})


def vllm_chunked_metadata(problem: PrefillProblem) -> Any:
    """vLLM 0.29+'s prefill metadata for the problem: its chunks as vLLM's ContextChunk objects."""
    import importlib

    metadata_cls = importlib.import_module(MLA_MODULE).MLACommonPrefillMetadata
    base = problem.metadata
    q_loc = base.query_start_loc
    q_host = q_loc.to("cpu")
    query_lens = q_host[1:] - q_host[:-1]
    tokens, requests = int(q_host[-1]), len(problem.new_lens)
    chunks = []
    offsets = torch.zeros(requests, dtype=torch.int32)  # where each request's next chunk starts
    for c in context_chunks(base):
        seq_lens = c.seq_lens.to("cpu", torch.int32)
        starts, offsets = offsets, offsets + seq_lens
        token_to_seq = torch.repeat_interleave(torch.arange(requests, dtype=torch.int32), seq_lens)
        chunks.append(
            _build(
                metadata_cls.ContextChunk,
                index=c.index,
                request_slice=slice(0, requests),
                token_slice=slice(0, tokens),
                continuation_token_end=int(q_host[1]),
                is_continuation=False,
                num_context_tokens=int(seq_lens.sum()),
                query_start_loc=q_loc,
                max_query_len=int(base.max_query_len),
                cu_seq_lens=c.cu_seq_lens,
                starts=starts.to(q_loc.device),
                max_seq_len=int(c.max_seq_len),
                seq_lens=seq_lens,
                token_to_seq=token_to_seq.to(q_loc.device),
                all_rows_active=bool((query_lens > 0).all() and (seq_lens > 0).all()),
            )
        )
    context_lens = [int(x) for x in problem.context_lens]
    chunked = _build(
        metadata_cls.ChunkedContextMetadata,
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=q_loc.device),
        workspace=torch.empty(0, device=q_loc.device),
        chunks=chunks,
        context_lens_list=context_lens,
        empty_token_slices=[
            slice(int(q_host[i]), int(q_host[i + 1])) for i, n in enumerate(context_lens) if n == 0
        ],
    )
    return _build(
        metadata_cls,
        block_table=base.block_table,
        query_start_loc=q_loc,
        max_query_len=base.max_query_len,
        chunked_context=chunked if chunks else None,
        q_data_type=base.q_data_type,
        output_dtype=base.output_dtype,
        query_lens_cpu=query_lens.to(torch.int32),
    )


class BridgedConvention:
    """A backend through the bridge's adapter, called as the installed vLLM (0.23+) calls it."""

    def __init__(self, shape: Shape) -> None:
        self.shape = shape

    def construct(self, cls: type[MLAPrefillBackend], kwargs: dict[str, Any]) -> Any:
        from mla_prefill_ext.hosts.vllm_0_23.adapter import make_adapter

        return make_adapter(cls.get_name(), cls, self.shape)(**kwargs)

    def new_tokens_call(self, with_lse: bool) -> str:
        return f"run_prefill_new_tokens(return_softmax_lse={with_lse}, out=None, output_scale=None)"

    def chunk_call(self, index: int) -> str:
        if self.shape.chunk_api == CHUNK_OBJECT:
            return f"run_prefill_context_chunk(chunk=<vLLM ContextChunk {index}>)"
        return f"run_prefill_context_chunk(chunk_idx={index})"

    def run_step(
        self, backend: Any, problem: PrefillProblem, with_lse: bool, plain: PrefillProblem | None
    ) -> StepResult:
        p = problem
        objects = self.shape.chunk_api == CHUNK_OBJECT
        prepared: list[Any] = []  # the step's metadata, once prepare() has made it

        def prepare() -> None:
            prepared.append(vllm_chunked_metadata(p) if objects else p.metadata)
            backend.prepare_metadata(prepared[0])

        def new_tokens(t: PrefillProblem, lse: bool) -> Any:
            return backend.run_prefill_new_tokens(
                q=t.q, k=t.k, v=t.v, return_softmax_lse=lse, out=None, output_scale=None
            )

        def chunk(i: int, kc: torch.Tensor, vc: torch.Tensor) -> Any:
            if objects:
                c = prepared[0].chunked_context.chunks[i]
                return backend.run_prefill_context_chunk(chunk=c, q=p.q[c.token_slice], k=kc, v=vc)
            return backend.run_prefill_context_chunk(chunk_idx=i, q=p.q, k=kc, v=vc)

        return drive_step(self, p, with_lse, plain, prepare, new_tokens, chunk)


def installed_vllm_convention() -> Any:
    """The calling convention of the installed vLLM: the bridge's on 0.23+, else vLLM 0.20's."""
    from mla_prefill_ext import versions
    from mla_prefill_ext.testing.conventions.chunk_index import ChunkIndexConvention

    if versions.decide().mode != versions.BRIDGE:
        return ChunkIndexConvention()
    from mla_prefill_ext.hosts.vllm_0_23.shape import current

    shape, _ = current()
    return ChunkIndexConvention() if shape is None else BridgedConvention(shape)
