"""vLLM 0.29+'s context chunks, as the add-on's backends read a step.

From 0.29 vLLM hands a backend one ``ContextChunk`` object per chunk and only the
query rows of that chunk's requests (``q[chunk.token_slice]``); the chunk carries
its own ``query_start_loc`` (relative to those rows), ``cu_seq_lens``,
``max_query_len``, ``max_seq_len`` and host ``seq_lens``. An add-on backend reads a
step through ``host_query_start_loc()`` and ``context_chunks()`` with the whole
``q``. So each chunk becomes a step of its own for a view instance (a clone of the
backend): that chunk's requests, their query offsets, one context chunk (index 0).
The views are prepared once per step, with the builder's instance, from host
copies only where vLLM has them (``query_lens_cpu``, the chunk's ``seq_lens``).
"""

from __future__ import annotations

from typing import Any

import torch

from mla_prefill_ext.backend_errors import note_backend_error
from mla_prefill_ext.backends.base import ContextChunk

# The attribute the add-on's context_chunks() reads first (mla_prefill_ext.backends.base).
CHUNKS_ATTR = "mla_prefill_context_chunks"


def _cumsum_from_zero(lens: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lens.shape[0] + 1, dtype=torch.int32)
    torch.cumsum(lens.to("cpu", torch.int32), dim=0, out=out[1:])
    return out


def attach_host_offsets(prefill_metadata: Any) -> None:
    """Host ``query_start_loc`` from vLLM's host query lengths (0.33's ``query_lens_cpu``), if any.

    Without them (0.25-0.27) ``host_query_start_loc()`` copies the device tensor once
    per step, as vLLM's own FlashInfer prefill does there.
    """
    if getattr(prefill_metadata, "query_start_loc_cpu", None) is not None:
        return
    lens = getattr(prefill_metadata, "query_lens_cpu", None)
    if isinstance(lens, torch.Tensor) and lens.device.type == "cpu":
        prefill_metadata.query_start_loc_cpu = _cumsum_from_zero(lens)


class ChunkStep:
    """One vLLM 0.29+ context chunk as a prefill step of its own (what a view instance reads)."""

    chunked_context = None  # the chunk lives in mla_prefill_context_chunks

    def __init__(
        self,
        query_start_loc: torch.Tensor,
        query_start_loc_cpu: torch.Tensor,
        max_query_len: int,
        q_data_type: Any,
        output_dtype: Any,
        mla_prefill_context_chunks: list[ContextChunk],
    ) -> None:
        self.query_start_loc = query_start_loc
        self.query_start_loc_cpu = query_start_loc_cpu
        self.max_query_len = max_query_len
        self.q_data_type = q_data_type
        self.output_dtype = output_dtype
        self.mla_prefill_context_chunks = mla_prefill_context_chunks


def chunk_step(prefill_metadata: Any, chunk: Any) -> ChunkStep:
    """The step a view instance prepares for ``chunk`` of ``prefill_metadata``."""
    query_lens = getattr(prefill_metadata, "query_lens_cpu", None)
    if isinstance(query_lens, torch.Tensor) and query_lens.device.type == "cpu":
        q_host = _cumsum_from_zero(query_lens[chunk.request_slice])
    else:
        q_host = chunk.query_start_loc.to("cpu", torch.int32)  # one copy, where vLLM keeps no host lengths
    seq_lens = torch.as_tensor(chunk.seq_lens).to("cpu", torch.int32)
    return ChunkStep(
        query_start_loc=chunk.query_start_loc,
        query_start_loc_cpu=q_host,
        max_query_len=int(chunk.max_query_len),
        q_data_type=prefill_metadata.q_data_type,
        output_dtype=prefill_metadata.output_dtype,
        mla_prefill_context_chunks=[
            ContextChunk(
                index=0,
                query_start_loc=chunk.query_start_loc,
                max_query_len=int(chunk.max_query_len),
                cu_seq_lens=chunk.cu_seq_lens,
                cu_seq_lens_cpu=_cumsum_from_zero(seq_lens),
                max_seq_len=int(chunk.max_seq_len),
                seq_lens=seq_lens,
            )
        ],
    )


class ChunkViews:
    """The views of one builder's instance: one clone of its add-on backend per chunk index."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._views: list[Any] = []
        self._steps: list[Any] = []  # the metadata each view was prepared with, this step

    def prepare(self, prefill_metadata: Any) -> None:
        """Prepare one view per chunk; the step itself shows the inner instance no chunks."""
        ctx = prefill_metadata.chunked_context
        steps = [] if ctx is None else [chunk_step(prefill_metadata, c) for c in ctx.chunks]
        while len(self._views) < len(steps):
            try:
                self._views.append(self._inner.clone())
            except Exception as e:  # never caught: named, it stops the engine in vLLM's worker
                note_backend_error(e, self._inner, f"clone (the view of context chunk {len(self._views)})")
                raise
        for index, (view, step) in enumerate(zip(self._views[: len(steps)], steps, strict=True)):
            try:
                view.prepare_metadata(step)
            except Exception as e:
                note_backend_error(e, view, f"prepare_metadata (the view of context chunk {index})")
                raise
        self._steps = steps
        # The new tokens run on the inner instance: its step has no context chunks of the
        # add-on's kind (vLLM's chunk objects are for the views).
        setattr(prefill_metadata, CHUNKS_ATTR, [])

    def run(self, chunk: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[Any, Any]:
        index = chunk.index
        if index >= len(self._steps):
            raise RuntimeError(
                f"context chunk {index} ran, but the step was prepared with {len(self._steps)} chunks"
            )
        view = self._views[index]
        try:
            return view.run_prefill_context_chunk(0, q, k, v)
        except Exception as e:
            note_backend_error(e, view, f"run_prefill_context_chunk, context chunk {index}", q=q, k=k, v=v)
            raise
