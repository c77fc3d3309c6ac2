"""FLASHINFER's planning, without a GPU: what it hands FlashInfer's ``plan()``, and from where.

FlashInfer's wrappers need CUDA, so the wrapper the backend builds is replaced by a recorder of
its ``plan`` calls (FlashInfer's own class, not vLLM's). The GPU suite runs the real kernels
(tests/gpu/test_kernels.py) and checks that the step path does not synchronise (test_no_sync.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mla_prefill_ext.backends import flashinfer
from mla_prefill_ext.backends.base import context_chunks, host_query_start_loc
from mla_prefill_ext.testing import vllm_host as host
from mla_prefill_ext.testing.problem import make_problem


class RecordingWrapper:
    def __init__(self) -> None:
        self.plans: list[dict[str, Any]] = []

    def plan(self, **kwargs: Any) -> None:
        self.plans.append(kwargs)


@pytest.fixture
def backend_factory(clean_selection: pytest.MonkeyPatch):
    monkeypatch = clean_selection
    monkeypatch.setenv("VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE", str(1 << 16))
    made: list[RecordingWrapper] = []

    def wrapper(self: Any) -> RecordingWrapper:
        made.append(RecordingWrapper())
        return made[-1]

    monkeypatch.setattr(flashinfer.FlashInferPrefillBackend, "_wrapper", wrapper)

    def make(batch_invariant: bool = False) -> tuple[Any, list[RecordingWrapper]]:
        monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1" if batch_invariant else "0")
        with host.gpu_view((9, 0)):
            b = flashinfer.FlashInferPrefillBackend(16, 0.1, 512, 128, 64, 128, None)
        return b, made

    return make


def test_plans_from_host_offsets(backend_factory):
    backend, wrappers = backend_factory()
    p = make_problem([5, 7], [9, 0], num_chunks=2, num_heads=16)
    # What the patched builder attaches: a host tensor of its own (on this CPU box the "device"
    # tensor is on the host too, so only identity tells which one was planned from).
    p.metadata.query_start_loc_cpu = p.metadata.query_start_loc.clone()
    host_loc = host_query_start_loc(p.metadata)
    assert host_loc is not p.metadata.query_start_loc
    backend.prepare_metadata(p.metadata)
    main, *chunks = wrappers
    (plan,) = main.plans
    assert plan["qo_indptr"] is host_loc and plan["kv_indptr"] is host_loc and plan["causal"] is True
    assert plan["sm_scale"] == 0.1 and plan["head_dim_qk"] == 192 and plan["head_dim_vo"] == 128
    assert len(chunks) == 2
    host_chunks = context_chunks(p.metadata)  # vLLM 0.29+ problems carry only this view
    cu = [c.cu_seq_lens for c in host_chunks]
    for i, c in enumerate(chunks):
        (cp,) = c.plans
        assert cp["kv_indptr"] is host_chunks[i].cu_seq_lens_cpu and cp["causal"] is False
        assert cp["kv_indptr"].tolist() == cu[i].tolist()
    assert "fixed_split_size" not in plan and "disable_split_kv" not in plan


def test_batch_invariant_plans_as_vllms_flashinfer_backend(backend_factory):
    backend, wrappers = backend_factory(batch_invariant=True)
    backend.reserve_workspace(torch.device("cpu"))
    assert backend._workspace.numel() == flashinfer.BATCH_INVARIANT_WORKSPACE_BYTES
    p = make_problem([5, 7], None, num_heads=16)
    backend.prepare_metadata(p.metadata)
    (plan,) = wrappers[0].plans
    assert plan["fixed_split_size"] == flashinfer.BATCH_INVARIANT_FIXED_SPLIT_SIZE == 4096
    assert plan["disable_split_kv"] is True


def test_workspace_reserved_once_sized_by_vllm_env(backend_factory):
    backend, _ = backend_factory()
    assert backend._workspace is None  # a layer's own instance never allocates one
    backend.reserve_workspace(torch.device("cpu"))
    ws = backend._workspace
    assert ws.numel() == 1 << 16 and ws.dtype == torch.uint8
    backend.prepare_metadata(make_problem([3], None, num_heads=16).metadata)
    assert backend._workspace is ws
