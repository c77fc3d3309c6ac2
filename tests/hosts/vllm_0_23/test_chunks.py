"""vLLM's context chunks as the add-on's backends read them (bridge/chunks.py), on vLLM 0.23+.

The prefill metadata is what vLLM's real metadata builder makes for a step (its CUDA-only
pieces done on the CPU: tests/helpers/mla_layer_on_cpu.py): requests A, B, C with 37, 20
and 0 cached tokens and 9, 5, 7 new ones, the context workspace lowered to 32 tokens.
"""

from __future__ import annotations

import copy
import importlib
from typing import Any

import pytest
import torch
from mla_layer_on_cpu import (
    BLOCK_SIZE,
    CHUNK_WORKSPACE,
    SeededRequests,
    build_layer,
    cpu_step_kernels,
    make_builder,
)

from mla_prefill_ext.hosts.vllm_0_23 import chunks
from mla_prefill_ext.testing import vllm_host as host

pytestmark = pytest.mark.vllm_bridge

NEW, CONTEXT = [9, 5, 7], [37, 20, 0]


def cumsum_from_zero(lens: list[int]) -> list[int]:
    return [0, *torch.tensor(lens).cumsum(0).tolist()]


@pytest.fixture
def step(bridged: Any, clean_selection: pytest.MonkeyPatch, model_dirs: Any) -> Any:
    """vLLM's prefill metadata of the step, and the layer's add-on backend (TORCH_SDPA)."""
    from vllm.config import set_current_vllm_config

    clean_selection.setenv("MLA_PREFILL_BACKEND", "TORCH_SDPA")
    cfg = host.make_vllm_config(model_dirs["plain"])
    layer = build_layer(cfg, None)
    builder = make_builder(cfg, [layer], None)
    builder.chunked_prefill_workspace_size = CHUNK_WORKSPACE
    requests = SeededRequests(layer, [c + n for c, n in zip(CONTEXT, NEW, strict=True)])
    mla_module = importlib.import_module("vllm.model_executor.layers.attention.mla_attention")
    with cpu_step_kernels(mla_module), host.gpu_view(None), set_current_vllm_config(cfg):
        metadata = builder.build(0, requests.batch(NEW, CONTEXT))
    assert requests.table.shape[0] == 3 and BLOCK_SIZE == 16
    return metadata.prefill, layer.prefill_backend.inner


def test_host_query_offsets_come_from_vllms_host_query_lengths(step):
    prefill, _ = step
    prefill.query_start_loc_cpu = None
    chunks.attach_host_offsets(prefill)
    lens = getattr(prefill, "query_lens_cpu", None)
    if lens is None:  # 0.25-0.27: no host copy to read; host_query_start_loc() copies once per step
        assert prefill.query_start_loc_cpu is None
    else:
        assert prefill.query_start_loc_cpu.device.type == "cpu"
        assert prefill.query_start_loc_cpu.tolist() == cumsum_from_zero(NEW)
    prefill.query_start_loc_cpu = torch.tensor([0, 1], dtype=torch.int32)  # present: left as it is
    chunks.attach_host_offsets(prefill)
    assert prefill.query_start_loc_cpu.tolist() == [0, 1]


def chunk_objects(prefill: Any) -> list[Any]:
    context = prefill.chunked_context
    if getattr(context, "chunks", None) is None:
        pytest.skip("this vLLM hands context chunks by index (0.23-0.27): no chunk objects to read")
    return list(context.chunks)


def test_each_chunk_is_a_step_of_its_own(step):
    """One chunk's requests, their query offsets from zero, and one context chunk (index 0)."""
    prefill, _ = step
    objects = chunk_objects(prefill)
    assert len(objects) >= 2  # 57 cached tokens through a 32-token workspace
    for chunk in objects:
        own = chunks.chunk_step(prefill, chunk)
        rows = NEW[chunk.request_slice]
        assert own.query_start_loc is chunk.query_start_loc
        assert own.query_start_loc_cpu.tolist() == cumsum_from_zero(rows)
        assert own.max_query_len == int(chunk.max_query_len) == max(rows)
        assert own.chunked_context is None
        assert (own.q_data_type, own.output_dtype) == (prefill.q_data_type, prefill.output_dtype)
        (context,) = own.mla_prefill_context_chunks
        seq_lens = torch.as_tensor(chunk.seq_lens).tolist()
        assert context.index == 0 and context.seq_lens.tolist() == seq_lens
        assert context.cu_seq_lens_cpu.tolist() == cumsum_from_zero(seq_lens)
        assert context.cu_seq_lens is chunk.cu_seq_lens and context.max_seq_len == max(seq_lens)
    # Every cached token is read once, across the chunks.
    assert sum(sum(torch.as_tensor(c.seq_lens).tolist()) for c in objects) == sum(CONTEXT)


def test_the_views_are_one_clone_per_chunk_and_the_step_keeps_none(step):
    prefill, inner = step
    objects = chunk_objects(prefill)
    views = chunks.ChunkViews(inner)
    views.prepare(prefill)
    assert getattr(prefill, chunks.CHUNKS_ATTR) == []  # the new tokens run on the inner instance
    assert len(views._views) == len(objects) and all(v is not inner for v in views._views)
    first = views._views[0]
    views.prepare(prefill)  # the next step reuses the views
    assert views._views[0] is first
    late = copy.copy(objects[0])  # a chunk index the step was not prepared with
    object.__setattr__(late, "index", len(objects))
    with pytest.raises(RuntimeError, match=f"context chunk {len(objects)} ran, but the step was prepared"):
        views.run(late, None, None, None)
