"""A step's context plan (mla_prefill_ext.shared_prefix.plan): shared segments, private passes, workspace."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from shared_prefix_cases import ALL_SHARE, BS, make_step

from mla_prefill_ext.shared_prefix.plan import ContextPass, FlopCostModel, plan_context


def covered(passes: tuple[ContextPass, ...], seq: int) -> Counter:
    """How often each context position of sequence ``seq`` is in a pass."""
    seen: Counter = Counter()
    for p in passes:
        start, n = int(p.starts[seq]), int(p.seq_lens[seq])
        seen.update(range(start, start + n))
        assert (p.token_to_seq[p.cu_seq_lens[seq] : p.cu_seq_lens[seq + 1]] == seq).all()
    return seen


@pytest.mark.parametrize("workspace", [7 * BS, 12 * BS, 1024])
def test_every_context_token_is_planned_once(workspace):
    step = make_step()
    plan = plan_context(step.table.numpy(), step.context_lens, step.query_start_loc, BS, workspace)
    # The groups of the case: A's three requests over A's first 2 blocks (the tie with A's first two
    # requests over 4 blocks goes to the larger group), B's three over 4 blocks.
    assert [s.members for s in plan.segments] == [(0, 1, 2), (3, 4, 6)]
    assert [s.num_tokens for s in plan.segments] == [2 * BS, 4 * BS]
    for j, seg in enumerate(plan.segments):
        assert covered(plan.segment_passes, j) == Counter(range(seg.num_tokens))  # each shared token once
        assert plan.segment_block_table[j, : len(seg.block_ids)].tolist() == seg.block_ids.tolist()
        for m in seg.members:  # the shared blocks are the member's own leading blocks
            assert step.table[m, : len(seg.block_ids)].tolist() == seg.block_ids.tolist()
    shared = {m: s.num_tokens for s in plan.segments for m in s.members}
    for r, c in enumerate(step.context_lens):
        start = shared.get(r, 0)
        assert int(plan.private_starts[r]) == start
        assert covered(plan.private_passes, r) == Counter(range(start, c))  # the rest, each once
    for p in (*plan.segment_passes, *plan.private_passes):
        assert p.total == int(p.cu_seq_lens[-1]) == p.token_to_seq.numel() <= workspace
        assert (p.starts % BS == 0).all()  # vLLM's gather kernel needs page-aligned starts


def test_member_rows_are_the_members_queries_segment_by_segment():
    step = make_step()
    plan = plan_context(step.table.numpy(), step.context_lens, step.query_start_loc, BS, 1024)
    loc = step.query_start_loc.tolist()
    expected = []
    for seg in plan.segments:
        assert seg.query_ranges == tuple((loc[m], loc[m + 1]) for m in seg.members)
        expected += [i for m in seg.members for i in range(loc[m], loc[m + 1])]
    assert plan.member_rows.tolist() == expected
    sizes = [sum(e - s for s, e in seg.query_ranges) for seg in plan.segments]
    assert plan.segment_query_start_loc.tolist() == [0, sizes[0], sizes[0] + sizes[1]]
    assert not plan.members_are_all_rows  # request 5 is in no group, and the groups interleave


def test_members_are_all_rows_when_every_request_is_in_one_group():
    """The layers' case without a gather of q or a scatter of the output: one group of all."""
    step = make_step(ALL_SHARE)
    plan = plan_context(step.table.numpy(), step.context_lens, step.query_start_loc, BS, 1024)
    assert [s.members for s in plan.segments] == [(0, 1, 2)]
    assert plan.members_are_all_rows
    assert plan.member_rows.tolist() == list(range(int(step.query_start_loc[-1])))


def test_the_plan_goes_to_the_device_as_one_buffer_of_the_same_values():
    step = make_step()
    plan = plan_context(step.table.numpy(), step.context_lens, step.query_start_loc, BS, 7 * BS)
    moved = plan.to("cpu")
    assert moved.member_rows.dtype == torch.int64 and moved.member_rows.tolist() == plan.member_rows.tolist()
    pairs = [
        (plan.segment_block_table, moved.segment_block_table),
        (plan.private_starts, moved.private_starts),
    ]
    pairs.append((plan.segment_query_start_loc, moved.segment_query_start_loc))
    for host, dev in zip(
        (*plan.segment_passes, *plan.private_passes),
        (*moved.segment_passes, *moved.private_passes),
        strict=True,
    ):
        assert dev.total == host.total
        pairs += list(zip(host[:4], dev[:4], strict=True))
    buffers = set()
    for host, dev in pairs:
        assert dev.dtype == torch.int32 and dev.shape == host.shape and torch.equal(dev, host.to(torch.int32))
        buffers.add(dev.untyped_storage().data_ptr())
    assert len(buffers) == 1  # views of one copy


def test_a_plan_on_the_device_already_is_not_copied_again():
    """A caller that kept only the moved plan hands it on; the copy reads host memory only."""
    step = make_step()
    plan = plan_context(step.table.numpy(), step.context_lens, step.query_start_loc, BS, 7 * BS)
    moved = plan.to("meta")  # a device whose tensors cannot be read back on the host
    assert moved.segment_block_table.device.type == "meta"
    assert moved.to("meta") is moved and moved.to(torch.device("meta")) is moved
    with pytest.raises(ValueError, match="from the host only"):
        moved.to("cpu")


def test_without_shared_segments_the_plan_is_vllms():
    """vLLM 0.20's builder: an equal share per request with context, rounded down to the page."""
    step = make_step()
    workspace = 7 * BS
    plan = plan_context(
        step.table.numpy(), step.context_lens, step.query_start_loc, BS, workspace, shared=False
    )
    assert not plan.has_segments and plan.member_rows.numel() == 0
    share = workspace // len(step.context_lens) // BS * BS
    assert len(plan.private_passes) == -(-max(step.context_lens) // share)
    for i, p in enumerate(plan.private_passes):
        assert p.starts.tolist() == [i * share] * len(step.context_lens)
        assert p.seq_lens.tolist() == [max(0, min(c, (i + 1) * share) - i * share) for c in step.context_lens]


def test_the_cost_model_decides_which_groups_form():
    step = make_step()
    table, ctx, loc = step.table.numpy(), step.context_lens, step.query_start_loc
    model = FlopCostModel()
    # shared-prefix.md's FLOP model: up-projecting 32k tokens at 16 heads is 0.14 TFLOP; 16 members
    # sharing them save 15 of those.
    assert model.saved_flops(16, 32768, 16 * 128) == pytest.approx(15 * 2 * 32768 * 512 * 16 * 256)
    # A segment must save more than A's 2 blocks shared by 3 (2 x 32 tokens) to form: only B's does.
    a_saved = model.saved_flops(3, 2 * BS, 12)
    picky = FlopCostModel(min_saved_flops=a_saved)
    plan = plan_context(table, ctx, loc, BS, 1024, value=picky)
    assert [s.members for s in plan.segments] == [(3, 4, 6)]
    assert (
        plan_context(table, ctx, loc, BS, 1024, value=FlopCostModel(group_overhead_flops=1e18)).segments == ()
    )


def test_a_workspace_too_small_for_a_page_per_sequence_is_refused():
    step = make_step()
    with pytest.raises(ValueError, match="do not fit"):
        plan_context(step.table.numpy(), step.context_lens, step.query_start_loc, BS, 5 * BS)


def test_the_plan_is_pinned_only_where_vllm_says_pinned_memory_is_available(monkeypatch):
    """Under WSL, for one, vLLM pins nothing: the plan's copy then comes from pageable memory."""
    from vllm.platforms import current_platform

    from mla_prefill_ext.shared_prefix import plan as plan_module

    for answer in (False, True):
        monkeypatch.setattr(
            type(current_platform), "is_pin_memory_available", classmethod(lambda cls, answer=answer: answer)
        )
        plan_module._can_pin.cache_clear()
        assert plan_module._can_pin() is answer
    plan_module._can_pin.cache_clear()
