"""One layer's context part with a shared-prefix plan, on the CPU with TORCH_SDPA, against float64.

The step: seven prefill requests, two groups sharing cached prefixes (one nested), private
remainders with partly filled last blocks, one request with no private context and one in no
group; latent rows and queries of large norm, so that attention is sharp (a wrong key set or a
wrong merge weight shows). The step's metadata is vLLM's own ``MLACommonPrefillMetadata``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from shared_prefix_cases import (
    ALL_SHARE,
    BS,
    DIMS,
    SCALE,
    NoSegmentSDPA,
    SegmentSDPA,
    make_backend,
    make_step,
)

from mla_prefill_ext.backends.torch_sdpa import TorchSDPAPrefillBackend
from mla_prefill_ext.shared_prefix.execute import LayerContext, compute_context
from mla_prefill_ext.shared_prefix.plan import accepts_shared_segments, plan_context
from mla_prefill_ext.shared_prefix.views import SegmentInstance, attach_private_chunks
from mla_prefill_ext.testing.reference import merge_attn_states_torch
from mla_prefill_ext.testing.tolerances import TOLERANCES

FP32 = TOLERANCES[torch.float32]


def run_layer(step, plan, backend_cls=SegmentSDPA, workspace_rows=None, merge=merge_attn_states_torch):
    """What a host does: prepare the step once (builder), then one layer's context part."""
    from vllm.model_executor.layers.attention.mla_attention import MLACommonPrefillMetadata

    metadata = MLACommonPrefillMetadata(
        block_table=step.table,
        query_start_loc=step.query_start_loc,
        max_query_len=int((step.query_start_loc[1:] - step.query_start_loc[:-1]).max()),
        q_data_type=step.q.dtype,
        output_dtype=step.q.dtype,
    )
    backend = make_backend(backend_cls)
    segments = SegmentInstance(backend, torch.device("cpu"))
    attach_private_chunks(plan, metadata)
    backend.prepare_metadata(metadata)
    segment_backend = segments.prepare(plan, metadata)
    rows = workspace_rows or max(p.total for p in (*plan.segment_passes, *plan.private_passes))
    projected: list[int] = []

    def kv_b_proj(x):
        projected.append(x.shape[0])
        return step.kv_b_proj(x)

    workspace = torch.full((rows, step.cache.shape[-1]), float("nan"), dtype=step.cache.dtype)
    layer = LayerContext(step.cache, kv_b_proj, DIMS, workspace, merge)
    out, lse = compute_context(step.q, plan, step.table, backend, segment_backend, layer)
    return out, lse, sum(projected)


def errors(step, out, lse) -> tuple[float, float]:
    ref_out, ref_lse = step.reference()
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape and lse.dtype == torch.float32
    return (
        ((out.double() - ref_out).abs().max() / ref_out.abs().max()).item(),
        (lse.double() - ref_lse).abs().max().item(),
    )


def test_the_case_is_sharp():
    """Most queries put most of their weight on one key (else a wrong key set could pass)."""
    step = make_step()
    top = []
    for r in range(len(step.context_lens)):
        k, _ = step.keys_values(r)
        probs = torch.softmax(torch.einsum("qhd,khd->hqk", step.queries(r).double(), k) * SCALE, dim=-1)
        top.append(probs.max(dim=-1).values.flatten())
    assert torch.cat(top).median() > 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("workspace", [7 * BS, 1024])
def test_shared_segments_match_attention_over_each_whole_context(workspace, dtype):
    step = make_step(dtype=dtype)
    plan = plan_context(step.table.numpy(), step.context_lens, step.query_start_loc, BS, workspace)
    assert len(plan.segments) == 2 and (workspace > 200 or len(plan.private_passes) > 1)
    out, lse, projected = run_layer(step, plan)
    out_err, lse_err = errors(step, out, lse)
    print(
        f"{dtype}, workspace {workspace}: output {out_err:.2e}, LSE {lse_err:.2e}, {projected} rows projected"
    )
    assert out_err <= TOLERANCES[dtype].output_rel and lse_err <= TOLERANCES[dtype].lse_abs
    # Each shared token up-projected once: the context minus what the members share beyond one copy.
    saved = sum((len(s.members) - 1) * s.num_tokens for s in plan.segments)
    assert projected == sum(step.context_lens) - saved


@pytest.mark.parametrize("workspace", [3 * BS, 1024])
def test_a_step_whose_requests_all_share_one_prefix_matches_too(workspace):
    """q and the segment's output taken as they are (members_are_all_rows), no gather or scatter."""
    step = make_step(ALL_SHARE)
    plan = plan_context(step.table.numpy(), step.context_lens, step.query_start_loc, BS, workspace)
    assert plan.members_are_all_rows
    out, lse, _ = run_layer(step, plan)
    out_err, lse_err = errors(step, out, lse)
    assert out_err <= FP32.output_rel and lse_err <= FP32.lse_abs


def test_a_backend_that_does_not_declare_segments_gets_vllms_plan():
    step = make_step()
    assert not accepts_shared_segments(NoSegmentSDPA) and accepts_shared_segments(TorchSDPAPrefillBackend)
    shared = accepts_shared_segments(NoSegmentSDPA)
    plan = plan_context(
        step.table.numpy(), step.context_lens, step.query_start_loc, BS, 7 * BS, shared=shared
    )
    assert not plan.has_segments
    out, lse, projected = run_layer(step, plan, backend_cls=NoSegmentSDPA)
    out_err, lse_err = errors(step, out, lse)
    assert out_err <= FP32.output_rel and lse_err <= FP32.lse_abs
    assert projected == sum(step.context_lens)


def test_check_fails_when_a_request_attends_another_groups_prefix():
    """Mutant: group A's segment gathers group B's first blocks (as a wrong segment row would)."""
    step = make_step()
    plan = plan_context(step.table.numpy(), step.context_lens, step.query_start_loc, BS, 1024)
    table = plan.segment_block_table.clone()
    a_blocks = len(plan.segments[0].block_ids)
    table[0, :a_blocks] = plan.segment_block_table[1, :a_blocks]
    out, lse, _ = run_layer(step, dataclasses.replace(plan, segment_block_table=table))
    out_err, lse_err = errors(step, out, lse)
    print(f"another group's prefix: output {out_err:.2e}, LSE {lse_err:.2e}")
    assert out_err > FP32.output_rel and lse_err > FP32.lse_abs


def test_check_fails_when_the_segment_lse_is_left_out_of_the_merge():
    """Mutant: the segments' part merged with the private part as if it had no keys (-inf LSE).

    With the workspace large enough for one pass each, the only merge is that one.
    """
    step = make_step()
    plan = plan_context(step.table.numpy(), step.context_lens, step.query_start_loc, BS, 1024)
    assert len(plan.segment_passes) == len(plan.private_passes) == 1
    merges = []

    def counted(*args):
        merges.append(args)
        return merge_attn_states_torch(*args)

    run_layer(step, plan, merge=counted)
    assert len(merges) == 1

    def segment_lse_left_out(prefix_out, prefix_lse, suffix_out, suffix_lse):
        return merge_attn_states_torch(
            prefix_out, torch.full_like(prefix_lse, float("-inf")), suffix_out, suffix_lse
        )

    out, lse, _ = run_layer(step, plan, merge=segment_lse_left_out)
    out_err, lse_err = errors(step, out, lse)
    print(f"segment LSE left out: output {out_err:.2e}, LSE {lse_err:.2e}")
    assert out_err > FP32.output_rel and lse_err > FP32.lse_abs


def test_the_segment_step_is_one_query_sequence_per_segment():
    """What the segment instance is prepared with: per segment, all its members' new tokens as one
    query sequence (cu_seqlens_q) against the segment's tokens as one key sequence (cu_seqlens_k)."""
    from vllm.model_executor.layers.attention.mla_attention import MLACommonPrefillMetadata

    from mla_prefill_ext.backends.base import context_chunks, host_query_start_loc

    step = make_step()
    plan = plan_context(step.table.numpy(), step.context_lens, step.query_start_loc, BS, 1024)
    metadata = MLACommonPrefillMetadata(
        block_table=step.table,
        query_start_loc=step.query_start_loc,
        max_query_len=6,
        q_data_type=torch.float32,
    )
    segments = SegmentInstance(make_backend())
    assert segments.prepare(plan, metadata) is segments.backend
    view = segments.backend.prefill_metadata
    members = [
        sum(int(step.query_start_loc[m + 1] - step.query_start_loc[m]) for m in s.members)
        for s in plan.segments
    ]
    assert host_query_start_loc(view).tolist() == [0, members[0], members[0] + members[1]]
    assert view.max_query_len == max(members)
    (chunk,) = context_chunks(view)
    tokens = [s.num_tokens for s in plan.segments]
    assert chunk.cu_seq_lens_cpu.tolist() == [0, tokens[0], tokens[0] + tokens[1]]
    # The step's own chunks are the private passes, in the step's query layout.
    attach_private_chunks(plan, metadata)
    assert [c.cu_seq_lens_cpu.tolist() for c in context_chunks(metadata)] == [
        p.cu_seq_lens.tolist() for p in plan.private_passes
    ]
    # A step without shared segments prepares nothing.
    plain = plan_context(step.table.numpy(), step.context_lens, step.query_start_loc, BS, 1024, shared=False)
    assert segments.prepare(plain, metadata) is None
