"""The shared-prefix path's memos against vLLM freeing and handing out again what they are keyed by.

The path keeps state between steps: the engine core's block hashes of recent requests (keyed by
tokens) and prefix-cache hits of recent lookups (keyed by block hashes, holding blocks); the runner's
host rows of its block tables (V2: a mirror written beside vLLM's, by request slot; V1: vLLM's own host
table, found by the device table's address); each step's plan groups requests by the physical blocks
of their prefix. vLLM frees blocks (preemption, abort, finish), evicts and caches them again under
other hashes, takes request ids again and gives runner slots to new requests. A memo that outlives what
it names would make a request attend another prefix's KV cache, silently.

Each test lives through such a reuse with vLLM's real objects: two of vLLM's schedulers in lockstep
(one the add-on's engine core built with its wrappers: reusing hasher, hits on its coordinator; one
stock), the runner's real block tables written from each scheduler output, the real MLA metadata
builder planning each step. After every step: the add-on's scheduler scheduled exactly what stock vLLM
did (same blocks, same cached tokens: its hashes and hits are vLLM's), every live request's hashes
are vLLM's, the rows the runner hands the builder are the scheduler's own blocks, and the plan's groups
are those its grouping forms from those rows.
"""

from __future__ import annotations

import importlib
from typing import Any, NamedTuple

import numpy as np
import pytest
from mla_layer_on_cpu import activate_on_this_vllm, build_layer, cpu_step_kernels, make_builder
from vllm_engine_steps import TwinSchedulers, V1Rows, V2Rows, computed_before, scheduled

from mla_prefill_ext.hosts.core.shared_prefix import costs, engine_core
from mla_prefill_ext.hosts.core.shared_prefix.prefix_hits import HITS_ATTR
from mla_prefill_ext.hosts.core.shared_prefix.step import STEP_ATTR
from mla_prefill_ext.shared_prefix import FlopCostModel, find_shared_prefixes
from mla_prefill_ext.testing import vllm_host as host

BS = 16


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


P, Q, R = tokens(1_000, 6 * BS), tokens(5_000, 6 * BS), tokens(9_000, 6 * BS)  # three 6-block prefixes


def tail(k: int, n: int = 20) -> list[int]:
    """Request ``k``'s own tokens after its prefix."""
    return tokens(20_000 + 100 * k, n)


class StepSeen(NamedTuple):
    scheduled: dict[str, Any]  # what the add-on's scheduler scheduled (stock's, the test checked)
    req_ids: list[str]  # the runner's batch order
    rows: list[list[int]]  # each request's blocks, as vLLM's scheduler holds them
    groups: list[tuple[tuple[int, ...], list[int]]]  # the plan's groups (members, shared blocks)


class Life:
    """One engine's life, stepped: the add-on's scheduler and stock's, the runner's tables, the builder."""

    def __init__(self, twins: TwinSchedulers, rows: Any, builder: Any, cfg: Any, mla_module: Any) -> None:
        self.twins, self.rows, self.builder, self.cfg, self.mla_module = twins, rows, builder, cfg, mla_module
        self.hasher = twins.hasher
        self.hits = getattr(twins.ours.kv_cache_manager.coordinator, HITS_ATTR)
        self.requests: dict[str, tuple[Any, Any]] = {}  # live or not: (ours, stock)
        self.seen: list[StepSeen] = []

    def add(self, request_id: str, prompt: list[int], max_tokens: int = 1) -> Any:
        pair = self.twins.add(request_id, prompt, max_tokens)
        assert pair[0].block_hashes == pair[1].block_hashes, f"{request_id}: hashes vLLM would not make"
        self.requests[request_id] = pair
        return pair[0]

    def abort(self, *request_ids: str) -> None:
        self.twins.abort(*request_ids)

    def blocks(self, request_id: str) -> list[int]:
        """The request's blocks as vLLM's own scheduler holds them."""
        return list(self.twins.stock.kv_cache_manager.get_block_ids(request_id)[0])

    def step(self) -> StepSeen:
        from vllm.config import set_current_vllm_config

        outputs = self.twins.schedule()
        ours, stock = (scheduled(o) for o in outputs)
        assert ours == stock, "the add-on's engine core scheduled other blocks or hits than vLLM's"
        for rid, (a, b) in self.requests.items():
            assert a.block_hashes == b.block_hashes, f"{rid}: hashes vLLM would not make"
        runner = self.rows.apply(outputs[0], self.builder.reorder_batch_threshold)
        vllm_rows = [self.blocks(rid) for rid in runner.req_ids]
        for i, row in enumerate(vllm_rows):  # the runner's table holds the scheduler's blocks
            assert runner.table[i, : len(row)].tolist() == row, runner.req_ids[i]
        before = computed_before(outputs[0])
        new = [ours["tokens"][rid] for rid in runner.req_ids]
        ctx = [before[rid] for rid in runner.req_ids]
        common = host.prefill_batch(new, ctx, runner.table, BS, req_idx=runner.req_idx)
        with cpu_step_kernels(self.mla_module), host.gpu_view(None), set_current_vllm_config(self.cfg):
            metadata = self.builder.build(0, common)
        shared = getattr(getattr(metadata, "prefill", None), STEP_ATTR, None)
        groups = [] if shared is None else [(s.members, s.block_ids.tolist()) for s in shared.plan.segments]
        start = metadata.num_decodes
        width = max((len(r) for r in vllm_rows), default=0)
        table = np.zeros((len(vllm_rows), width), dtype=np.int32)
        for i, row in enumerate(vllm_rows):
            table[i, : len(row)] = row
        expected = find_shared_prefixes(table[start:], ctx[start:], BS, new[start:], costs.GROUP_VALUE)
        assert groups == [(g.members, g.block_ids.tolist()) for g in expected], (
            f"the plan grouped {groups}; vLLM's rows {vllm_rows[start:]} group {expected}"
        )
        self.twins.finish_step(outputs)
        seen = StepSeen(ours, runner.req_ids, vllm_rows, groups)
        self.seen.append(seen)
        return seen


@pytest.fixture(params=["V1", "V2"])
def life(request: pytest.FixtureRequest, clean_selection: pytest.MonkeyPatch, model_dirs: Any) -> Life:
    """A fresh engine over 19 KV-cache blocks (a pool that small hands freed blocks out again at once),
    on each model runner whose block tables the path reads on this vLLM; any shared block is worth a
    segment (``costs.GROUP_VALUE`` without a guard)."""
    from mla_prefill_ext.hosts import VLLM_ENGINE_CORE_MODULE
    from mla_prefill_ext.hosts.core.shared_prefix import needs

    runner = request.param
    clean_selection.delenv("MLA_PREFILL_SHARED_PREFIX", raising=False)
    mla_module = activate_on_this_vllm(clean_selection)
    missing = needs.problems("plan", runner)
    if missing:
        pytest.skip(f"the path does not read the {runner} runner's block tables here: {missing[0]}")
    clean_selection.setenv("VLLM_USE_V2_MODEL_RUNNER", "1" if runner == "V2" else "0")
    clean_selection.setattr(costs, "GROUP_VALUE", FlopCostModel())
    core = importlib.import_module(VLLM_ENGINE_CORE_MODULE)
    # on (and off after) as the other engine-core tests leave it: one of them may have run first
    assert engine_core.INSTRUMENTOR.instrument(core), engine_core.INSTRUMENTOR.report()["problem"]
    request.addfinalizer(lambda: engine_core.INSTRUMENTOR.uninstrument(core))
    cfg = host.make_vllm_config(model_dirs["yarn"])
    cfg.cache_config.enable_prefix_caching = True
    twins = TwinSchedulers(core, cfg, num_blocks=19, block_size=BS)
    layer = build_layer(cfg, None)
    builder = make_builder(cfg, [layer], None)
    rows = V2Rows(BS) if runner == "V2" else V1Rows(BS)
    return Life(twins, rows, builder, cfg, mla_module)


def held(seen: StepSeen, *request_ids: str) -> set[int]:
    """The blocks ``request_ids`` held in the step ``seen``."""
    return {b for rid in request_ids for b in row(seen, rid)}


def _members(seen: StepSeen, *request_ids: str) -> tuple[int, ...]:
    """The positions of ``request_ids`` among the step's prefill requests (the plan's member numbering)."""
    prefills = [rid for rid in seen.req_ids if seen.scheduled["tokens"][rid] > 1]
    return tuple(sorted(prefills.index(rid) for rid in request_ids))


def test_blocks_an_abort_freed_go_to_another_prefix_in_the_next_step(life):
    """A2 and A3 (prefix P) are aborted; in the next step B1 (prefix Q) takes their blocks and, on the V2
    runner, A3's request slot, while C1 and C2 share P with the running A1. Then A1, C1 and C2 are aborted
    and D1 (prefix R) takes P's blocks: a later request over P must not be lent the blocks a lookup over P
    found before (vLLM finds 2 of P's 6 blocks still cached)."""
    for k in (1, 2, 3):  # A3's lookup takes A2's hits (the hits' first lend, compared with vLLM's)
        life.add(f"A{k}", P + tail(k), max_tokens=16)
    life.add("0Q", Q)  # Q cached, finished after this step
    life.step()
    slots = {life.rows.slot("A2"), life.rows.slot("A3")}
    life.abort("A2", "A3")
    life.add("B1", Q + tail(4), max_tokens=16)
    life.add("C1", P + tail(5, 4), max_tokens=16)
    life.add("C2", P + tail(6, 4), max_tokens=16)
    seen = life.step()
    freed = held(life.seen[0], "A2", "A3") - held(life.seen[0], "A1")
    assert freed & held(seen, "B1"), "B1 did not get a block the abort freed"
    assert seen.groups == [(_members(seen, "C1", "C2"), life.blocks("A1")[:6])]
    if isinstance(life.rows, V2Rows):  # the V2 runner hands out the latest freed slot first
        assert life.rows.slot("B1") in slots
    p_blocks = set(life.blocks("A1")[:6])
    life.abort("A1", "C1", "C2")
    life.add("D1", R + tail(7))
    assert p_blocks & held(life.step(), "D1"), "D1 did not get a block of P"
    assert life.hits.checked and life.hits.off is None and life.hits.reused_hits > 0
    life.add("E1", P + tail(8))
    seen = life.step()
    assert seen.scheduled["new"]["E1"][1] == 2 * BS  # vLLM's: P's first two blocks are still cached


def row(seen: StepSeen, request_id: str) -> list[int]:
    """The request's blocks in the step ``seen`` (as vLLM's scheduler held them)."""
    return seen.rows[seen.req_ids.index(request_id)]


def context(seen: StepSeen, request_id: str) -> int:
    """The request's cached tokens when the step began (new, resumed or running alike)."""
    new, cached = seen.scheduled["new"], seen.scheduled["cached"]
    return (new[request_id] if request_id in new else cached[request_id])[1]


def status(life: Life, request_id: str) -> tuple[str, str]:
    """The request's status in the add-on's scheduler and in stock vLLM's."""
    return tuple(s.requests[request_id].status.name for s in (life.twins.ours, life.twins.stock))


def test_blocks_a_preemption_freed_go_to_another_prefix_then_the_request_is_recomputed(life):
    """Y1-Y3 (prefix Q) and X (prefix P, scheduled last) fill the pool; Y3's next block preempts X, and
    in the next step Y1 takes a block of P that X held. X's lookup remembered P's six blocks; when it
    is recomputed (with X2 over P beside it) it must get vLLM's hits: fewer of P's blocks."""
    life.add("0P", P)
    life.add("0Q", Q)
    life.step()
    life.add("Y1", Q + tail(1, 29), max_tokens=6)  # each Y needs a block on another step
    life.add("Y2", Q + tail(2, 28), max_tokens=8)
    life.add("Y3", Q + tail(3, 14), max_tokens=5)
    life.add("X", P + tail(4, 10), max_tokens=4)
    first = life.step()
    p_blocks = set(row(first, "X")[:6])
    for _ in range(3):  # decodes; in the third Y3 needs a block and vLLM preempts X
        seen = life.step()
    assert status(life, "X") == ("PREEMPTED", "PREEMPTED"), "X was not preempted"
    assert "X" not in seen.scheduled["tokens"]
    seen = life.step()  # the step after the preemption: a block of P goes to Y1
    assert p_blocks & held(seen, "Y1"), "Y1 did not get a block of P that X held"
    assert held(first, "X") - p_blocks, "X held a block of its own"
    life.add("X2", P + tail(5, 10), max_tokens=2)
    seen = life.step()
    while "X" not in seen.scheduled["tokens"]:
        seen = life.step()
    hit = context(seen, "X") // BS
    assert hit < 6, "X was lent P's sixth block"  # vLLM's lookup: 0.20 finds four of P's blocks, 0.34 five
    assert seen.groups == [(_members(seen, "X", "X2"), row(seen, "X")[:hit])]
    assert life.hits.checked and life.hits.off is None and life.hits.reused_hits > 0


def test_a_prefix_block_evicted_and_cached_again_under_another_hash(life):
    """A1 and A2 over P leave P's lookup remembered; 0R's prefill evicts P's last two blocks and fills
    them with R's tokens (cached under R's hashes). E1 over P must get vLLM's hits: four blocks."""
    life.add("0P", P)
    life.step()
    life.add("A1", P + tail(1))
    life.add("A2", P + tail(2))  # lent A1's hits (the hits' first lend, compared with vLLM's)
    life.step()
    p_blocks = row(life.seen[-1], "A1")[:6]
    assert life.hits.reused_hits == 6
    life.add("0R", R + tail(3, 128))  # 14 full blocks: the free ones, A1's and A2's own, then P's last
    seen = life.step()
    taken = set(p_blocks) & held(seen, "0R")
    assert taken == set(p_blocks[4:]), f"0R took {sorted(taken)} of P's blocks {p_blocks}"
    pool = life.twins.stock.kv_cache_manager.block_pool
    assert all(pool.blocks[b].block_hash is not None for b in taken), "not cached again under R's hashes"
    life.add("E1", P + tail(4))
    life.add("E2", P + tail(5))
    seen = life.step()
    # vLLM's: E1 finds P's first four blocks, E2 all six (E1 cached P's last two again, in new blocks)
    assert (context(seen, "E1"), context(seen, "E2")) == (4 * BS, 6 * BS)
    assert seen.groups == [(_members(seen, "E1", "E2"), p_blocks[:4])]
    assert life.hits.checked and life.hits.off is None


def test_a_request_id_used_again_with_another_prompt(life):
    """A (aborted while running) and B (finished) come back under the same ids with prompts that
    share only P's first two blocks with the old ones: their hashes and hits are vLLM's for the new
    prompts, not the old prompts' under the same id."""
    life.add("0P", P)
    life.step()
    life.add("A", P + tail(1), max_tokens=8)
    life.add("B", P + tail(2))  # lent A's hits; finished after this step
    p_blocks = row(life.step(), "A")[:6]
    life.step()
    life.abort("A")
    head = 2 * BS
    life.add("A", P[:head] + Q[head:] + tail(3))
    life.add("B", P[:head] + R[head:] + tail(4))
    seen = life.step()
    assert seen.scheduled["finished"] >= {"A"} and {"A", "B"} <= set(seen.scheduled["new"])
    assert context(seen, "A") == context(seen, "B") == head  # vLLM's: P's first two blocks
    assert seen.groups == [(_members(seen, "A", "B"), p_blocks[:2])]
    assert life.hasher.checked and life.hasher.off is None and life.hasher.reused_blocks > 0
    assert life.hits.checked and life.hits.off is None


def test_a_runner_row_taken_by_a_new_request_after_one_finished(life):
    """A1 (prefix Q) finishes; C1 and C2 (prefix P, cached) come next step and one takes A1's runner
    row (V1: its batch row; V2: its request slot), where A1's last block is left past C1's seven:
    the rows the builder gets are the scheduler's and the plan groups C1 and C2 over P."""
    life.add("0P", P)
    life.add("A1", Q + tail(1), max_tokens=2)  # eight blocks (one more than C1's), the row's first
    life.step()
    a1_row = life.rows.slot("A1")
    life.step()
    life.add("C1", P + tail(3, 10))
    life.add("C2", P + tail(4, 10))
    seen = life.step()
    assert "A1" in seen.scheduled["finished"]
    assert a1_row in {life.rows.slot("C1"), life.rows.slot("C2")}, "neither took A1's row"
    assert row(seen, "C1")[:6] == row(seen, "C2")[:6]
    assert seen.groups == [(_members(seen, "C1", "C2"), row(seen, "C1")[:6])]
