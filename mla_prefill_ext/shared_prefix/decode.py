"""Shared-prefix decode: decode requests that share a cached prefix read it once per layer, not once each.

vLLM's MLA decode (absorbed) runs one paged call with one block-table row per request, so B requests
over one P-token prefix read its latent pages B times a step. Here a step's decode rows that share
leading full blocks worth sharing (:data:`DECODE_CROSSOVER`) are attended in two parts and merged by
LSE, as TyphoonMLA splits them: one non-causal call of all the group's queries over the prefix's pages
(one block-table row), and the step's one paged call over every row's own pages (each member's row
starting after the prefix; rows outside any group as vLLM gives them). Same math as vLLM's call, up to
the order of the sums.

Host side (:func:`plan_decode`, once per step in the metadata builder): groups from host copies of the
decode rows' block rows and sequence lengths, found by :func:`.groups.find_shared_prefixes`. Device side
(:meth:`DecodePlan.to`): index work on the step's device block table, no copy back to the host. Per
layer (:func:`decode_attention`): the calls, through ``attend`` (the decode backend's kernel) and
``merge`` (vLLM's merge).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from mla_prefill_ext.shared_prefix.groups import find_shared_prefixes
from mla_prefill_ext.shared_prefix.plan import copy_as_one


@dataclass(frozen=True)
class DecodeCrossover:
    """Whether a group of decode rows is worth one shared call (the ``GroupValue`` hook).

    The region where the shared call was measured faster than vLLM's decode, one R1 layer at TP=8 on
    an H100 with vLLM 0.34.0's FA3 (docs/benchmarks.md, "Decode over a shared prefix"): a 32k prefix
    with 64 requests or more (2.1-2.7x; 1.5x with 256 private tokens each). Outside it the shared call
    lost or was not measured: 32 requests (0.95x), an 8k prefix (0.55x, 0.83x); those rows run vLLM's
    decode. (Rows with more than one new token, 0.93x at 4, are never grouped: :func:`plan_decode`.)
    """

    min_members: int = 64
    min_shared_tokens: int = 32768

    def __call__(self, members: int, shared_tokens: int, member_query_tokens: int) -> float:
        if members < self.min_members or shared_tokens < self.min_shared_tokens:
            return 0.0
        return float((members - 1) * shared_tokens)


DECODE_CROSSOVER = DecodeCrossover()
ANY_SHARED_BLOCK = DecodeCrossover(min_members=2, min_shared_tokens=1)
"""Every group of two or more rows sharing a whole block: what correctness checks and the layer benchmark
serve (the crossover is what they check or measure, not what they assume)."""


class HostDecodeGroup(NamedTuple):
    """Decode rows (ascending) sharing ``block_ids``, on the host."""

    members: np.ndarray  # int64
    block_ids: np.ndarray  # int32


class DeviceDecodeGroup(NamedTuple):
    members: torch.Tensor  # int32 [B]: the group's rows among the step's decode rows
    prefix_row: torch.Tensor  # int32 [1, blocks]: the prefix's pages, one block-table row
    prefix_len: torch.Tensor  # int32 [1]
    cu_queries: torch.Tensor  # int32 [0, B]: all members' queries as one sequence
    num_members: int
    num_tokens: int  # the prefix's tokens (whole blocks)
    every_row: bool  # the members are the step's decode rows, all of them in order (no gather)


@dataclass
class DecodePlan:
    """One step's shared decode: the groups and each row's own pages after its group's prefix."""

    groups: list[HostDecodeGroup]
    block_size: int
    max_own_len: int  # the most tokens a row keeps on its own pages (from the host's upper bounds)

    def to(self, block_table: torch.Tensor, seq_lens: torch.Tensor) -> DeviceDecodePlan:
        """On the device of vLLM's decode ``block_table`` [rows, max_blocks] and ``seq_lens`` [rows]:
        each member's row shifted past its prefix and its length less the prefix; vLLM's tensors
        untouched (the graphs vLLM captured read them). The groups' host arrays go over in one pinned
        copy that does not wait for the stream (a pageable one would stall the host every step)."""
        host: list[torch.Tensor] = []
        for g in self.groups:
            tokens = g.block_ids.shape[0] * self.block_size
            fixed = torch.tensor([tokens, 0, g.members.shape[0]], dtype=torch.int32)
            host += [torch.from_numpy(g.members), torch.from_numpy(g.block_ids).view(1, -1), fixed]
        moved = iter(copy_as_one(host, block_table.device))
        own_table, own_lens = block_table.clone(), seq_lens.clone()
        rows, width = block_table.shape
        groups = []
        for g in self.groups:
            members, prefix, fixed = next(moved), next(moved), next(moved)
            n, tokens = g.block_ids.shape[0], g.block_ids.shape[0] * self.block_size
            own_table[members, : width - n] = block_table[members, n:]
            own_lens[members] -= tokens
            b = int(g.members.shape[0])
            every = b == rows and bool((g.members == np.arange(rows)).all())
            groups.append(DeviceDecodeGroup(members, prefix, fixed[:1], fixed[1:], b, tokens, every))
        return DeviceDecodePlan(groups, own_table, own_lens, self.max_own_len)


class DeviceDecodePlan(NamedTuple):
    groups: list[DeviceDecodeGroup]
    own_block_table: torch.Tensor  # int32 [rows, max_blocks]
    own_seq_lens: torch.Tensor  # int32 [rows]
    max_own_len: int  # the own call's longest key sequence (FA3 sizes its split of the keys by it)


def plan_decode(
    block_rows: np.ndarray,
    seq_lens: np.ndarray,
    query_lens: np.ndarray,
    block_size: int,
    value: Callable[[int, int, int], float] = DECODE_CROSSOVER,
) -> DecodePlan | None:
    """The step's decode groups worth a shared call (None: none).

    ``block_rows`` [rows, max_blocks], ``seq_lens`` and ``query_lens`` [rows]: host copies for the
    step's decode rows. A row offers the full blocks of its context before its new tokens, so each
    member keeps at least its new token on its own pages. Only steps of one new token a row are
    planned: the shared call takes one query per member (more lost where measured: speculative decoding).
    """
    if np.any(np.asarray(query_lens) != 1):
        return None
    context = np.asarray(seq_lens, dtype=np.int64) - np.asarray(query_lens, dtype=np.int64)
    found = find_shared_prefixes(block_rows, context, block_size, query_lens, value)
    if not found:
        return None
    groups = [HostDecodeGroup(np.asarray(g.members, dtype=np.int64), g.block_ids) for g in found]
    own = np.asarray(seq_lens, dtype=np.int64).copy()
    for g in groups:
        own[g.members] -= g.block_ids.shape[0] * block_size
    return DecodePlan(groups, block_size, int(own.max()))


Attend = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""``attend(q_pe, q_nope, block_table, seq_lens, cu_queries, max_queries, max_keys, causal)`` -> output
``[tokens, heads, kv_lora_rank]``, LSE ``[heads, tokens]`` (natural log): the decode backend's paged
latent attention at the layer's scale."""

Merge = Callable[[Any, Any, Any, Any], tuple[torch.Tensor, torch.Tensor]]


def fa3_attend(
    kernel: Callable[..., Any],
    kv_cache: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
    shared_splits: int = 0,
) -> Attend:
    """An :data:`Attend` on FA3's paged varlen call with ``q_v`` (``kernel``: vLLM's
    ``flash_attn_varlen_func`` binding) over the latent cache ``[blocks, block_size, rank + rope]``;
    ``shared_splits``: FA3's split of the keys for the shared (non-causal) call, 0: its heuristic."""
    k_pe, kv_c = kv_cache[..., kv_lora_rank:].unsqueeze(-2), kv_cache[..., :kv_lora_rank].unsqueeze(-2)

    def attend(q_pe, q_nope, block_table, seq_lens, cu_queries, max_queries, max_keys, causal):
        return kernel(
            q=q_pe,
            k=k_pe,
            v=kv_c,
            q_v=q_nope,
            max_seqlen_q=max_queries,
            cu_seqlens_q=cu_queries,
            max_seqlen_k=max_keys,
            seqused_k=seq_lens,
            block_table=block_table,
            softmax_scale=scale,
            causal=causal,
            return_softmax_lse=True,
            fa_version=3,
            num_splits=0 if causal else shared_splits,
        )

    return attend


def decode_attention(
    q_pe: torch.Tensor,
    q_nope: torch.Tensor,
    plan: DeviceDecodePlan,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    attend: Attend,
    merge: Merge,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's decode attention over every row (output, LSE), the groups' prefixes read once."""
    own = (plan.own_block_table, plan.own_seq_lens, query_start_loc, max_query_len, plan.max_own_len)
    out, lse = attend(q_pe, q_nope, *own, True)
    for g in plan.groups:
        prefix = (g.prefix_row, g.prefix_len, g.cu_queries, g.num_members, g.num_tokens)
        if g.every_row:  # the only group: no gather, no scatter
            return merge(*attend(q_pe, q_nope, *prefix, False), out, lse)
        shared_out, shared_lse = attend(q_pe[g.members], q_nope[g.members], *prefix, False)
        merged, merged_lse = merge(shared_out, shared_lse, out[g.members], lse[:, g.members])
        out[g.members] = merged
        lse[:, g.members] = merged_lse
    return out, lse
