"""The shared prefixes of one step: which prefill requests hold the same leading cached blocks.

Input is host data only (the block-table rows' CPU copy and the computed-token counts), so
finding them never waits for the GPU. A request offers the blocks that lie wholly inside its
context (``context_len // block_size`` of them); a partly filled last block is private.

Rule for nested sharing. Sorting the offered rows lexicographically turns their longest common
prefixes into a tree (the trie of rows, compressed): each node is a run of sorted requests and
the number of leading blocks they all share. Each request joins at most one group, and a
group's shared segment is the common prefix of all its members, so a request attends one
shared segment and then its own remainder. Among those partitions the one with the largest
total ``value`` wins, found by one pass over the tree: a node either forms one group of all
its requests or leaves them to its sub-nodes' best choice; on a tie the larger group wins
(fewer segments, more queries per kernel call). Example: A, B, C, D share 10 blocks and A, B
share 10 more; with the default value (context tokens up-projected once instead of per member)
both {A, B, C, D} x 10 and {A, B} x 20 + {C, D} x 10 save 30 blocks, and the tie gives one group
of four. A request sharing no leading full block with another joins no group.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

GroupValue = Callable[[int, int, int], float]
"""``value(members, shared_tokens, member_query_tokens)``: what forming the group saves (> 0 to form)."""


def tokens_saved(members: int, shared_tokens: int, member_query_tokens: int) -> float:
    """Default value: the context tokens a group gathers and up-projects once instead of per member."""
    return float((members - 1) * shared_tokens)


class SharedPrefixGroup(NamedTuple):
    """Requests (indices among the step's prefill requests, ascending) sharing ``block_ids``."""

    members: tuple[int, ...]
    block_ids: np.ndarray  # int32, the shared leading blocks (the same in every member's row)

    @property
    def num_blocks(self) -> int:
        return int(self.block_ids.shape[0])


def _offered_keys(rows: Sequence[np.ndarray]) -> list[bytes]:
    # Big-endian unsigned bytes sort as the rows do lexicographically (block ids are >= 0),
    # and a row that is a prefix of another sorts first: one memcmp-based sort does it all.
    return [row.astype(">u4", copy=False).tobytes() for row in rows]


def _common_blocks(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.shape[0], b.shape[0])
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def find_shared_prefixes(
    block_table: np.ndarray,
    context_lens: Sequence[int] | np.ndarray,
    block_size: int,
    query_lens: Sequence[int] | np.ndarray | None = None,
    value: GroupValue = tokens_saved,
) -> list[SharedPrefixGroup]:
    """Groups of >= 2 prefill requests sharing leading full context blocks, by the rule above.

    ``block_table``: host copy, one row per prefill request (``[requests, max_blocks]``, any int
    dtype; entries past a request's blocks are ignored). ``context_lens``: computed tokens per
    request. ``query_lens``: new tokens per request (passed to ``value``; default 1 each). Groups
    come ordered by their first member; ``value`` decides which are worth forming.
    """
    table = np.asarray(block_table)
    ctx = np.asarray(context_lens, dtype=np.int64)
    qlens = np.ones_like(ctx) if query_lens is None else np.asarray(query_lens, dtype=np.int64)
    offered = [int(i) for i in np.flatnonzero(ctx >= block_size)]
    if len(offered) < 2:
        return []
    rows = {i: table[i, : int(ctx[i]) // block_size] for i in offered}
    keys = _offered_keys([rows[i] for i in offered])
    order = [offered[j] for j in sorted(range(len(offered)), key=keys.__getitem__)]
    lcp = [_common_blocks(rows[a], rows[b]) for a, b in itertools.pairwise(order)]
    spans = _best_spans(lcp, [int(qlens[i]) for i in order], block_size, value)
    groups = []
    for lo, hi, depth in spans:
        members = tuple(sorted(order[lo : hi + 1]))
        groups.append(SharedPrefixGroup(members, rows[members[0]][:depth].astype(np.int32)))
    return sorted(groups, key=lambda g: g.members[0])


class _Node:
    """An interval of sorted requests sharing ``depth`` blocks; ``best`` and its spans, so far from below."""

    __slots__ = ("best", "depth", "lo", "spans")

    def __init__(self, depth: int, lo: int) -> None:
        self.depth, self.lo, self.best, self.spans = depth, lo, 0.0, []


def _best_spans(
    lcp: list[int], qlens: list[int], block_size: int, value: GroupValue
) -> list[tuple[int, int, int]]:
    """The best partition's groups as (first, last, depth) over the sorted order.

    The tree of LCP intervals, visited bottom-up with a stack (as suffix-array LCP intervals
    are): a node closes when the common prefix drops below its depth.
    """
    qsum = np.concatenate([[0], np.cumsum(qlens)])
    stack = [_Node(0, 0)]
    n = len(lcp) + 1
    for i in range(1, n + 1):
        h = lcp[i - 1] if i < n else 0
        lo, last = i - 1, None
        while h < stack[-1].depth:
            node = stack.pop()
            hi = i - 1
            members = hi - node.lo + 1
            own = value(members, node.depth * block_size, int(qsum[hi + 1] - qsum[node.lo]))
            if own > 0 and own >= node.best:
                node.best, node.spans = own, [(node.lo, hi, node.depth)]
            lo, last = node.lo, node
            if h <= stack[-1].depth:
                stack[-1].best += node.best
                stack[-1].spans += node.spans
        if h > stack[-1].depth:
            fresh = _Node(h, lo)
            if last is not None:
                fresh.best, fresh.spans = last.best, list(last.spans)
            stack.append(fresh)
    return stack[0].spans
