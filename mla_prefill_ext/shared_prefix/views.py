"""What a step's backends read from a context plan: the private chunks, and the segment step.

The private passes replace vLLM's own chunks on the step's prefill metadata (the add-on's
``context_chunks()`` reads ``mla_prefill_context_chunks`` first), so the step's backend
instance serves them with the step's query layout, as it serves vLLM's chunks today. The
shared segments are a step of their own for a second instance of the same backend (a clone,
kept across steps): its "requests" are the segments, each one query sequence made of all its
members' new tokens (``cu_seqlens_q`` over the member rows) against one key sequence (the
segment's tokens), attended non-causally; its context chunks are the segment passes. Both are
prepared once per step, before the layers run.
"""

from __future__ import annotations

from typing import Any

import torch

from mla_prefill_ext.backend_errors import note_backend_error
from mla_prefill_ext.backends.base import ContextChunk, MLAPrefillBackend
from mla_prefill_ext.shared_prefix.plan import ContextPass, ContextPlan

# The attribute the add-on's context_chunks() reads first (mla_prefill_ext.backends.base).
CHUNKS_ATTR = "mla_prefill_context_chunks"


def _chunks(
    passes: tuple[ContextPass, ...],
    on_device: tuple[ContextPass, ...],
    query_start_loc: torch.Tensor,
    max_query_len: int,
) -> list[ContextChunk]:
    return [
        ContextChunk(
            index=i,
            query_start_loc=query_start_loc,
            max_query_len=max_query_len,
            cu_seq_lens=d.cu_seq_lens,
            cu_seq_lens_cpu=p.cu_seq_lens,
            max_seq_len=p.max_seq_len,
            seq_lens=p.seq_lens,
        )
        for i, (p, d) in enumerate(zip(passes, on_device, strict=True))
    ]


def _on_device(plan: ContextPlan, on_device: ContextPlan | None, device: Any) -> ContextPlan:
    return on_device if on_device is not None else plan.to(device)


class SegmentStep:
    """The shared segments of a step, as a prefill step of their own (what the segment instance reads)."""

    chunked_context = None  # its chunks live in mla_prefill_context_chunks

    def __init__(
        self,
        plan: ContextPlan,
        q_data_type: Any,
        output_dtype: Any,
        device: Any,
        on_device: ContextPlan | None = None,
    ) -> None:
        on_device = _on_device(plan, on_device, device)
        loc = plan.segment_query_start_loc
        self.query_start_loc_cpu = loc
        self.query_start_loc = on_device.segment_query_start_loc
        self.max_query_len = int((loc[1:] - loc[:-1]).max()) if loc.numel() > 1 else 0
        self.q_data_type = q_data_type
        self.output_dtype = output_dtype
        self.mla_prefill_context_chunks = _chunks(
            plan.segment_passes, on_device.segment_passes, self.query_start_loc, self.max_query_len
        )


def attach_private_chunks(
    plan: ContextPlan, prefill_metadata: Any, on_device: ContextPlan | None = None
) -> None:
    """Replace the step's context chunks by the plan's private passes (before it is prepared).

    ``on_device``: ``plan.to(device)`` when the caller has it (its tensors are used, not copied again).
    """
    loc = prefill_metadata.query_start_loc
    on_device = _on_device(plan, on_device, loc.device)
    setattr(
        prefill_metadata,
        CHUNKS_ATTR,
        _chunks(plan.private_passes, on_device.private_passes, loc, int(prefill_metadata.max_query_len)),
    )


class SegmentInstance:
    """One builder's instance for shared segments: a clone of its step backend, made once.

    Made with the builder's ``device`` at the builder's first build (the host does so at engine
    start: CUDA graph capture or the first step), so that the clone's kernel workspace is reserved
    then, not on the first step with a shared prefix. It comes after vLLM sized the KV cache: it
    lives in the memory vLLM leaves outside its budget (FlashInfer's: 394 MiB per builder).
    """

    def __init__(self, step_backend: MLAPrefillBackend, device: torch.device | None = None) -> None:
        self._backend = step_backend.clone()
        if device is not None:
            self._backend.reserve_workspace(device)
        self.step: SegmentStep | None = None

    @property
    def backend(self) -> MLAPrefillBackend:
        return self._backend

    def prepare(
        self, plan: ContextPlan, prefill_metadata: Any, on_device: ContextPlan | None = None
    ) -> MLAPrefillBackend | None:
        """Prepare the clone for this step's segments; None when the step has none.

        ``on_device``: ``plan.to(device)`` when the caller has it (its tensors are used, not copied again).
        """
        if not plan.has_segments:
            self.step = None
            return None
        self.step = SegmentStep(
            plan,
            prefill_metadata.q_data_type,
            prefill_metadata.output_dtype,
            prefill_metadata.query_start_loc.device,
            on_device,
        )
        try:
            self._backend.prepare_metadata(self.step)
        except Exception as e:  # never caught: named, it stops the engine in vLLM's worker
            note_backend_error(e, self._backend, "prepare_metadata (the shared-prefix segments)")
            raise
        return self._backend
