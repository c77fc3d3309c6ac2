"""Finding a step's shared prefixes from host block-table rows (mla_prefill_ext.shared_prefix.groups)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_prefill_ext.shared_prefix.groups import find_shared_prefixes, tokens_saved

BS = 16


def table(*rows: list[int], width: int = 8) -> np.ndarray:
    out = np.full((len(rows), width), 9999, dtype=np.int32)  # stale entries past each row's blocks
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def as_sets(groups) -> list[tuple[tuple[int, ...], list[int]]]:
    return [(g.members, g.block_ids.tolist()) for g in groups]


def test_no_group_among_requests_that_share_nothing():
    t = table([1, 2, 3], [4, 5, 6], [7, 8, 9])
    assert find_shared_prefixes(t, [48, 48, 48], BS) == []


def test_a_single_request_or_none_with_full_blocks_forms_no_group():
    t = table([1, 2], [1, 2])
    assert find_shared_prefixes(t[:1], [32], BS) == []
    assert find_shared_prefixes(t, [15, 15], BS) == []  # both contexts inside their first block


def test_groups_among_unrelated_requests():
    # 0, 2, 4 share blocks 1, 2; 1, 5 share block 7; 3 shares nothing (its block 1 is not leading).
    t = table([1, 2, 3], [7, 8], [1, 2, 5], [9, 1, 2], [1, 2], [7, 6, 6])
    groups = find_shared_prefixes(t, [48, 32, 48, 48, 32, 48], BS)
    assert as_sets(groups) == [((0, 2, 4), [1, 2]), ((1, 5), [7])]


def test_partial_and_out_of_context_blocks_are_not_shared():
    # Same first three block ids, but the third block is partly filled in request 1 (40 tokens)
    # and past the context of request 0 (32 tokens): only two full in-context blocks are shared.
    t = table([1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4])
    assert as_sets(find_shared_prefixes(t, [32, 40, 64], BS)) == [((0, 1, 2), [1, 2])]
    # Entries past the context are never compared, whatever they hold.
    assert as_sets(find_shared_prefixes(t, [20, 31, 64], BS)) == [((0, 1, 2), [1])]


def test_nested_sharing_tie_forms_the_larger_group():
    # All four share 2 blocks; 0, 1 share a third, 2, 3 another third: 3 x 2 = 1 x 3 + 1 x 3 blocks.
    t = table([1, 2, 3], [1, 2, 3], [1, 2, 4], [1, 2, 4])
    assert as_sets(find_shared_prefixes(t, [48] * 4, BS)) == [((0, 1, 2, 3), [1, 2])]


def test_nested_sharing_picks_the_partition_that_saves_most():
    # 0, 1 share 6 blocks; 2 shares only the first with them: {0, 1} x 6 (saves 6) beats
    # {0, 1, 2} x 1 (saves 2); 3 joins no one.
    t = table([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], [1, 9], [8])
    assert as_sets(find_shared_prefixes(t, [96, 96, 32, 16], BS)) == [((0, 1), [1, 2, 3, 4, 5, 6])]
    # Nested three deep: {0, 1} x 6 + {2, 3} x 2 (saves 8) beats {0, 1, 2, 3} x 1 (saves 3).
    t = table([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], [1, 9, 9], [1, 9, 8])
    assert as_sets(find_shared_prefixes(t, [96, 96, 48, 48], BS)) == [
        ((0, 1), [1, 2, 3, 4, 5, 6]),
        ((2, 3), [1, 9]),
    ]


def test_the_value_hook_decides_which_groups_form():
    t = table([1, 2, 3], [1, 2, 3], [5, 6], [5, 6])
    # Only groups whose members bring more than 10 query tokens are worth it here.
    value = lambda members, tokens, queries: tokens_saved(members, tokens, queries) if queries > 10 else 0.0  # noqa: E731
    groups = find_shared_prefixes(t, [48, 48, 32, 32], BS, query_lens=[8, 8, 2, 2], value=value)
    assert as_sets(groups) == [((0, 1), [1, 2, 3])]


def test_groups_formed_below_leave_the_rest_to_a_group_above():
    # 0, 1 share 12 blocks, 2, 3 only the first 5 with them and each other: {0, 1} x 12 + {2, 3} x 5
    # (saves 17) beats {0, 1, 2, 3} x 5 (15) and {0, 1} x 12 alone (12).
    long = list(range(1, 13))
    t = table(long, long, [*long[:5], 50], [*long[:5], 60], width=12)
    assert as_sets(find_shared_prefixes(t, [192, 192, 96, 96], BS)) == [((0, 1), long), ((2, 3), long[:5])]


def _lcp(rows: list[list[int]]) -> int:
    n = 0
    while all(len(r) > n for r in rows) and len({r[n] for r in rows}) == 1:
        n += 1
    return n


def _rule_on_explicit_trie(rows: list[list[int]], qlens: list[int], value) -> float:
    """The module's rule again, recursively over an explicit trie: the total value it picks."""

    def solve(members: list[int]) -> tuple[float, list[list[int]]]:
        depth = _lcp([rows[i] for i in members])
        children: dict[int, list[int]] = {}
        for i in members:
            if len(rows[i]) > depth:
                children.setdefault(rows[i][depth], []).append(i)
        best, groups = 0.0, []
        for child in children.values():
            if len(child) >= 2:
                b, g = solve(child)
                best, groups = best + b, groups + g
        if depth == 0:
            return best, groups
        left = [i for i in members if not any(i in g for g in groups)]
        options = [(value(len(members), depth * BS, sum(qlens[i] for i in members)), [members])]
        if 2 <= len(left) < len(members):
            extra = value(len(left), depth * BS, sum(qlens[i] for i in left))
            if extra > 0:
                options.append((best + extra, [*groups, left]))
        top, top_groups = max(options, key=lambda o: o[0])
        return (top, top_groups) if top > 0 and top >= best else (best, groups)

    offered = [i for i, r in enumerate(rows) if r]
    return solve(offered)[0] if len(offered) >= 2 else 0.0


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 2), min_size=0, max_size=5), min_size=1, max_size=7),
    st.lists(st.integers(1, 9), min_size=7, max_size=7),
    st.sampled_from(["tokens", "overhead", "queries"]),
)
def test_the_groups_follow_the_rule(raw_rows, qlens, kind):
    """Valid, disjoint groups whose total value is what the rule gives on an explicit trie.

    Block ids drawn from a tiny alphabet so that rows share prefixes at many depths; ids are
    unique per depth, as block hashes chain.
    """
    value = {
        "tokens": tokens_saved,
        "overhead": lambda m, p, q: (m - 1) * p - 24 * m,
        "queries": lambda m, p, q: p * q - 40 * m,
    }[kind]
    rows = [[10 * d + b for d, b in enumerate(r)] for r in raw_rows]
    ctx = [len(r) * BS for r in rows]
    groups = find_shared_prefixes(table(*rows, width=6), ctx, BS, query_lens=qlens[: len(rows)], value=value)
    seen: set[int] = set()
    total = 0.0
    for g in groups:
        assert len(g.members) >= 2 and not seen & set(g.members)
        seen |= set(g.members)
        assert g.num_blocks == _lcp([rows[i] for i in g.members]) > 0
        assert g.block_ids.tolist() == rows[g.members[0]][: g.num_blocks]
        v = value(len(g.members), g.num_blocks * BS, sum(qlens[i] for i in g.members))
        assert v > 0
        total += v
    assert total == _rule_on_explicit_trie(rows, qlens, value)
