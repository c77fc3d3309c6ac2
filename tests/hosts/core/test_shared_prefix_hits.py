"""The engine core's reuse of a shared prefix's prefix-cache hits, against vLLM's real KV cache manager.

Two of vLLM's ``KVCacheManager`` (block pool, coordinator, full-attention manager: all real) take
the same requests, allocations, frees, evictions and cache resets in lockstep, one with its
coordinator's lookups going through :class:`PrefixHits`; every lookup must return the same blocks
and the same number of cached tokens, or a request would read another prefix's KV cache.
"""

from __future__ import annotations

import importlib
import inspect
import random

import pytest
import wrapt

from mla_prefill_ext.hosts.core.shared_prefix import engine_core, prefix_hashes, prefix_hits
from mla_prefill_ext.hosts.core.shared_prefix.prefix_hits import HITS_ATTR, PrefixHits

BLOCK = 16
VOCAB = 129_280


def kv_cache_config(num_blocks: int):
    import torch
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec

    spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)],
    )


def manager(num_blocks: int, **overrides):
    """vLLM's KVCacheManager for one MLA group, with the arguments this vLLM's constructor takes."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    wanted = {
        "kv_cache_config": kv_cache_config(num_blocks),
        "max_model_len": 8192,
        "scheduler_block_size": BLOCK,
        "hash_block_size": BLOCK,
        "enable_caching": True,
        **overrides,
    }
    params = inspect.signature(KVCacheManager.__init__).parameters
    return KVCacheManager(**{k: v for k, v in wanted.items() if k in params})


@pytest.fixture(scope="module")
def hasher():
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    hash_fn = get_hash_fn_by_name("sha256")
    kv_cache_utils.init_none_hash(hash_fn)
    factory = getattr(kv_cache_utils.get_request_block_hasher, "__wrapped__", None)
    return (factory or kv_cache_utils.get_request_block_hasher)(BLOCK, hash_fn)


def request(tokens, hasher, rid):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(
        request_id=rid,
        prompt_token_ids=list(tokens),
        sampling_params=SamplingParams(max_tokens=4),
        pooling_params=None,
        block_hasher=hasher,
    )


def with_hits(kv_manager, checked: bool = False) -> PrefixHits:
    """``kv_manager``'s coordinator looking up through a PrefixHits, as the engine core's wrapper does
    (``checked``: as if its first lend had been compared with vLLM's lookup already)."""
    coordinator = kv_manager.coordinator
    assert prefix_hits.lookup_problem(coordinator) is None
    hits = PrefixHits(BLOCK)
    hits.checked = checked
    lookup = coordinator.find_longest_cache_hit
    coordinator.find_longest_cache_hit = lambda hashes, max_len: hits.find(lookup, hashes, max_len)
    return hits


def lockstep(seed: int, hasher, num_blocks: int, hits_manager=None, plain_manager=None, checked=False):
    """A seeded run of requests over shared prefixes through both managers; returns the hits' counts.

    Each request is looked up, allocated (its blocks cached), and later freed; the pool is small
    enough that allocations evict cached blocks, and once in a while the prefix cache is reset.
    """
    rng = random.Random(seed)
    fast = hits_manager or manager(num_blocks)
    plain = plain_manager or manager(num_blocks)
    hits = with_hits(fast, checked)

    def toks(n):
        return [rng.randrange(VOCAB) for _ in range(n)]

    prefixes = [toks(rng.randrange(2, 24) * BLOCK + rng.randrange(BLOCK)) for _ in range(4)]
    live: list = []
    for i in range(160):
        base = rng.choice(prefixes)
        cut = rng.choice([len(base), len(base), rng.randrange(1, len(base) + 1)])
        req = request(base[:cut] + toks(rng.randrange(0, 3 * BLOCK)), hasher, f"r{seed}-{i}")
        # 0.33 returns a third value (a sparse group's boundary, 0 here)
        (got, got_n), (want, want_n) = fast.get_computed_blocks(req)[:2], plain.get_computed_blocks(req)[:2]
        got_ids = [b.block_id for b in got.blocks[0]]
        want_ids = [b.block_id for b in want.blocks[0]]
        assert (got_ids, got_n) == (want_ids, want_n), f"request {i}: a hit vLLM would not give"
        new = req.num_tokens - want_n
        a = fast.allocate_slots(req, new, got_n, got)
        b = plain.allocate_slots(req, new, want_n, want)
        assert (a is None) == (b is None)
        if a is not None:
            live.append(req)
        while live and (a is None or len(live) > 3 or rng.random() < 0.3):
            done = live.pop(rng.randrange(len(live)))
            fast.free(done)
            plain.free(done)
            if a is None:
                break
        if rng.random() < 0.02 and not live:
            assert fast.reset_prefix_cache() == plain.reset_prefix_cache()
    return hits


@pytest.mark.parametrize("seed", range(6))
def test_every_hit_is_vllms_own(hasher, seed):
    hits = lockstep(seed, hasher, num_blocks=rng_blocks(seed))
    assert hits.reused_hits > 0  # the runs do share prefixes


def rng_blocks(seed: int) -> int:
    return (64, 96, 160, 400, 1000, 2000)[seed % 6]  # from constant eviction to almost none


def test_sixteen_requests_over_one_prefix_look_it_up_once(hasher):
    kv = manager(4096)
    plain = manager(4096)
    hits = with_hits(kv)
    prefix = list(range(1, 128 * BLOCK + 1))  # 128 blocks
    warm = request([*prefix, 7], hasher, "warm")
    for m in (kv, plain):
        computed, n = m.get_computed_blocks(warm)[:2]
        m.allocate_slots(warm, warm.num_tokens - n, n, computed)
        m.free(warm)
    for i in range(16):
        req = request(prefix + [1000 + i] * 5, hasher, f"q{i}")
        got, want = kv.get_computed_blocks(req), plain.get_computed_blocks(req)
        assert [b.block_id for b in got[0].blocks[0]] == [b.block_id for b in want[0].blocks[0]]
        assert got[1] == want[1] == 128 * BLOCK
    assert hits.looked_up == 128  # the first request; the warm-up's lookup found nothing to lend
    assert hits.reused_hits == 15 * 128


def test_without_the_eviction_check_a_stale_hit_is_caught(hasher, monkeypatch):
    """A PrefixHits that trusts a remembered block without checking it was not evicted hands out
    blocks that now hold other tokens: the lockstep comparison must see it (where the first lend was
    compared and right, as in an engine that lent before the evictions)."""
    monkeypatch.setattr(PrefixHits, "_still_cached", staticmethod(lambda memo, k: k))
    with pytest.raises(AssertionError, match="a hit vLLM would not give"):
        for seed in range(6):
            lockstep(seed, hasher, num_blocks=64, checked=True)


def _cached(kv, tokens, hasher, rid):
    """A request looked up, allocated (its full blocks cached) and freed; its computed-token count."""
    req = request(tokens, hasher, rid)
    computed, n = kv.get_computed_blocks(req)[:2]
    kv.allocate_slots(req, req.num_tokens - n, n, computed)
    kv.free(req)
    return n


def test_a_stale_first_lend_turns_the_hits_off_and_returns_vllms_lookup(hasher, monkeypatch, addon_log):
    """Without the eviction check, a first lend of blocks a cache reset took back is caught by the
    coordinator's own comparison with vLLM's lookup: vLLM's result is returned, the hits are off for
    good, one INFO line names the difference."""
    import logging

    logging.getLogger("vllm.mla_prefill_ext").setLevel(logging.INFO)
    kv, plain = manager(4096), manager(4096)
    hits = with_hits(kv)
    prefix = list(range(1, 32 * BLOCK + 1))
    assert _cached(kv, [*prefix, 1], hasher, "a") == 0  # cached; the lookup found nothing to remember
    _cached(plain, [*prefix, 1], hasher, "a")
    assert _cached(kv, [*prefix, 2], hasher, "b") == 32 * BLOCK  # remembered
    assert kv.reset_prefix_cache() and plain.reset_prefix_cache()
    other = list(range(50_000, 50_000 + 40 * BLOCK))  # the freed blocks cached again, with other tokens
    for m in (kv, plain):
        _cached(m, other, hasher, "c")
    monkeypatch.setattr(PrefixHits, "_still_cached", staticmethod(lambda memo, k: k))
    req = request([*prefix, 3], hasher, "d")
    got, want = kv.get_computed_blocks(req)[:2], plain.get_computed_blocks(req)[:2]
    assert ([b.block_id for b in got[0].blocks[0]], got[1]) == (
        [b.block_id for b in want[0].blocks[0]],
        want[1],
    )
    assert got[1] == 0 and hits.reused_hits == 0
    assert hits.off == (
        "a lent hit differs from vLLM's own lookup: 32 blocks hit in group 0 where vLLM's lookup hits 0"
    )
    assert [r.getMessage() for r in addon_log if hits.off in r.getMessage()]


def test_a_memo_holding_a_wrong_block_turns_the_hits_off_and_returns_vllms_lookup(hasher, addon_log):
    """A memo that holds another cached block in one place (its hash object too, so the eviction check
    passes): the first lend is compared with vLLM's lookup, which returns the right block; the hits are
    off from then on, and vLLM's lookups are returned."""
    import logging

    logging.getLogger("vllm.mla_prefill_ext").setLevel(logging.INFO)
    kv, plain = manager(4096), manager(4096)
    hits = with_hits(kv)
    prefix = list(range(1, 24 * BLOCK + 1))
    other = list(range(70_000, 70_000 + 8 * BLOCK))
    for m in (kv, plain):
        _cached(m, [*prefix, 1], hasher, "a")
        _cached(m, [*other, 1], hasher, "o")
    assert _cached(kv, [*prefix, 2], hasher, "b") == 24 * BLOCK  # remembered
    _cached(plain, [*prefix, 2], hasher, "b")
    memo = hits._memos[0]
    # Another prefix's fourth block, as vLLM's pool maps its hash.
    wrong = kv.block_pool.get_cached_block(request([*other, 1], hasher, "x").block_hashes[3], [0])[0]
    memo.blocks[5], memo.keys[5] = wrong, wrong.block_hash
    req = request([*prefix, 3], hasher, "c")
    got, want = kv.get_computed_blocks(req)[:2], plain.get_computed_blocks(req)[:2]
    assert [b.block_id for b in got[0].blocks[0]] == [b.block_id for b in want[0].blocks[0]]
    assert got[1] == want[1] == 24 * BLOCK
    assert hits.off is not None and f"hit 5 of group 0 is block {wrong.block_id}" in hits.off
    lines = [r.getMessage() for r in addon_log if "no longer reused" in r.getMessage()]
    assert len(lines) == 1 and hits.off in lines[0]
    before = hits.looked_up
    assert _cached(kv, [*prefix, 4], hasher, "d") == 24 * BLOCK
    assert hits.reused_hits == 0 and hits.looked_up == before  # vLLM's own lookup, uncounted here


def test_lookups_it_cannot_take_apart_are_left_to_vllm():
    assert prefix_hits.lookup_problem(manager(64).coordinator) is None
    assert "EAGLE" in prefix_hits.lookup_problem(manager(64, use_eagle=True).coordinator)
    assert prefix_hits.lookup_problem(manager(64, enable_caching=False).coordinator) is not None


# --- the engine core's wrappers, on vLLM's real modules ---------------------------------------------


@pytest.fixture
def core_module():
    from mla_prefill_ext.hosts import VLLM_ENGINE_CORE_MODULE

    core = importlib.import_module(VLLM_ENGINE_CORE_MODULE)
    engine_core.INSTRUMENTOR.uninstrument(core)
    yield core
    engine_core.INSTRUMENTOR.uninstrument(core)


def test_this_vllms_lookup_has_the_shape():
    from mla_prefill_ext.hosts.core.shared_prefix import needs

    assert prefix_hits.coordinator_problem() is None
    assert len(needs.rows("hits", needs.ANY)) == 5


def test_the_hash_object_a_block_holds_is_the_one_vllm_cached_and_goes_with_eviction(hasher):
    """What the memo's identity test reads (``KVCacheBlock.block_hash``: a field on 0.34, a property
    before): the object vLLM's pool cached the block under, the same object each time read, None once
    the block is evicted."""
    kv = manager(64)
    _cached(kv, list(range(1, 4 * BLOCK + 1)), hasher, "a")
    block = kv.block_pool.blocks[1]
    held = block.block_hash
    assert held is not None and block.block_hash is held
    assert kv.block_pool.cached_block_hash_to_block.get_one_block(held) is block
    assert kv.reset_prefix_cache()
    assert block.block_hash is None


@pytest.mark.parametrize(
    ("target", "replacement", "said"),
    [
        (
            "find_longest_cache_hit",
            lambda self, block_hashes, max_length: None,
            "find_longest_cache_hit lacks parameters ['max_cache_hit_length']",
        ),
        ("__init__", lambda self, kv_cache_config: None, "lacks parameters ['use_eagle'"),
    ],
)
def test_another_lookup_shape_wraps_nothing(core_module, monkeypatch, target, replacement, said):
    """A row of the hits' table (needs.py) that does not hold here: nothing wrapped, the row named."""
    coordinators = importlib.import_module(prefix_hits.COORDINATOR_MODULE)
    cls = coordinators.UnitaryKVCacheCoordinator
    monkeypatch.setattr(cls, target, replacement)
    assert not engine_core.INSTRUMENTOR.instrument(core_module)
    assert said in engine_core.INSTRUMENTOR.report()["problem"]
    assert not isinstance(core_module.get_request_block_hasher, wrapt.FunctionWrapper)
    assert not isinstance(cls.__dict__[target], wrapt.FunctionWrapper)


def _engine_built(core, config):
    """What EngineCore.__init__ does around its scheduler: ``_initialize_kv_caches(config)`` (here
    without an executor: vLLM's method stops at once, after the wrapper), then the scheduler's KV
    cache manager."""
    engine = object.__new__(core.EngineCore)
    with pytest.raises(AttributeError):
        engine._initialize_kv_caches(config)
    return manager(256)


def test_the_engine_cores_coordinator_reuses_hits_when_on(core_module, model_dirs, clean_selection, hasher):
    from vllm.utils.hashing import get_hash_fn_by_name

    from mla_prefill_ext.testing import vllm_host as host

    clean_selection.delenv("MLA_PREFILL_SHARED_PREFIX", raising=False)
    assert engine_core.INSTRUMENTOR.instrument(core_module)
    config = host.make_vllm_config(model_dirs["plain"])
    kv = _engine_built(core_module, config)
    reusing = core_module.get_request_block_hasher(BLOCK, get_hash_fn_by_name("sha256"))
    assert isinstance(getattr(kv.coordinator, HITS_ATTR, None), PrefixHits)
    assert reusing.followers == [getattr(kv.coordinator, HITS_ATTR)]  # off with the engine's hash reuse
    plain = manager(256)
    prompt = list(range(40 * BLOCK))
    for i in range(3):
        req = request([*prompt, i], hasher, f"e{i}")
        got, want = kv.get_computed_blocks(req), plain.get_computed_blocks(req)
        assert [b.block_id for b in got[0].blocks[0]] == [b.block_id for b in want[0].blocks[0]]
        for m, (blocks, n) in ((kv, got[:2]), (plain, want[:2])):
            m.allocate_slots(req, req.num_tokens - n, n, blocks)
    report = engine_core.INSTRUMENTOR.report()
    assert (report["looked_up_hits"], report["reused_hits"]) == (40, 40)

    clean_selection.setenv("MLA_PREFILL_SHARED_PREFIX", "0")
    off = _engine_built(core_module, config)
    core_module.get_request_block_hasher(BLOCK, get_hash_fn_by_name("sha256"))
    assert getattr(off.coordinator, HITS_ATTR, None) is None
    # A coordinator made outside an engine core's build is left alone.
    clean_selection.delenv("MLA_PREFILL_SHARED_PREFIX")
    assert getattr(manager(64).coordinator, HITS_ATTR, None) is None

    engine_core.INSTRUMENTOR.uninstrument(core_module)
    cls = importlib.import_module(prefix_hits.COORDINATOR_MODULE).UnitaryKVCacheCoordinator
    assert not isinstance(cls.__dict__["find_longest_cache_hit"], wrapt.FunctionWrapper)
    assert not isinstance(cls.__dict__["__init__"], wrapt.FunctionWrapper)


def test_a_memo_found_stale_gives_way_to_the_new_lookup(hasher):
    """After a cache reset the remembered prefix is stale: the next lookup replaces that memo (no
    duplicate left to win later lookups), and the prefix, cached again, is lent again."""
    kv = manager(4096)
    hits = with_hits(kv)
    prefix = list(range(1, 64 * BLOCK + 1))

    def serve(rid):
        req = request([*prefix, 7, rid], hasher, f"s{rid}")
        computed, n = kv.get_computed_blocks(req)[:2]
        kv.allocate_slots(req, req.num_tokens - n, n, computed)
        kv.free(req)
        return n

    assert serve(0) == 0 and serve(1) == 64 * BLOCK
    assert kv.reset_prefix_cache()
    assert serve(2) == 0  # stale: nothing lent, vLLM finds nothing either (and caches it again)
    reused = hits.reused_hits
    assert serve(3) == 64 * BLOCK  # vLLM's lookup: the memo checked stale is not consulted again
    assert len(hits._memos) == 1, "the stale memo stayed beside the new lookup's"
    assert serve(4) == 64 * BLOCK
    assert hits.reused_hits == reused + 64  # lent from serve(3)'s lookup


def test_lookups_that_share_nothing_do_not_push_a_shared_prefix_out(hasher):
    """Lookups of prefixes no other request has (more of them than MEMOS, each a hit: a conversation's
    next turn) between two bursts over one prefix leave the burst's memo in place: the next burst's
    first lookup takes the prefix's blocks. Checked against a second manager in lockstep."""
    kv, plain = manager(4096), manager(4096)
    hits = with_hits(kv)

    def serve(tokens, rid):
        req = request(tokens, hasher, rid)
        (got, got_n), (want, want_n) = kv.get_computed_blocks(req)[:2], plain.get_computed_blocks(req)[:2]
        assert ([b.block_id for b in got.blocks[0]], got_n) == ([b.block_id for b in want.blocks[0]], want_n)
        for m, computed, n in ((kv, got, got_n), (plain, want, want_n)):
            m.allocate_slots(req, req.num_tokens - n, n, computed)
            m.free(req)
        return got_n

    prefix = list(range(1, 40 * BLOCK + 1))
    for i in range(3):  # the first caches the prefix, the next two look it up (the second lends)
        serve([*prefix, 7, i], f"burst{i}")
    for i in range(3 * prefix_hits.MEMOS):  # each cached, then hit once by a lookup of its own
        own = list(range(10_000 * (i + 1), 10_000 * (i + 1) + 8 * BLOCK))
        serve([*own, 1], f"own{i}a")
        assert serve([*own, 2], f"own{i}b") == 8 * BLOCK
    before = hits.looked_up
    assert serve([*prefix, 9], "next") == 40 * BLOCK
    assert hits.looked_up == before, "the prefix was looked up block by block again"


def test_a_coordinator_noted_for_an_engine_that_never_makes_its_hasher_is_not_pinned():
    import gc
    import weakref

    kv = manager(64)
    prefix_hits.collect(True)
    prefix_hits.note_coordinator(lambda: None, kv.coordinator, (), {})
    ref = weakref.ref(kv.coordinator)
    del kv
    gc.collect()
    assert ref() is None
    assert prefix_hits.attach(True) == ([], [])  # the engine it was noted for is gone: nothing attached


def test_hits_turned_off_by_their_engines_hash_reuse_look_up_as_vllm(hasher):
    """The engine's hash reuse turned off (its first reuse differed from vLLM's hashes) takes its
    coordinator's hits with it: vLLM's lookup from then on, memos dropped."""
    kv = manager(4096)
    hits = with_hits(kv)
    prefix = list(range(1, 16 * BLOCK + 1))
    _cached(kv, [*prefix, 1], hasher, "a")
    _cached(kv, [*prefix, 2], hasher, "b")
    reusing = prefix_hashes.ReusingHasher(hasher, BLOCK)
    reusing.followers.append(hits)
    reusing._turn_off("a test says so")
    assert hits.off is not None and "a test says so" in hits.off and not hits._memos
    assert _cached(kv, [*prefix, 3], hasher, "c") == 16 * BLOCK
    assert hits.reused_hits == 0


def test_a_lookup_called_otherwise_is_vllms(hasher):
    """The wrapper serves only find_longest_cache_hit(block_hashes, max_cache_hit_length) positionally."""
    kv = manager(256)
    hits = PrefixHits(BLOCK)
    setattr(kv.coordinator, HITS_ATTR, hits)
    calls = []

    def lookup(*args, **kwargs):
        calls.append((args, kwargs))
        return ([],), 0

    for args, kwargs in [((["h"], 64, "more"), {}), ((["h"],), {"max_cache_hit_length": 64})]:
        prefix_hits.find_longest_cache_hit(lookup, kv.coordinator, args, kwargs)
    assert calls == [((["h"], 64, "more"), {}), ((["h"],), {"max_cache_hit_length": 64})]
    assert hits.looked_up == 0


def test_paused_vllm_looks_every_block_up_and_the_reuse_resumes_after(hasher, paused_parts):
    """Through the engine core's wrapper: paused, vLLM's own lookup; resumed, the memo from before
    lends its blocks (still checked block by block)."""
    kv, plain = manager(4096), manager(4096)
    hits = PrefixHits(BLOCK)
    setattr(kv.coordinator, HITS_ATTR, hits)
    lookup = type(kv.coordinator).find_longest_cache_hit
    kv.coordinator.find_longest_cache_hit = lambda *args: prefix_hits.find_longest_cache_hit(
        lambda *a: lookup(kv.coordinator, *a), kv.coordinator, args, {}
    )
    prefix = list(range(1, 64 * BLOCK + 1))

    def warm(tag: str) -> None:
        warm = request([*prefix, 7], hasher, tag)
        for m in (kv, plain):
            computed, n = m.get_computed_blocks(warm)[:2]
            m.allocate_slots(warm, warm.num_tokens - n, n, computed)
            m.free(warm)

    def same(i: int) -> None:
        req = request(prefix + [1000 + i] * 5, hasher, f"p{i}")
        got, want = kv.get_computed_blocks(req), plain.get_computed_blocks(req)
        assert got[1] == want[1] == 64 * BLOCK
        assert [b.block_id for b in got[0].blocks[0]] == [b.block_id for b in want[0].blocks[0]]

    warm("warm")
    same(0)  # remembered
    assert (hits.looked_up, hits.reused_hits) == (64, 0)
    paused_parts(["hits"])
    same(1)
    assert (hits.looked_up, hits.reused_hits) == (64, 0)  # vLLM's lookup alone
    # While paused the cache is reset and the prefix cached again (each block with a new hash object):
    # the memo from before the pause is stale and must not lend its blocks after it.
    assert kv.reset_prefix_cache() and plain.reset_prefix_cache()
    warm("again")
    paused_parts(())
    same(2)
    assert (hits.looked_up, hits.reused_hits) == (128, 0)  # the stale memo gave way to vLLM's lookup
    same(3)
    assert (hits.looked_up, hits.reused_hits) == (128, 64)  # the new memo lends


def test_what_the_hits_keep_is_read_by_held_and_stays_within_their_memos(hasher):
    """A soak reads the hits' memory through ``held()``: many prefixes looked up twice (a memo of its
    own) and three times (the third lends: a shared memo) leave MEMOS of each kind."""
    kv = manager(8192)
    hits = with_hits(kv)
    assert hits.held() == {"memos": 0, "memo_blocks": 0}
    for i in range(3 * prefix_hits.MEMOS):
        for kind, times in (("own", 2), ("shared", 3)):
            start = 10_000 * (i + 1) + (5_000 if kind == "shared" else 0)
            for j in range(times):  # the first caches the prefix, the next look it up
                req = request([*range(start, start + 8 * BLOCK), j], hasher, f"{kind}{i}-{j}")
                computed, n = kv.get_computed_blocks(req)[:2]
                kv.allocate_slots(req, req.num_tokens - n, n, computed)
                kv.free(req)
    held = hits.held()
    assert prefix_hits.MEMOS < held["memos"] <= 2 * prefix_hits.MEMOS  # both kinds kept, each bounded
    assert held["memo_blocks"] == 8 * held["memos"]
