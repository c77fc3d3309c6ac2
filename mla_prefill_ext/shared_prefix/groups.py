"""The shared prefixes of one step: which prefill requests hold the same leading cached blocks.

Input is host data only (the block-table rows' CPU copy and the computed-token counts), so
finding them never waits for the GPU. A request offers the blocks that lie wholly inside its
context (``context_len // block_size`` of them); a partly filled last block is private.

Rule for nested sharing. Sorting the offered rows lexicographically turns their longest common
prefixes into a tree (the trie of rows, compressed): each node is a set of requests and the
number of leading blocks they all share. Each request joins at most one group, and a group's
shared segment is the common prefix of all its members, so a request attends one shared
segment and then its own remainder. The tree is visited bottom-up; each node keeps the best of
(a) one group of all its requests, (c) its sub-nodes' groups plus one group of the requests
they left out, (b) its sub-nodes' groups alone, by total ``value``; ties go to (a), then (c):
fewer segments, more queries per kernel call. Example: A, B, C, D share 10 blocks and A, B
share 10 more; with the default value (context tokens up-projected once instead of per
member) {A, B, C, D} x 10 and {A, B} x 20 + {C, D} x 10 both save 30 blocks, and the tie gives
one group of four; had A, B shared 30 more, (c) would win with 40. Not every partition is
tried: a group formed below never gives a member up to a group above it.
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
    groups = []
    for picked, depth in _pick_groups(lcp, [int(qlens[i]) for i in order], block_size, value):
        members = tuple(sorted(order[j] for j in picked))
        groups.append(SharedPrefixGroup(members, rows[members[0]][:depth].astype(np.int32)))
    return sorted(groups, key=lambda g: g.members[0])


class _Node:
    """Sorted requests from ``lo`` on sharing ``depth`` blocks; the groups picked below it, their value."""

    __slots__ = ("best", "depth", "groups", "lo")

    def __init__(self, depth: int, lo: int) -> None:
        self.depth, self.lo, self.best = depth, lo, 0.0
        self.groups: list[tuple[list[int], int]] = []


def _close(node: _Node, hi: int, qlens: list[int], block_size: int, value: GroupValue) -> None:
    """Pick (a), (c) or (b) of the module's rule for ``node`` = sorted requests ``node.lo..hi``."""
    tokens = node.depth * block_size
    everyone = list(range(node.lo, hi + 1))
    grouped = {j for members, _ in node.groups for j in members}
    left = [j for j in everyone if j not in grouped]
    options = [(value(len(everyone), tokens, sum(qlens[j] for j in everyone)), [(everyone, node.depth)])]
    if 2 <= len(left) < len(everyone):
        extra = value(len(left), tokens, sum(qlens[j] for j in left))
        if extra > 0:
            options.append((node.best + extra, [*node.groups, (left, node.depth)]))
    best, groups = max(options, key=lambda option: option[0])  # the first of equals: (a) before (c)
    if best > 0 and best >= node.best:  # else (b), what the node holds
        node.best, node.groups = best, groups


def _pick_groups(
    lcp: list[int], qlens: list[int], block_size: int, value: GroupValue
) -> list[tuple[list[int], int]]:
    """The groups (positions in the sorted order, shared blocks) that the module's rule picks.

    The tree of LCP intervals, visited bottom-up with a stack (as suffix-array LCP intervals
    are): a node closes when the common prefix drops below its depth.
    """
    stack = [_Node(0, 0)]
    n = len(lcp) + 1
    for i in range(1, n + 1):
        h = lcp[i - 1] if i < n else 0
        lo, last = i - 1, None
        while h < stack[-1].depth:
            node = stack.pop()
            _close(node, i - 1, qlens, block_size, value)
            lo, last = node.lo, node
            if h <= stack[-1].depth:
                stack[-1].best += node.best
                stack[-1].groups += node.groups
        if h > stack[-1].depth:
            fresh = _Node(h, lo)
            if last is not None:
                fresh.best, fresh.groups = last.best, list(last.groups)
            stack.append(fresh)
    return stack[0].groups
