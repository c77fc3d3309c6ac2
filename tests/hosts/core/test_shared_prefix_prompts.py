"""New requests' prompts taking a shared prefix's tokens from a lender's row, in vLLM's real ``InputBatch``.

Two of vLLM's runner input batches take the same requests, removals and condensations in lockstep,
one adding through the add-on's lending (``prompt_rows.lending``, what its ``_update_states`` wrapper
sets), the other as vLLM does; every live request's token row, prompt length and the logits
processors' record of it must be the same. Requests hold KV blocks as vLLM's prefix cache hands them
out: one block id at one position always holds the same tokens.
"""

from __future__ import annotations

import importlib
import random

import pytest

from mla_prefill_ext.hosts.core.shared_prefix import prompt_rows, switch, targets

BLOCK = 16
VOCAB = 129_280
MAX_LEN = 4096


def input_batch():
    from vllm_runner_objects import empty_input_batch

    return empty_input_batch(BLOCK, MAX_LEN, max_num_reqs=16, vocab_size=VOCAB)


def state(rid: str, tokens: list[int], block_ids: list[int]):
    from vllm import SamplingParams
    from vllm.v1.worker.gpu_input_batch import CachedRequestState

    return CachedRequestState(
        req_id=rid,
        prompt_token_ids=tokens,
        mm_features=[],
        sampling_params=SamplingParams(max_tokens=4),
        generator=None,
        block_ids=(list(block_ids),),
        num_computed_tokens=0,
        output_token_ids=[],
    )


class PrefixCache:
    """Block ids handed out as vLLM's prefix cache does: a block's id stands for its tokens (and the
    blocks before it), so a request reusing a block id has those tokens at those positions."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.next_id = 1  # 0 is vLLM's null block
        self.prompts: list[tuple[list[int], list[int]]] = []  # (tokens, block ids) of cached prompts

    def fresh(self, n: int) -> list[int]:
        ids = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        return ids

    def request(self) -> tuple[list[int], list[int]]:
        rng = self.rng
        if self.prompts and rng.random() < 0.75:
            base_tokens, base_ids = rng.choice(self.prompts)
            keep = rng.choice([len(base_ids), len(base_ids), rng.randrange(0, len(base_ids) + 1)])
            tokens, ids = base_tokens[: keep * BLOCK], base_ids[:keep]
            if rng.random() < 0.15:  # the same tokens again without a cache hit (other blocks): no proof
                ids = self.fresh(keep)
        else:
            tokens, ids = [], []
        tail = rng.randrange(1, 12 * BLOCK)
        tokens = tokens + [rng.randrange(VOCAB) for _ in range(tail)]
        ids = ids + self.fresh(-(-tail // BLOCK))
        if len(tokens) >= BLOCK:
            self.prompts.append((tokens[: len(tokens) // BLOCK * BLOCK], ids[: len(tokens) // BLOCK]))
        return tokens, ids


def same_rows(ours, stock) -> None:
    assert ours.req_id_to_index == stock.req_id_to_index
    for rid, row in stock.req_id_to_index.items():
        n = int(stock.num_prompt_tokens[row])
        assert int(ours.num_prompt_tokens[row]) == n, rid
        assert (ours.token_ids_cpu[row, :n] == stock.token_ids_cpu[row, :n]).all(), rid


def lockstep(seed: int, steps: int = 40) -> tuple[int, int]:
    """A seeded run of steps through both batches; returns (requests that took a lender's row, tokens)."""
    rng = random.Random(seed)
    cache = PrefixCache(rng)
    ours, stock = input_batch(), input_batch()
    before = list(prompt_rows.COPIED)
    live: list[str] = []
    states = {}  # the runner's requests: their states live while they are in flight
    parked = []
    n = 0
    for _ in range(steps):  # as the runner's _update_states: removals, additions, condense, refresh
        for rid in [r for r in live if rng.random() < 0.3]:  # finished or unscheduled: out of the batch
            live.remove(rid)
            state_of = states.pop(rid)
            if rng.random() < 0.5:  # unscheduled or preempted: the runner keeps its state
                parked.append(state_of)
            for batch in (ours, stock):
                batch.remove_request(rid)
        for _ in range(rng.randrange(1, 5)):
            if len(live) >= 16:
                break
            tokens, ids = cache.request()
            rid, n = f"r{n}", n + 1
            own = states[rid] = state(rid, tokens, ids)
            with prompt_rows.lending(BLOCK):
                ours.add_request(own)
            stock.add_request(state(rid, list(tokens), ids))
            assert own.prompt_token_ids is tokens  # its own list back
            # The logits processors' record: the prompt's tokens, no array held past the call.
            assert ours.batch_update_builder.added[-1][2] == tokens
            assert getattr(ours.batch_update_builder.added[-1][2], "array", None) is None
            live.append(rid)
        for batch in (ours, stock):
            batch.condense()
            batch.refresh_metadata()
        same_rows(ours, stock)
    return prompt_rows.COPIED[0] - before[0], prompt_rows.COPIED[1] - before[1]


@pytest.fixture(autouse=True)
def activated(clean_selection):
    """The add-on active on this vLLM, its MLA and runner modules loaded: the batch's wrapper in place.
    Prompts of a few blocks lend here (the engine's floor is 1,024 tokens)."""
    from mla_layer_on_cpu import activate_on_this_vllm

    from mla_prefill_ext.hosts.core.shared_prefix.instrumentor import INSTRUMENTOR

    clean_selection.setenv(
        "VLLM_USE_V2_MODEL_RUNNER", "0"
    )  # the path serves the V1 runner (0.33's default: V2)
    activate_on_this_vllm(clean_selection)
    importlib.import_module(targets.RUNNER_MODULE)
    if not INSTRUMENTOR.prompts:
        pytest.skip(f"the shared-prefix path is not available here: {INSTRUMENTOR.problem}")
    clean_selection.setattr(prompt_rows, "MIN_SHARED_TOKENS", 2 * BLOCK)
    return INSTRUMENTOR


@pytest.mark.parametrize("seed", range(6))
def test_every_prompt_row_is_vllms_own(seed):
    copied, tokens = lockstep(seed)
    assert copied > 0 and tokens > 0  # the runs do lend


def test_without_the_block_comparison_a_wrong_row_is_caught(monkeypatch):
    """A lender taken on its first block alone hands over tokens the new prompt does not have."""
    monkeypatch.setattr(prompt_rows, "common_blocks", lambda a, b, bs, limit, guess=0: limit)
    with pytest.raises(AssertionError):
        for seed in range(6):
            lockstep(seed)


def test_a_burst_over_one_prefix_converts_it_once():
    batch = input_batch()
    rng = random.Random(7)
    prefix = [rng.randrange(VOCAB) for _ in range(128 * BLOCK)]
    ids = list(range(1, 129))
    before = list(prompt_rows.COPIED)
    states = [
        state(f"q{i}", prefix + [i] * 40, [*ids, 1000 + 3 * i, 1001 + 3 * i, 1002 + 3 * i]) for i in range(16)
    ]
    with prompt_rows.lending(BLOCK):
        for one in states:
            batch.add_request(one)
    assert prompt_rows.COPIED[0] - before[0] == 15
    assert prompt_rows.COPIED[1] - before[1] == 15 * 128 * BLOCK
    for i in range(16):
        row = batch.req_id_to_index[f"q{i}"]
        assert batch.token_ids_cpu[row, : 128 * BLOCK + 40].tolist() == prefix + [i] * 40


@pytest.mark.parametrize("replacement", ["other", "lender"])
def test_a_lender_that_left_the_batch_lends_nothing(replacement):
    """Out of the batch (unscheduled or preempted: the runner keeps its state), its row taken by another
    request, under another id or under its own id come back: a request over its still-cached blocks
    converts its own prompt and does not read that row."""
    batch = input_batch()
    prefix = list(range(1, 8 * BLOCK + 1))
    lender = state("lender", [*prefix, 5], list(range(1, 10)))
    other = state(replacement, [7] * (8 * BLOCK + 1), list(range(50, 59)))
    later = state("next", [*prefix, 6], [*range(1, 9), 60])
    with prompt_rows.lending(BLOCK):
        batch.add_request(lender)
        batch.remove_request("lender")
        batch.condense()
        batch.refresh_metadata()
        batch.add_request(other)  # takes its row
        before = list(prompt_rows.COPIED)
        batch.add_request(later)
    assert prompt_rows.COPIED == before
    row = batch.req_id_to_index["next"]
    assert batch.token_ids_cpu[row, : 8 * BLOCK + 1].tolist() == [*prefix, 6]


def test_a_lender_lends_its_prompt_not_the_tokens_it_generated():
    """Its blocks past the prompt hold its output, which its row may not hold yet (async scheduling
    writes a placeholder first): a request whose prompt is the lender's prompt and output takes the
    prompt's whole blocks from the row and converts the rest."""
    batch = input_batch()
    prompt = list(range(1, 8 * BLOCK + 1))
    output = list(range(900, 900 + 2 * BLOCK))
    lender = state("lender", prompt, list(range(1, 9)))
    with prompt_rows.lending(BLOCK):
        batch.add_request(lender)
    row = batch.req_id_to_index["lender"]
    # Its decoded tokens as the runner records them under async scheduling: placeholders in the row.
    lender.output_token_ids.extend(output)
    lender.block_ids[0].extend([9, 10])
    batch.token_ids_cpu[row, len(prompt) : len(prompt) + len(output)] = -1
    batch.num_tokens_no_spec[row] = len(prompt) + len(output)
    taker = state("taker", [*prompt, *output, 3], [*range(1, 11), 11])
    before = list(prompt_rows.COPIED)
    with prompt_rows.lending(BLOCK):
        batch.add_request(taker)
    assert prompt_rows.COPIED == [before[0] + 1, before[1] + len(prompt)]
    taken = batch.req_id_to_index["taker"]
    assert batch.token_ids_cpu[taken, : len(taker.prompt_token_ids)].tolist() == taker.prompt_token_ids


def test_paused_or_outside_a_step_vllm_converts_every_prompt(paused_parts):
    """Outside a runner's step or paused, vLLM's add_request alone (nothing lent, nothing remembered);
    resumed, a request lends to the next one over its blocks."""
    batch = input_batch()
    prefix = list(range(1, 8 * BLOCK + 1))
    states = [state(c, [*prefix, i], [*range(1, 9), 20 + i]) for i, c in enumerate("abcde")]
    before = list(prompt_rows.COPIED)
    batch.add_request(states[0])
    batch.add_request(states[1])
    paused_parts(["prompts"])
    with prompt_rows.lending(BLOCK):
        batch.add_request(states[2])
    paused_parts(())
    with prompt_rows.lending(BLOCK):
        batch.add_request(states[3])
        assert prompt_rows.COPIED == before
        batch.add_request(states[4])
    assert prompt_rows.COPIED[0] == before[0] + 1
    for one in states:
        row = batch.req_id_to_index[one.req_id]
        assert batch.token_ids_cpu[row, : 8 * BLOCK + 1].tolist() == one.prompt_token_ids


def kv_cache_config(*specs):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn"], spec) for i, spec in enumerate(specs)
        ],
    )


def test_the_switch_the_model_and_its_kv_cache_decide(model_dirs, clean_selection, tmp_path):
    """An MLA model whose KV cache is one MLA group, the path on: its block size (the group's, not the
    configuration's); anything else: 0 (vLLM converts every prompt)."""
    import json

    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowMLASpec
    from vllm_configs import LLAMA_CONFIG

    from mla_prefill_ext.testing import vllm_host as host

    cfg = host.make_vllm_config(model_dirs["yarn"])
    mla = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    assert prompt_rows.block_size_for(cfg, kv_cache_config(mla)) == 64 != cfg.cache_config.block_size
    window = SlidingWindowMLASpec(
        block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, sliding_window=128
    )
    full = FullAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    for other in (kv_cache_config(window), kv_cache_config(full), kv_cache_config(mla, mla), None):
        assert prompt_rows.block_size_for(cfg, other) == 0
    llama = tmp_path / "tiny-llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    assert prompt_rows.block_size_for(host.make_vllm_config(llama), kv_cache_config(mla)) == 0
    clean_selection.setenv("MLA_PREFILL_SHARED_PREFIX", "0")
    assert not switch.decide(cfg).on and prompt_rows.block_size_for(cfg, kv_cache_config(mla)) == 0


def test_this_vllms_runner_has_the_shape():
    runner = importlib.import_module(targets.RUNNER_MODULE)
    batch = importlib.import_module(targets.INPUT_BATCH_MODULE)
    assert targets.prompts_problem(runner, batch) is None


def test_another_shape_wraps_nothing_and_says_why(monkeypatch):
    runner = importlib.import_module(targets.RUNNER_MODULE)
    batch = importlib.import_module(targets.INPUT_BATCH_MODULE)

    def add_request(self, req):  # a batch whose add_request takes another argument name
        return 0

    monkeypatch.setattr(batch.InputBatch, "add_request", add_request)
    problem = targets.prompts_problem(runner, batch)
    assert problem is not None and "add_request" in problem
