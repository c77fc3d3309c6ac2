"""The engine core's reuse of a shared prefix's block hashes, with vLLM's real hasher and requests.

Every check compares against vLLM's own hasher on the same requests: the reused hashes must be the
same bytes, block for block, or the prefix cache would hit the wrong blocks.
"""

from __future__ import annotations

import json
import random

import pytest
import wrapt
from vllm_configs import LLAMA_CONFIG

from mla_prefill_ext.hosts.core.shared_prefix import engine_core, prefix_hashes, switch
from mla_prefill_ext.hosts.core.shared_prefix.prefix_hashes import ReusingHasher, common_blocks

BLOCK = 16


@pytest.fixture(scope="module")
def vllm_hasher():
    """vLLM's factory and hash function, as EngineCore.__init__ makes them (sha256, NONE_HASH set)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    hash_fn = get_hash_fn_by_name("sha256")
    kv_cache_utils.init_none_hash(hash_fn)
    factory = getattr(kv_cache_utils.get_request_block_hasher, "__wrapped__", None)
    factory = factory or kv_cache_utils.get_request_block_hasher
    return lambda: factory(BLOCK, hash_fn)


def request(tokens, hasher=None, **extra):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(
        request_id=f"r{random.random()}",
        prompt_token_ids=list(tokens),
        sampling_params=SamplingParams(max_tokens=4),
        pooling_params=None,
        block_hasher=hasher,
        **extra,
    )


def batches(seed):
    """Prompts that share prefixes in every way a prefix cache meets: the same long prefix with
    private tails, tails inside a block, one prompt a prefix of another, the same prompt twice,
    prompts that part in the first block, shorter than a block, and unrelated ones."""
    rng = random.Random(seed)
    vocab = 129_280

    def toks(n):
        return [rng.randrange(vocab) for _ in range(n)]

    shared = toks(rng.randrange(5, 40) * BLOCK + rng.randrange(BLOCK))
    prompts = [shared + toks(rng.randrange(0, 3 * BLOCK)) for _ in range(6)]
    prompts += [prompts[0], shared[: rng.randrange(1, len(shared))], prompts[1] + toks(2 * BLOCK)]
    prompts += [shared[:3] + toks(4 * BLOCK), toks(BLOCK - 1), toks(rng.randrange(1, 9) * BLOCK)]
    other = toks(20 * BLOCK)
    prompts += [other + toks(rng.randrange(BLOCK, 3 * BLOCK)) for _ in range(10)]  # past DONORS
    prompts += [shared + toks(BLOCK)]  # its donors may have been pushed out: still exact
    rng.shuffle(prompts)
    return prompts


@pytest.mark.parametrize("seed", range(6))
def test_every_hash_is_vllms_own(vllm_hasher, seed):
    reusing = ReusingHasher(vllm_hasher(), BLOCK)
    for tokens in batches(seed):
        stock, ours = request(tokens, vllm_hasher()), request(tokens, reusing)
        assert ours.block_hashes == stock.block_hashes, (seed, len(tokens))
        # Decoded tokens complete later blocks: vLLM's hasher goes on from the reused hashes.
        for token in range(2 * BLOCK + 3):
            for r in (stock, ours):
                r.append_output_token_ids(token)
        assert ours.block_hashes == stock.block_hashes
    assert reusing.reused_blocks > reusing.hashed_blocks  # most blocks of these batches are shared


@pytest.mark.parametrize("seed", range(16))
def test_every_hash_is_vllms_own_while_requests_live_finish_decode_and_are_cut(vllm_hasher, seed):
    """The engine's life around the hasher, seeded: requests over a few prefixes (parting anywhere,
    the first block included), over live requests' tokens and unrelated ones stay in flight for a
    while, decode tokens (their later blocks hashed by vLLM after the reused ones), finish in any
    order, and now and then a KV connector cuts a live request's prompt (its last token dropped, its
    output in its place). Each request has a twin hashed by vLLM alone that lives through the same:
    their hashes are equal after every step."""
    rng = random.Random(seed)
    vocab = 129_280

    def toks(n):
        return [rng.randrange(vocab) for _ in range(n)]

    reusing = ReusingHasher(vllm_hasher(), BLOCK)
    prefixes = [toks(rng.randrange(2, 30) * BLOCK + rng.randrange(BLOCK)) for _ in range(3)]
    live = []  # (ours, twin)
    for i in range(150):
        roll = rng.random()
        if roll < 0.5:
            base = rng.choice(prefixes)
            tokens = base[: rng.choice([len(base), len(base), rng.randrange(1, len(base) + 1)])]
        elif roll < 0.8 and live:
            base = list(rng.choice(live)[0].all_token_ids)
            tokens = base[: rng.choice([len(base), rng.randrange(1, len(base) + 1)])]  # a live request's
        else:
            tokens = []
        # Often whole blocks: a cut then changes a hashed block.
        tail = rng.choice([rng.randrange(0 if tokens else 1, 3 * BLOCK), BLOCK * rng.randrange(1, 3)])
        tokens = tokens + toks(tail)
        pair = (request(tokens, reusing), request(tokens, vllm_hasher()))
        assert pair[0].block_hashes == pair[1].block_hashes, (seed, i)
        live.append(pair)
        for pair in rng.sample(live, min(len(live), 3)):
            cut = rng.random() < 0.3 and pair[0].num_output_tokens == 0 and pair[0].num_prompt_tokens > 1
            token = rng.randrange(vocab)
            for r in pair:
                if cut:  # as a KV connector does it (vllm/distributed/kv_transfer/kv_connector/v1/nixl)
                    r.prompt_token_ids.pop()
                    r._all_token_ids.pop()
                    r.num_prompt_tokens -= 1
                r.append_output_token_ids(token)
            assert pair[0].block_hashes == pair[1].block_hashes, (seed, i)
        while live and (len(live) > 12 or rng.random() < 0.3):
            live.pop(rng.randrange(len(live)))  # finished
    assert reusing.reused_blocks > 0


def test_sixteen_requests_over_one_prefix_hash_it_once(vllm_hasher):
    reusing = ReusingHasher(vllm_hasher(), BLOCK)
    prefix = list(range(100_000, 100_000 + 64 * BLOCK))
    for i in range(16):
        r = request(prefix + [i] * (BLOCK + 5), reusing)
        assert r.block_hashes == request(prefix + [i] * (BLOCK + 5), vllm_hasher()).block_hashes
    assert reusing.reused_blocks == 15 * 64
    assert reusing.hashed_blocks == 64 + 16  # the prefix once, each request's own full block


@pytest.mark.parametrize(
    "extra",
    [
        {"cache_salt": "tenant-a"},
        {"lora_request": "lora"},
    ],
)
def test_requests_with_extra_keys_are_left_to_vllm(vllm_hasher, extra):
    """A salt or a LoRA changes every hash of the same tokens: such requests neither take nor lend."""
    if "lora_request" in extra:
        from vllm.lora.request import LoRARequest

        extra = {"lora_request": LoRARequest("adapter", 1, "/nonexistent")}
    reusing = ReusingHasher(vllm_hasher(), BLOCK)
    tokens = list(range(10 * BLOCK))
    plain = request(tokens, reusing)
    special = request(tokens, reusing, **extra)
    assert special.block_hashes == request(tokens, vllm_hasher(), **extra).block_hashes
    assert special.block_hashes != plain.block_hashes
    assert reusing.reused_blocks == 0
    assert request(tokens, reusing).block_hashes == plain.block_hashes
    assert reusing.reused_blocks == 10


def _first_block_matcher(monkeypatch):
    """A matcher that trusts the first block alone: it hands out other prompts' hashes."""
    monkeypatch.setattr(
        prefix_hashes, "common_blocks", lambda a, b, bs, limit, guess=0: limit if a[:bs] == b[:bs] else 0
    )


def test_a_wrong_prefix_match_is_caught(vllm_hasher, monkeypatch):
    """The check above can fail: with a wrong matcher, in a hasher whose first lend was right (its own
    comparison with vLLM's done), the comparison with vLLM's hasher sees the wrong hashes."""
    _first_block_matcher(monkeypatch)
    reusing = ReusingHasher(vllm_hasher(), BLOCK)
    reusing.checked = True
    wrong = 0
    for tokens in batches(0):
        wrong += request(tokens, reusing).block_hashes != request(tokens, vllm_hasher()).block_hashes
    assert wrong > 0


def test_a_wrong_first_reuse_turns_the_reuse_off_and_returns_vllms_hashes(
    vllm_hasher, monkeypatch, addon_log
):
    """The engine's own check: the first request that takes hashes is hashed by vLLM too; where the two
    differ (here a wrong matcher), that request gets vLLM's hashes, the hasher reuses nothing from then
    on, and one INFO line names the difference."""
    import logging

    logging.getLogger("vllm.mla_prefill_ext").setLevel(logging.INFO)
    _first_block_matcher(monkeypatch)
    reusing = ReusingHasher(vllm_hasher(), BLOCK)
    for tokens in batches(0):
        assert request(tokens, reusing).block_hashes == request(tokens, vllm_hasher()).block_hashes
    assert reusing.off is not None and "hashes differently" in reusing.off
    assert reusing.reused_blocks == 0
    lines = [r.getMessage() for r in addon_log if "turned off in this engine core" in r.getMessage()]
    assert len(lines) == 1 and reusing.off in lines[0]


def _lend_one_block_too_many(monkeypatch):
    """A donor lookup that lends one block more than the request shares with it (where the donor has one)."""
    real = ReusingHasher._longest

    def longest(self, tokens, head, full):
        at, k = real(self, tokens, head, full)
        return (at, k + 1) if k and k < min(full, len(self._donors[at].hashes)) else (at, k)

    monkeypatch.setattr(ReusingHasher, "_longest", longest)


def test_one_block_lent_too_many_turns_the_reuse_off_with_its_followers(vllm_hasher, monkeypatch, addon_log):
    """A lend of one block too many (a donor lookup off by one) is caught at the first lend: vLLM's hashes
    are returned, the difference is named, the engine's prefix-cache hits (a follower) stop too, the
    gathering no longer sees the request sharing, and later requests are hashed by vLLM alone."""
    import logging

    from mla_prefill_ext.hosts.core.shared_prefix import arrivals
    from mla_prefill_ext.hosts.core.shared_prefix.prefix_hits import PrefixHits

    logging.getLogger("vllm.mla_prefill_ext").setLevel(logging.INFO)
    reusing = ReusingHasher(vllm_hasher(), BLOCK)
    hits = PrefixHits(BLOCK)
    reusing.followers.append(hits)
    prefix = list(range(1_000_000, 1_000_000 + 8 * BLOCK))
    donor = request([*prefix, *range(5 * BLOCK)], reusing)  # noqa: F841 (in flight: it lends)
    _lend_one_block_too_many(monkeypatch)
    tokens = [*prefix, *range(7, 7 + 3 * BLOCK)]
    taker = request(tokens, reusing)
    assert taker.block_hashes == request(tokens, vllm_hasher()).block_hashes
    assert reusing.off == "the first reused hashes differ from vLLM's own: block 8 of 11 hashes differently"
    assert hits.off is not None and reusing.off in hits.off
    assert not arrivals.shares_a_prefix(reusing, {taker.request_id})
    assert reusing.reused_blocks == 0
    assert [r.getMessage() for r in addon_log if reusing.off in r.getMessage()]
    monkeypatch.undo()  # a right lookup again: still off for this engine
    again = request([*prefix, 9], reusing)
    assert again.block_hashes == request([*prefix, 9], vllm_hasher()).block_hashes
    assert reusing.reused_blocks == 0


def test_the_first_reuse_is_compared_once(vllm_hasher):
    """A right first lend keeps the reuse on; vLLM's hasher runs once more for that request only."""
    calls = []
    inner = vllm_hasher()

    def counted(r):
        calls.append(len(r.block_hashes))  # the hashes the request held: 0 means from its first block
        return inner(r)

    reusing = ReusingHasher(counted, BLOCK)
    prefix = list(range(1_100_000, 1_100_000 + 16 * BLOCK))
    lender = request([*prefix, 1], reusing)  # noqa: F841 (in flight: it lends)
    assert calls == [0]
    for i in range(3):
        tokens = [*prefix, *[i] * BLOCK]
        assert request(tokens, reusing).block_hashes == request(tokens, vllm_hasher()).block_hashes
    assert reusing.checked and reusing.off is None and reusing.reused_blocks == 3 * 16
    # The first lend: vLLM's hasher after the lent hashes, then from the first block (the comparison);
    # the later lends: after the lent hashes only.
    assert calls == [0, 16, 0, 16, 16]


@pytest.mark.parametrize("seed", range(20))
def test_common_blocks_is_the_longest_equal_run(seed):
    rng = random.Random(seed)
    a = [rng.randrange(5) for _ in range(rng.randrange(0, 12 * BLOCK))]
    b = a[: rng.randrange(0, len(a) + 1)] + [rng.randrange(5) for _ in range(rng.randrange(0, 4 * BLOCK))]
    limit = min(len(a), len(b)) // BLOCK
    expected = 0
    while (
        expected < limit
        and a[expected * BLOCK : (expected + 1) * BLOCK] == b[expected * BLOCK : (expected + 1) * BLOCK]
    ):
        expected += 1
    assert common_blocks(a, b, BLOCK, limit) == expected
    # A guess (the last request's answer) is taken only where it is the answer.
    for guess in range(limit + 2):
        assert common_blocks(a, b, BLOCK, limit, guess) == expected, guess


# --- the engine core's wrappers, on vLLM's real modules ---------------------------------------------


@pytest.fixture
def core_modules():
    import importlib

    from mla_prefill_ext.hosts import VLLM_ENGINE_CORE_MODULE

    core = importlib.import_module(VLLM_ENGINE_CORE_MODULE)
    utils = importlib.import_module(engine_core.KV_CACHE_UTILS_MODULE)
    engine_core.INSTRUMENTOR.uninstrument(core)
    yield core, utils
    engine_core.INSTRUMENTOR.uninstrument(core)


def test_this_vllms_engine_core_has_the_shape(core_modules):
    from mla_prefill_ext.hosts.core.shared_prefix import needs

    assert engine_core.problem() is None
    assert [row.part for row in needs.rows("hashes", needs.ANY)] == ["hashes"] * 4


@pytest.mark.parametrize(
    ("target", "replacement", "said"),
    [
        (
            "EngineCore._initialize_kv_caches",
            lambda self: None,
            "EngineCore._initialize_kv_caches lacks parameters ['vllm_config']",
        ),
        (
            "get_request_block_hasher",
            lambda block_size, hash_fn: None,
            "lacks parameters ['caching_hash_fn']",
        ),
    ],
)
def test_another_shape_wraps_nothing_and_says_why(
    core_modules, addon_log, monkeypatch, target, replacement, said
):
    """A row of the hashes' table (needs.py) that does not hold in this vLLM (here made not to): nothing
    wrapped, the row named in the report and in one INFO line."""
    import logging

    logging.getLogger("vllm.mla_prefill_ext").setLevel(logging.INFO)
    core, _ = core_modules
    owner, _, name = target.rpartition(".")
    monkeypatch.setattr(getattr(core, owner) if owner else core, name, replacement)
    assert not engine_core.INSTRUMENTOR.instrument(core)
    assert said in engine_core.INSTRUMENTOR.report()["problem"]
    assert not isinstance(core.get_request_block_hasher, wrapt.FunctionWrapper)
    assert any(
        "block hashes and prefix-cache hits not reused" in r.getMessage() and said in r.getMessage()
        for r in addon_log
    )


def test_a_factory_whose_first_argument_is_no_block_size_is_left_to_vllm(
    core_modules, model_dirs, clean_selection
):
    from vllm.utils.hashing import get_hash_fn_by_name

    from mla_prefill_ext.testing import vllm_host as host

    core, _ = core_modules
    clean_selection.delenv("MLA_PREFILL_SHARED_PREFIX", raising=False)
    assert engine_core.INSTRUMENTOR.instrument(core)
    _engine_config_seen(core, host.make_vllm_config(model_dirs["plain"]))
    assert not isinstance(core.get_request_block_hasher("16", get_hash_fn_by_name("sha256")), ReusingHasher)


def _engine_config_seen(core, config):
    """What EngineCore.__init__ does before it makes the hasher: ``_initialize_kv_caches(config)``
    (here on an engine core without an executor: vLLM's method stops at once, after the wrapper)."""
    engine = object.__new__(core.EngineCore)
    with pytest.raises(AttributeError):
        engine._initialize_kv_caches(config)


def test_the_engine_cores_hasher_reuses_when_on(core_modules, model_dirs, clean_selection, vllm_hasher):
    from vllm.utils.hashing import get_hash_fn_by_name

    from mla_prefill_ext.testing import vllm_host as host

    core, _ = core_modules
    clean_selection.delenv("MLA_PREFILL_SHARED_PREFIX", raising=False)
    assert engine_core.INSTRUMENTOR.instrument(core)
    config = host.make_vllm_config(model_dirs["plain"])
    _engine_config_seen(core, config)
    hasher = core.get_request_block_hasher(BLOCK, get_hash_fn_by_name("sha256"))
    assert isinstance(hasher, ReusingHasher)
    assert isinstance(core.EngineCore.__dict__["_initialize_kv_caches"], wrapt.FunctionWrapper)
    tokens = list(range(8 * BLOCK))
    in_flight = [request(tokens, hasher) for _ in range(2)]  # the engine holds them while they run
    assert [r.block_hashes for r in in_flight] == [request(tokens, vllm_hasher()).block_hashes] * 2
    assert engine_core.INSTRUMENTOR.report()["reused_blocks"] == 8

    clean_selection.setenv("MLA_PREFILL_SHARED_PREFIX", "0")
    _engine_config_seen(core, config)
    assert not isinstance(core.get_request_block_hasher(BLOCK, get_hash_fn_by_name("sha256")), ReusingHasher)
    # Without a configuration seen first (another caller), vLLM's hasher as it is.
    clean_selection.delenv("MLA_PREFILL_SHARED_PREFIX")
    assert not isinstance(core.get_request_block_hasher(BLOCK, get_hash_fn_by_name("sha256")), ReusingHasher)

    engine_core.INSTRUMENTOR.uninstrument(core)
    assert not isinstance(core.get_request_block_hasher, wrapt.FunctionWrapper)
    assert not isinstance(core.EngineCore.__dict__["_initialize_kv_caches"], wrapt.FunctionWrapper)


def test_the_switch_and_the_model_decide(model_dirs, clean_selection, tmp_path):
    from mla_prefill_ext.testing import vllm_host as host

    clean_selection.delenv("MLA_PREFILL_SHARED_PREFIX", raising=False)
    config = host.make_vllm_config(model_dirs["plain"])
    assert switch.decide_hash_reuse(config).on
    config.additional_config = {"mla_prefill_shared_prefix": False}
    assert switch.decide_hash_reuse(config) == (
        False,
        "turned off by additional_config['mla_prefill_shared_prefix']",
    )
    llama = tmp_path / "tiny-llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    assert switch.decide_hash_reuse(host.make_vllm_config(llama)) == (False, "the model does not use MLA")


def test_activation_instruments_the_engine_core_in_a_vllm_process():
    from child_python import run_python

    from mla_prefill_ext import versions

    if versions.decide().mode == versions.NONE:
        pytest.skip("no host on this vLLM")
    proc = run_python(
        """
        import importlib, mla_prefill_ext, wrapt
        from mla_prefill_ext.hosts.core.shared_prefix import engine_core
        mla_prefill_ext.activate()
        core = importlib.import_module("vllm.v1.engine.core")
        wrapped = lambda: isinstance(core.get_request_block_hasher, wrapt.FunctionWrapper)
        print("wrapped", engine_core.INSTRUMENTOR.is_instrumented(), wrapped())
        mla_prefill_ext.deactivate()
        print("after", engine_core.INSTRUMENTOR.is_instrumented(), wrapped())
        """
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "wrapped True True" in proc.stdout and "after False False" in proc.stdout, proc.stdout


def test_prompt_embeddings_are_left_to_vllm(vllm_hasher):
    import torch

    reusing = ReusingHasher(vllm_hasher(), BLOCK)
    tokens = list(range(6 * BLOCK))
    request(tokens, reusing)
    embeds = torch.zeros(len(tokens), 8)
    assert not prefix_hashes.is_plain(request(tokens, None, prompt_embeds=embeds))
    with_embeds = request(tokens, reusing, prompt_embeds=embeds)
    assert with_embeds.block_hashes == request(tokens, vllm_hasher(), prompt_embeds=embeds).block_hashes
    assert reusing.reused_blocks == 0


def test_a_new_none_hash_drops_the_donors(vllm_hasher):
    """A second engine in the process draws vLLM's NONE_HASH again: chains start anew, donors go."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    reusing = ReusingHasher(vllm_hasher(), BLOCK, epoch=lambda: kv_cache_utils.NONE_HASH)
    tokens = list(range(7 * BLOCK))
    running = request(tokens, reusing)  # noqa: F841 (in flight: it would lend)
    before = kv_cache_utils.NONE_HASH
    kv_cache_utils.init_none_hash(get_hash_fn_by_name("sha256"))
    try:
        assert request(tokens, reusing).block_hashes == request(tokens, vllm_hasher()).block_hashes
        assert reusing.reused_blocks == 0
    finally:
        kv_cache_utils.NONE_HASH = before


@pytest.mark.parametrize("checked", [True, False])
def test_without_the_epoch_a_new_none_hash_is_missed(vllm_hasher, checked):
    """The check above can fail: without the epoch the donors' old chains are handed out where the
    hasher's first lend was compared already; where this is its first lend, its own comparison with
    vLLM's hasher catches it and turns the reuse off. (Another NONE_HASH as a second engine draws one
    where it is random: vLLM 0.20-0.25 without PYTHONHASHSEED, 0.33+ with a hash that is not sha256.)"""
    import hashlib

    from vllm.v1.core import kv_cache_utils

    reusing = ReusingHasher(vllm_hasher(), BLOCK)
    reusing.checked = checked
    tokens = list(range(7 * BLOCK))
    running = request(tokens, reusing)  # noqa: F841 (in flight: it lends)
    before = kv_cache_utils.NONE_HASH
    kv_cache_utils.NONE_HASH = type(before)(hashlib.sha256(b"another engine's NONE_HASH").digest())
    try:
        same = request(tokens, reusing).block_hashes == request(tokens, vllm_hasher()).block_hashes
        assert same is not checked
        assert (reusing.off is None) is checked
    finally:
        kv_cache_utils.NONE_HASH = before


def test_an_invalid_switch_does_not_reach_a_model_without_mla(tmp_path, clean_selection):
    from mla_prefill_ext.testing import vllm_host as host

    llama = tmp_path / "tiny-llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    clean_selection.setenv("MLA_PREFILL_SHARED_PREFIX", "maybe")
    assert switch.decide_hash_reuse(host.make_vllm_config(llama)) == (False, "the model does not use MLA")


def test_speculative_lookahead_hashes_are_left_to_vllm(core_modules, model_dirs, clean_selection):
    import inspect

    from vllm.utils.hashing import get_hash_fn_by_name

    from mla_prefill_ext.testing import vllm_host as host

    core, _ = core_modules
    if engine_core.LOOKAHEAD not in inspect.signature(core.get_request_block_hasher).parameters:
        pytest.skip("this vLLM's hashes never look ahead")
    clean_selection.delenv("MLA_PREFILL_SHARED_PREFIX", raising=False)
    assert engine_core.INSTRUMENTOR.instrument(core)
    _engine_config_seen(core, host.make_vllm_config(model_dirs["plain"]))
    hasher = core.get_request_block_hasher(BLOCK, get_hash_fn_by_name("sha256"), 1)
    assert not isinstance(hasher, ReusingHasher)


def test_paused_vllm_hashes_every_request_and_the_reuse_resumes_after(vllm_hasher, paused_parts):
    reusing = ReusingHasher(vllm_hasher(), BLOCK)
    prefix = list(range(200_000, 200_000 + 32 * BLOCK))
    donor = request(prefix + [1] * BLOCK, reusing)  # noqa: F841 (in flight: it lends)
    paused_parts(["hashes"])
    r = request(prefix + [2] * BLOCK, reusing)
    assert r.block_hashes == request(prefix + [2] * BLOCK, vllm_hasher()).block_hashes
    assert (reusing.reused_blocks, reusing.hashed_blocks) == (0, 33)  # vLLM hashed it, uncounted here
    paused_parts(())
    r = request(prefix + [3] * BLOCK, reusing)  # the donor from before the pause still lends
    assert r.block_hashes == request(prefix + [3] * BLOCK, vllm_hasher()).block_hashes
    assert reusing.reused_blocks == 32


def test_a_request_that_shares_nothing_is_remembered_without_a_copy_and_not_kept_alive(vllm_hasher):
    """Most requests share no first block with a recent one: the hasher neither copies their tokens
    nor holds them (freeing a finished request's copy on the input thread slowed it down)."""
    import gc
    import sys
    import weakref

    reusing = ReusingHasher(vllm_hasher(), BLOCK)
    tokens = list(range(300_000, 300_000 + 40 * BLOCK))
    refs = []  # references to one token: a copy of the prompt holds one more than vLLM's own lists
    requests = []
    for hasher in (vllm_hasher(), reusing):
        before = sys.getrefcount(tokens[100])
        requests.append(request(tokens, hasher))
        refs.append(sys.getrefcount(tokens[100]) - before)
    assert refs[0] == refs[1]
    lone = requests.pop()
    gone = weakref.ref(lone)
    del lone
    gc.collect()
    assert gone() is None
    # While it lives it lends, its tokens read then.
    prefix = list(range(400_000, 400_000 + 40 * BLOCK))
    first = request(prefix + [1] * 5, reusing)
    first.append_output_token_ids(7)  # tokens after its hashed blocks change nothing
    second = request(prefix + [2] * BLOCK, reusing)
    assert second.block_hashes == request(prefix + [2] * BLOCK, vllm_hasher()).block_hashes
    assert reusing.reused_blocks == 40 and first.block_hashes == second.block_hashes[:40]


def test_a_prefix_seen_again_after_its_request_finished_is_hashed_once_more_then_lent(vllm_hasher):
    """One request at a time over one prefix: the first leaves nothing to lend once finished; the
    second, sharing a first block with it, is kept (copied) and lends to the third."""
    reusing = ReusingHasher(vllm_hasher(), BLOCK)
    prefix = list(range(500_000, 500_000 + 24 * BLOCK))
    for i, reused in enumerate((0, 0, 24, 48)):
        tokens = prefix + [i] * BLOCK
        r = request(tokens, reusing)
        assert r.block_hashes == request(tokens, vllm_hasher()).block_hashes
        assert reusing.reused_blocks == reused
        # From the second on each shares the prefix with a recent one (the gathering's sign), also the
        # second, whose lender was gone: it hashed the prefix again and its hashes agree that far.
        assert [n for rid, n in reusing.sharing if rid == r.request_id] == ([24 * BLOCK] if i else [])
        del r  # finished before the next one comes


def test_a_lender_whose_prompt_a_kv_connector_cut_lends_only_the_blocks_left(vllm_hasher):
    """Disaggregated prefill's producer side (vLLM's nixl and mooncake connectors) drops a hashed
    request's last prompt token and appends its output token in its place: a request with those
    tokens must not take the changed block's hash."""
    reusing = ReusingHasher(vllm_hasher(), BLOCK)
    prompt = list(range(600_000, 600_000 + 3 * BLOCK))
    lender = request(prompt, reusing)
    # As the connectors do it (vllm/distributed/kv_transfer/kv_connector/v1/nixl): the count first.
    lender.prompt_token_ids.pop()
    lender._all_token_ids.pop()
    lender.num_prompt_tokens -= 1
    lender.append_output_token_ids(7)
    tokens = [*prompt[:-1], 7, *range(700_000, 700_000 + BLOCK)]
    taker = request(tokens, reusing)
    assert taker.block_hashes == request(tokens, vllm_hasher()).block_hashes
    assert reusing.reused_blocks == 2  # the two blocks the connector left as they were


def test_requests_that_share_nothing_do_not_push_a_shared_prefix_out(vllm_hasher):
    """Traffic between two bursts over one prefix (more unrelated requests than DONORS) leaves the
    prefix's copied donors in place: the next burst's first request takes the prefix's hashes."""
    reusing = ReusingHasher(vllm_hasher(), BLOCK)
    prefix = list(range(800_000, 800_000 + 30 * BLOCK))
    burst = [request(prefix + [i] * BLOCK, reusing) for i in range(3)]
    del burst  # finished
    for i in range(3 * prefix_hashes.DONORS):
        request(list(range(900_000 + 1000 * i, 900_000 + 1000 * i + 20 * BLOCK)), reusing)
    before = reusing.reused_blocks
    tokens = prefix + [7] * BLOCK
    assert request(tokens, reusing).block_hashes == request(tokens, vllm_hasher()).block_hashes
    assert reusing.reused_blocks - before == 30


def test_what_the_hasher_keeps_is_read_by_held_and_stays_within_its_donors(vllm_hasher):
    """A soak reads the hasher's memory through ``held()``: after many bursts over one prefix mixed with
    requests that share nothing, it keeps DONORS of each kind, the shared ones' tokens copied."""
    reusing = ReusingHasher(vllm_hasher(), BLOCK)
    assert reusing.held() == {"donors": 0, "donor_tokens": 0, "donor_hashes": 0, "sharing": 0}
    prefix = list(range(800_000, 800_000 + 30 * BLOCK))
    n = 3 * prefix_hashes.DONORS
    for i in range(n):
        request(prefix + [i] * BLOCK, reusing)
        request(list(range(900_000 + 1000 * i, 900_000 + 1000 * i + 20 * BLOCK)), reusing)
    donors = prefix_hashes.DONORS
    assert reusing.held() == {
        "donors": 2 * donors,
        "donor_tokens": donors * 31 * BLOCK,  # the shared kind only: the others are held weakly
        "donor_hashes": donors * 31 + donors * 20,
        "sharing": n - 1,  # every request over the prefix after the first
    }
