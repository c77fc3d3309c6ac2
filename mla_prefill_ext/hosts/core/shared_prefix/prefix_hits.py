"""A shared prefix's prefix-cache lookup, done once per engine core instead of once per request.

With prefix caching on, vLLM's scheduler looks every new request's block hashes up in the block
pool, one dictionary lookup per block (``FullAttentionManager.find_longest_cache_hit`` through
``BlockPool.get_cached_block``): sixteen requests over one cached 32k prefix look the same 2,048
blocks up 16 times. With the block hashes reused (:mod:`.prefix_hashes`) that lookup is the largest
part left of such a call's fixed host cost (docs/results/cpu-2026-12-02-prefix-hashes).

:class:`PrefixHits` remembers the hits of the last few lookups of one KV-cache coordinator. A new
lookup whose leading block hashes equal one of them takes those blocks, as long as none of them
was evicted since, and lets vLLM's lookup find the rest, starting after them. Exact: for a single
full-attention group without EAGLE's dropped block or context parallelism (:func:`lookup_problem`)
vLLM's lookup walks the hashes from the first and takes, for each, the first block the pool maps
it to, stopping at the first miss; so the lookup of ``hashes`` is the lookup of ``hashes[:k]``
followed by that of ``hashes[k:]``. A block the pool returned for a hash stays the first block for
it until the pool removes it, and every removal (eviction, ``evict_blocks``, ``reset_prefix_cache``)
resets the block's hash; caching a block packs its hash with the group id into a new object
(``make_block_hash_with_group_id``). So a remembered block is still what vLLM would return while its
``block_hash`` is the very object it held when it was found (an identity test; ``block_hash`` is a
property over the field ``_block_hash`` up to vLLM 0.33, the field itself from 0.34: the same object
either way). (``BlockPool.move_block_hashes``, 0.33+, moves a block's hashes to a copy for Mamba groups
only, which :func:`lookup_problem` excludes; it resets the source block's hash too.) A lookup that finds
a remembered block no longer cached replaces that memo with its own.

That reasoning is about vLLM's code, which a new vLLM may change; it is checked on the engine's own
vLLM: the first time a coordinator's hits lend blocks, vLLM's lookup of the whole request runs as well,
and where its blocks (by identity) or hit length differ the coordinator stops reusing hits for good,
returns vLLM's result, and one INFO line names the difference; after that a flag keeps the check free.
"""

from __future__ import annotations

import logging
import operator
import threading
import weakref
from typing import Any, NamedTuple

from mla_prefill_ext._logging import log_once
from mla_prefill_ext.hosts.core.shared_prefix import needs
from mla_prefill_ext.hosts.core.shared_prefix.prefix_hashes import common_blocks, keep_latest_of_each_kind

MEMOS = 8
"""Lookups remembered per coordinator, of each kind: those that took hits from a remembered lookup
(a prefix more than one request has) and those that did not, so that lookups sharing nothing never
push a shared prefix's hits out (a request the scheduler looks up again while it waits takes its own
hits: it counts as shared, as in one pool it pushed others out too). A new lookup extending one takes
its place."""

_HASH = "block_hash"  # KVCacheBlock's hash object while cached (None once evicted)
_hash_of = operator.attrgetter(_HASH)


class _Memo(NamedTuple):
    hashes: list[Any]  # the leading block hashes that hit
    blocks: list[Any]  # the block vLLM returned for each
    keys: list[Any]  # each block's hash object when it was found
    shared: bool  # it took hits from a remembered lookup (one of the kinds MEMOS counts apart)


def lookup_differs(reused: Any, own: Any) -> str | None:
    """Where ``reused`` (a lookup's result, some blocks lent) is not ``own`` (vLLM's lookup of the same
    request), in words; None: the same blocks (the very objects), hit length and anything after."""
    mine, theirs = reused[0], own[0]
    if len(mine) != len(theirs):
        return f"{len(mine)} groups of blocks where vLLM's lookup gives {len(theirs)}"
    for group, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            if x is not y:
                return (
                    f"hit {i} of group {group} is block {getattr(x, 'block_id', x)} where vLLM's lookup "
                    f"gives block {getattr(y, 'block_id', y)}"
                )
        if len(a) != len(b):
            return f"{len(a)} blocks hit in group {group} where vLLM's lookup hits {len(b)}"
    if tuple(reused[1:]) != tuple(own[1:]):
        return (
            f"the lookup returns {tuple(reused[1:])} after its blocks where vLLM's returns {tuple(own[1:])}"
        )
    return None


def lookup_problem(coordinator: Any) -> str | None:
    """Why ``coordinator``'s lookups cannot be taken apart as :class:`PrefixHits` does (None: they can).

    Written for vLLM's ``UnitaryKVCacheCoordinator`` over one ``FullAttentionManager`` (MLA's spec
    is a full-attention spec), hashed at the cache's block size, without EAGLE's dropped last block
    (0.20-0.25 ``eagle_group_ids``, 0.33+ ``drop_eagle_group_ids``), context parallelism or 0.33+
    lookahead hashes.
    """
    from vllm.v1.core.kv_cache_coordinator import UnitaryKVCacheCoordinator
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    if type(coordinator) is not UnitaryKVCacheCoordinator:
        return f"the KV cache coordinator is a {type(coordinator).__name__}"
    managers = getattr(coordinator, "single_type_managers", ())
    if len(managers) != 1 or type(managers[0]) is not FullAttentionManager:
        return "the KV cache is not one full-attention group"
    pool = getattr(coordinator, "block_pool", None)
    # The pool's flag: 0.33's coordinator no longer keeps its own copy.
    if not getattr(pool, "enable_caching", False):
        return "prefix caching is off"
    drop = getattr(coordinator, "drop_eagle_group_ids", getattr(coordinator, "eagle_group_ids", None))
    if drop is None or drop:
        return "EAGLE's last block is dropped from every hit (not served yet)"
    if getattr(coordinator, "dcp_world_size", 1) != 1 or getattr(coordinator, "pcp_world_size", 1) != 1:
        return "context parallelism is on (not served yet)"
    if getattr(pool, "num_hash_lookahead_tokens", 0):  # 0.33's pool holds it; no coordinator does
        return "the hashes look ahead for speculative decoding (not served yet)"
    block_size = getattr(coordinator, "block_size", None)
    spec_size = getattr(getattr(coordinator, "kv_cache_spec", None), "block_size", None)
    hash_size = getattr(pool, "hash_block_size", block_size)
    if block_size is None or not block_size == spec_size == hash_size:
        return f"blocks of {spec_size} tokens are hashed by {hash_size} (not served yet)"
    return None


class PrefixHits:
    """One coordinator's recent cache hits, lent to lookups that start with the same hashes."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._memos: list[_Memo] = []  # most recent first
        self._lock = threading.Lock()
        self.reused_hits = 0  # blocks taken from a remembered hit
        self.looked_up = 0  # blocks vLLM's lookup returned
        # Whether the first lend was compared with vLLM's own lookup (once per coordinator).
        self.checked = False
        # Why this coordinator reuses no hits (None: it does).
        self.off: str | None = None

    def turn_off(self, reason: str) -> None:
        """Reuse no more hits on this coordinator (its engine's hashes are not reused, or a lend differed)."""
        with self._lock:
            self.off = reason
            self._memos.clear()

    def find(self, lookup: Any, block_hashes: Any, max_cache_hit_length: int) -> Any:
        """vLLM's ``find_longest_cache_hit(block_hashes, max_cache_hit_length)`` (``lookup``), reusing hits.

        Returns what ``lookup`` returns: ``(hit_blocks, hit_tokens, ...)``, ``hit_blocks`` a tuple
        holding one list of blocks.
        """
        if self.off is not None or not isinstance(block_hashes, list) or not block_hashes:
            return lookup(block_hashes, max_cache_hit_length)
        bs = self.block_size
        limit = min(len(block_hashes), max_cache_hit_length // bs)
        with self._lock:
            at, k = self._longest(block_hashes, limit)
            memo = self._memos[at] if k else None
            if memo is not None:
                valid = self._still_cached(memo, k)
                if valid < k:  # evicted or re-cached since: the memo gives way to this lookup's
                    del self._memos[at]
                    at, k = -1, valid
            if not k:
                result = lookup(block_hashes, max_cache_hit_length)
            else:
                result = lookup(block_hashes[k:], max_cache_hit_length - k * bs)
                result[0][0][0:0] = memo.blocks[:k]
                result = (result[0], result[1] + k * bs, *result[2:])
                if not self.checked:
                    self.checked = True
                    own = lookup(block_hashes, max_cache_hit_length)
                    difference = lookup_differs(result, own)
                    if difference is not None:
                        self._turn_off_differing(difference)
                        self.looked_up += len(own[0][0])
                        return own
            hit = result[0][0]
            self.reused_hits += k
            self.looked_up += len(hit) - k
            if hit:
                keys = memo.keys[:k] if k else []
                keys.extend(map(_hash_of, hit[k:]))
                self._remember(_Memo(block_hashes[: len(hit)], list(hit), keys, k > 0), at)
        return result

    def held(self) -> dict[str, int]:
        """What this coordinator's hits keep between lookups (read-only, for soaks and reports): memos and
        the blocks they name (the pool's own blocks: references, not copies)."""
        with self._lock:
            memos = list(self._memos)
        return {"memos": len(memos), "memo_blocks": sum(len(m.blocks) for m in memos)}

    def _longest(self, block_hashes: list[Any], limit: int) -> tuple[int, int]:
        best, best_at = 0, -1
        for at, memo in enumerate(self._memos):
            n = min(limit, len(memo.hashes))
            if n <= best or block_hashes[best] != memo.hashes[best]:
                continue  # can only do better if it agrees on the hash after the best so far
            k = common_blocks(block_hashes, memo.hashes, 1, n)
            if k > best:
                best, best_at = k, at
        return best_at, best

    def _turn_off_differing(self, difference: str) -> None:
        # Called under the lock: the memos go, the lookup that found the difference returns vLLM's.
        self.off = f"a lent hit differs from vLLM's own lookup: {difference}"
        self._memos.clear()
        log_once(
            logging.INFO,
            ("shared-prefix-hits-differ", difference),
            "MLA shared-prefix prefill (mla-prefill-ext): prefix-cache hits of shared prefixes no longer "
            "reused in this engine core (%s); vLLM looks up every request.",
            self.off,
        )

    @staticmethod
    def _still_cached(memo: _Memo, k: int) -> int:
        """How many of the first ``k`` remembered blocks still hold the hash object they were found with."""
        blocks, keys = memo.blocks, memo.keys
        if all(map(operator.is_, map(_hash_of, blocks[:k]), keys[:k])):
            return k
        for i in range(k):
            if getattr(blocks[i], _HASH) is not keys[i]:
                return i
        return k

    def _remember(self, memo: _Memo, at: int) -> None:
        if at >= 0:
            old = self._memos[at]
            shared = common_blocks(memo.hashes, old.hashes, 1, min(len(memo.hashes), len(old.hashes)))
            if shared in (len(old.hashes), len(memo.hashes)):  # one holds the other: keep the longer
                del self._memos[at]
                if len(old.hashes) > len(memo.hashes):
                    memo = old._replace(shared=True)  # it lent
        self._memos.insert(0, memo)
        keep_latest_of_each_kind(self._memos, operator.attrgetter("shared"), MEMOS)


COORDINATOR_MODULE = "vllm.v1.core.kv_cache_coordinator"
COORDINATOR = "UnitaryKVCacheCoordinator"
HITS_ATTR = "_mla_prefill_ext_hits"  # on a coordinator whose engine reuses hits: its PrefixHits


def coordinator_problem() -> str | None:
    """Why vLLM's lookup path does not have the shape :class:`PrefixHits` was written for (None: it does):
    the ``hits`` rows of :data:`.needs.NEEDS` that do not hold here. What the reuse relies on beyond
    those (the same blocks as vLLM's lookup) is compared at its first lend (:meth:`PrefixHits.find`)."""
    return "; ".join(needs.problems("hits", needs.ANY)) or None


_LOCAL = threading.local()  # coordinators made while an engine core is being built on this thread


def collect(on: bool) -> None:
    """Start (``on``) or stop noting the coordinators made on this thread (an engine core's build)."""
    _LOCAL.pending = [] if on else None


def note_coordinator(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    """``UnitaryKVCacheCoordinator.__init__``: the coordinator noted for its engine core's decision."""
    result = wrapped(*args, **kwargs)
    pending = getattr(_LOCAL, "pending", None)
    if pending is not None:  # weakly: an engine core that never makes its hasher does not pin it
        pending.append(weakref.ref(instance))
    return result


class Attached(NamedTuple):
    hits: list[PrefixHits]  # those attached (each on one noted coordinator)
    problems: list[str]  # why the other noted coordinators got none


def attach(on: bool) -> Attached:
    """The noted coordinators get a :class:`PrefixHits` when ``on`` and they can serve it; returns them
    and why those that cannot do not. Stops noting."""
    pending, _LOCAL.pending = getattr(_LOCAL, "pending", None) or [], None
    attached = Attached([], [])
    for ref in pending:
        coordinator = ref()
        if coordinator is None:
            continue
        problem = lookup_problem(coordinator) if on else None
        if problem is not None:
            attached.problems.append(problem)
        elif on:
            hits = PrefixHits(int(coordinator.block_size))
            setattr(coordinator, HITS_ATTR, hits)
            attached.hits.append(hits)
            LATEST.append(weakref.ref(hits))
            del LATEST[:-4]
    return attached


LATEST: list[weakref.ref[PrefixHits]] = []  # the latest engines' hits (weakly: their blocks are the
# pool's), for reports and tests


def latest() -> PrefixHits | None:
    """The hits of the latest engine core in this process that reuses them and is still alive."""
    return LATEST[-1]() if LATEST else None


def find_longest_cache_hit(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    """``UnitaryKVCacheCoordinator.find_longest_cache_hit``: through the coordinator's hits, if any."""
    hits = getattr(instance, HITS_ATTR, None)
    # Only the call PrefixHits.find knows: (block_hashes, max_cache_hit_length), positionally.
    if hits is None or kwargs or len(args) != 2:
        return wrapped(*args, **kwargs)
    return hits.find(wrapped, *args)
