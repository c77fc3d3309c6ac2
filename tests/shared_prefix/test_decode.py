"""Shared-prefix decode on the CPU: the step's groups, and one layer's decode attention split into one shared
call per group plus every row's own pages, merged by LSE, against vLLM's one paged call (both in the float64
reference kernel). Sharp latents and queries, so that a wrong key set, a dropped LSE or a scale 2% off shows.

The step: six decode rows (one new token each, the cache holding it); rows 0-3 share 3 full blocks, row 3
holds a 4th full block of its own and rows 0-2 a partly filled last block; rows 4 and 5 share nothing.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from shared_decode_step import BS, EVERY_GROUP, ROWS, SCALE, SEQ_LENS, step, vllm_decode

from mla_prefill_ext.shared_prefix.decode import DECODE_CROSSOVER, decode_attention, plan_decode
from mla_prefill_ext.testing.reference import merge_attn_states_torch, paged_latent_attention


def shared_decode(attend, q_pe, q_nope, value=EVERY_GROUP, merge=merge_attn_states_torch):
    plan = plan_decode(ROWS, SEQ_LENS, np.ones_like(SEQ_LENS), BS, value)
    assert plan is not None
    device_plan = plan.to(torch.from_numpy(ROWS), torch.from_numpy(SEQ_LENS).int())
    cu = torch.arange(len(SEQ_LENS) + 1, dtype=torch.int32)
    return plan, decode_attention(q_pe, q_nope, device_plan, cu, 1, attend, merge)


def test_the_plan_groups_the_rows_that_share_full_context_blocks():
    plan = plan_decode(ROWS, SEQ_LENS, np.ones_like(SEQ_LENS), BS, EVERY_GROUP)
    assert [g.members.tolist() for g in plan.groups] == [[0, 1, 2, 3]]
    assert plan.groups[0].block_ids.tolist() == [0, 1, 2]
    device = plan.to(torch.from_numpy(ROWS), torch.from_numpy(SEQ_LENS).int())
    assert device.own_seq_lens.tolist() == [2, 3, 1, 5, 6, 9]  # each keeps its new token
    assert device.own_block_table[3, :2].tolist() == [6, 7]
    assert device.own_block_table[4].tolist() == ROWS[4].tolist()  # not a member: vLLM's row
    # The own call's key bound is the longest own row (FA3 splits its keys by it), not vLLM's 9 + 3 blocks.
    assert device.max_own_len == max(device.own_seq_lens.tolist()) == 9
    # The groups' host arrays went over as one buffer (one copy a step).
    g = device.groups[0]
    assert len({t.untyped_storage().data_ptr() for t in (g.members, g.prefix_row, g.prefix_len)}) == 1
    assert not g.every_row  # rows 4 and 5 are not members: the group's queries are gathered
    four = plan_decode(ROWS[:4], SEQ_LENS[:4], np.ones(4, dtype=np.int64), BS, EVERY_GROUP)
    assert four.to(torch.from_numpy(ROWS[:4]), torch.from_numpy(SEQ_LENS[:4]).int()).groups[0].every_row


def test_the_crossover_serves_only_what_was_measured_faster():
    many = np.tile(np.arange(600, dtype=np.int32), (64, 1))
    lens = np.full(64, 512 * 64 + 7)
    assert plan_decode(many, lens, np.ones(64, dtype=np.int64), 64, DECODE_CROSSOVER) is not None
    assert plan_decode(many[:32], lens[:32], np.ones(32, dtype=np.int64), 64, DECODE_CROSSOVER) is None
    short = np.full(64, 128 * 64 + 7)  # an 8k prefix: slower than vLLM's decode
    assert plan_decode(many, short, np.ones(64, dtype=np.int64), 64, DECODE_CROSSOVER) is None
    spec = np.full(64, 4)  # four new tokens a row (speculative decoding): slower
    assert plan_decode(many, lens, spec, 64, DECODE_CROSSOVER) is None


def test_shared_decode_equals_vllms_call():
    cache, q_pe, q_nope = step()
    attend = paged_latent_attention(cache, SCALE)
    want, want_lse = vllm_decode(attend, q_pe, q_nope)
    _, (out, lse) = shared_decode(attend, q_pe.clone(), q_nope.clone())
    torch.testing.assert_close(out.double(), want.double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


def _scaled_shared_call(attend_at):
    """A kernel whose non-causal (shared) calls run at a scale 2% off."""
    right, wrong = attend_at(SCALE), attend_at(SCALE * 1.02)

    def attend(*args):
        return (right if args[-1] else wrong)(*args)

    return attend


@pytest.mark.parametrize("fault", ["other-prefix", "drop-segment-lse", "segment-scale"])
def test_a_wrong_shared_decode_fails_the_comparison(fault):
    """What the GPU parity scenarios' decode mutants do, shown failing the CPU check."""
    cache, q_pe, q_nope = step()
    attend = paged_latent_attention(cache, SCALE)
    want, _ = vllm_decode(attend, q_pe, q_nope)
    kwargs = {}
    if fault == "other-prefix":
        plan = plan_decode(ROWS, SEQ_LENS, np.ones_like(SEQ_LENS), BS, EVERY_GROUP)
        device_plan = plan.to(torch.from_numpy(ROWS), torch.from_numpy(SEQ_LENS).int())
        device_plan.groups[0].prefix_row[0, 2] = 12  # the third shared block read from another page
        cu = torch.arange(len(SEQ_LENS) + 1, dtype=torch.int32)
        out, _ = decode_attention(q_pe, q_nope, device_plan, cu, 1, attend, merge_attn_states_torch)
    else:
        if fault == "drop-segment-lse":
            kwargs["merge"] = lambda po, pl, so, sl: merge_attn_states_torch(po, torch.zeros_like(pl), so, sl)
        else:
            attend = _scaled_shared_call(functools.partial(paged_latent_attention, cache))
        _, (out, _) = shared_decode(attend, q_pe, q_nope, **kwargs)
    members = slice(0, 4)
    assert (out[members].double() - want[members].double()).abs().max() > 1e-2
    torch.testing.assert_close(out[4:].double(), want[4:].double(), rtol=1e-5, atol=1e-5)
