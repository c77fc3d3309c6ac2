"""The shared-prefix parity scenarios' runner additions, on the CPU: the ``shared`` prompt set's shape,
the scenarios' flags, and the shared-context wrapper (installed over the add-on's own function, its
plan changes, its evidence, removed). The GPU verdicts are tests/gpu/test_shared_prefix.py.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from scripts.gpu_harness import engine_runner, scenarios

STOCK = ["stock-shared", "stock-shared-2", "stock-shared-3"]
BLOCK_SLACK = 64  # the largest page size of the MLA backends
DECODE_THRESHOLD = 512  # FLASH_ATTN_MLA's reorder_batch_threshold: extends up to this are decodes in stock


def test_the_shared_prompt_sets_share_one_prefix_and_differ_after_it():
    sets = engine_runner.shared_prompt_sets()
    prefix_len = engine_runner.SHARED_PREFIX
    assert list(sets) == list(engine_runner.SHARED_SETS)
    prefix = sets["shared_warm"][0]
    assert len(sets["shared_warm"]) == 1 and len(prefix) == prefix_len
    sizes = {
        "shared_short": (engine_runner.SHARED_SHORT, engine_runner.SHARED_SHORT_NEW),
        "shared_long": (engine_runner.SHARED_LONG, engine_runner.SHARED_LONG_NEW),
        "shared_private_warm": (engine_runner.SHARED_PRIVATE, engine_runner.SHARED_PRIVATE_CONTEXT),
    }
    for key, (count, new) in sizes.items():
        prompts = sets[key]
        assert len(prompts) == count and all(len(p) == prefix_len + new for p in prompts), key
        assert all(p[:prefix_len] == prefix for p in prompts), key
        # Distinct from the first block after the prefix: only the prefix is shared in the cache.
        heads = {tuple(p[prefix_len : prefix_len + BLOCK_SLACK]) for p in prompts}
        assert len(heads) == count, key
    assert engine_runner.SHARED_SHORT == 16
    assert engine_runner.SHARED_SHORT_NEW <= DECODE_THRESHOLD < engine_runner.SHARED_LONG_NEW
    assert engine_runner.SHARED_PRIVATE_NEW > DECODE_THRESHOLD
    private = sets["shared_private"]
    assert [p[: len(w)] for p, w in zip(private, sets["shared_private_warm"], strict=True)] == sets[
        "shared_private_warm"
    ]
    assert {len(p) for p in private} == {
        prefix_len + engine_runner.SHARED_PRIVATE_CONTEXT + engine_runner.SHARED_PRIVATE_NEW
    }
    assert len({tuple(p[-engine_runner.SHARED_PRIVATE_NEW :]) for p in private}) == len(private)
    # Cached prefixes are whole blocks of every page size; each set fits the engine in one step.
    assert prefix_len % BLOCK_SLACK == 0 and engine_runner.SHARED_PRIVATE_CONTEXT % BLOCK_SLACK == 0
    assert engine_runner.shared_cached_tokens("shared_private") == len(sets["shared_private_warm"][0])
    assert engine_runner.shared_cached_tokens("shared_short") == prefix_len
    assert engine_runner.shared_cached_tokens("shared_warm") == 0
    args = engine_runner.make_parser().parse_args(
        ["--name", "s", "--out", "o", *scenarios.SCENARIOS["shim-fa-shared"].flags]
    )
    args.model_dir = "ckpt"
    kwargs = engine_runner.llm_kwargs(args)
    for key, prompts in sets.items():
        new = sum(len(p) - engine_runner.shared_cached_tokens(key) for p in prompts)
        assert new <= kwargs["max_num_batched_tokens"], key
        assert max(len(p) for p in prompts) + engine_runner.MAX_TOKENS <= kwargs["max_model_len"], key
    parity = engine_runner.llm_kwargs(engine_runner.make_parser().parse_args(["--name", "p", "--out", "o"]))
    assert parity["max_num_batched_tokens"] == engine_runner.MAX_NUM_BATCHED_TOKENS  # other sets unchanged


def test_the_shared_scenarios_ask_for_what_they_compare():
    flags = {n: scenarios.SCENARIOS[n].flags for n in scenarios.SHARED_SCENARIOS}
    assert all(
        ("--prompts", "shared") == f[f.index("--prompts") : f.index("--prompts") + 2] for f in flags.values()
    )
    assert [n for n, f in flags.items() if "--eager" not in f] == [
        "stock-shared-compiled",
        "shim-fa-shared-compiled",
    ]
    assert [n for n, f in flags.items() if "--stock" in f] == [
        *STOCK,
        "stock-shared-chunks",
        "stock-shared-compiled",
    ]
    assert dict(scenarios.SCENARIOS["shim-fa-shared-off"].env) == {"MLA_PREFILL_SHARED_PREFIX": "0"}
    assert not any(scenarios.SCENARIOS[n].env for n in flags if n != "shim-fa-shared-off")
    assert {f[f.index("--shared-mutant") + 1] for n, f in flags.items() if "--shared-mutant" in f} == set(
        engine_runner.SHARED_MUTANTS
    )
    for name in ("shim-fa-shared-chunks", "stock-shared-chunks"):
        assert "--context-chunk-tokens" in flags[name]


# A step of three prefill requests sharing blocks [3, 4] (32 tokens), two with private context after them.
BS = 16
TABLE = np.array([[3, 4, 7, 0], [3, 4, 8, 0], [3, 4, 0, 0]], dtype=np.int32)
QUERY_START = np.array([0, 3, 7, 9])


def _plan(context_lens: list[int]):
    from mla_prefill_ext.shared_prefix import FlopCostModel, plan_context

    plan = plan_context(TABLE, np.array(context_lens), QUERY_START, BS, 4096, value=FlopCostModel())
    assert plan.has_segments
    return plan


@pytest.fixture
def probe(monkeypatch: pytest.MonkeyPatch):
    """The layer hook's ``compute_context`` replaced by a probe that records its arguments; the
    wrapper is installed over the probe as it would be over the add-on's function."""
    layer = importlib.import_module(engine_runner.SHARED_LAYER_MODULE)
    calls = []

    def compute_context(q, plan, table, step_backend, segment_backend, layer_ctx):
        calls.append((plan, segment_backend))
        heads, dv = 2, 4
        return torch.ones(q.shape[0], heads, dv), torch.zeros(heads, q.shape[0])

    monkeypatch.setattr(layer, "compute_context", compute_context)
    return layer, compute_context, calls


@pytest.mark.parametrize("mode", ["record", *engine_runner.SHARED_MUTANTS])
@pytest.mark.parametrize("private", [True, False], ids=["private-context", "prefix-only"])
def test_the_shared_context_wrapper_installs_changes_the_plan_and_unwraps(probe, tmp_path, mode, private):
    layer, original, calls = probe
    plan = _plan([40, 36, 32] if private else [32, 32, 32])
    evidence = tmp_path / "r.shared"
    installed = engine_runner.install_shared_context_wrapper(mode, evidence)
    try:
        assert layer.compute_context is installed[2] and layer.compute_context.__wrapped__ is original
        kv_cache = torch.zeros(10, BS, 8)
        q = torch.zeros(9, 2, 8)
        segment_backend = object()
        out, lse = layer.compute_context(
            q, plan, torch.zeros(3, 4), object(), segment_backend, SimpleNamespace(kv_cache=kv_cache)
        )
    finally:
        engine_runner.uninstall_shared_context_wrapper(installed)
    assert layer.compute_context is original
    seen, seen_backend = calls[-1]
    if mode == "record":
        assert seen is plan and seen_backend is segment_backend
        assert torch.equal(out, torch.ones(9, 2, 4)) and torch.equal(lse, torch.zeros(2, 9))
    elif mode == "other-prefix":
        # The segment gathers the two blocks after its own prefix.
        assert seen.segment_block_table.tolist() == [[5, 6]] and seen.segments == plan.segments
        assert seen.segment_block_table.dtype == plan.segment_block_table.dtype
    elif private:
        assert seen.segments == () and seen_backend is None
        assert seen.private_passes == plan.private_passes
    else:  # nothing but the dropped segment: no context reaches the merge
        assert torch.equal(out, torch.zeros(9, 2, 4))
        assert lse.shape == (2, 9) and bool((lse == -math.inf).all())
    ev = engine_runner.shared_context_evidence(evidence)
    assert ev["modes"] == [mode] and ev["calls"] == 1
    assert (ev["max_members"], ev["max_segment_tokens"], ev["max_short_extend_members"]) == (3, 32, 3)
    assert ev["max_private_passes"] == (1 if private else 0) and ev["max_segment_passes"] == 1
    assert not ev["ran_in_engine_process"]  # it ran here: a GPU run would be refused for it


def test_a_shared_mutant_leaves_the_plan_it_was_given_unchanged(probe, tmp_path):
    _, _, calls = probe
    plan = _plan([40, 36, 32])
    before = dataclasses.replace(plan)
    installed = engine_runner.install_shared_context_wrapper("other-prefix", tmp_path / "e")
    try:
        importlib.import_module(engine_runner.SHARED_LAYER_MODULE).compute_context(
            torch.zeros(9, 2, 8), plan, None, None, None, SimpleNamespace(kv_cache=torch.zeros(10, BS, 8))
        )
    finally:
        engine_runner.uninstall_shared_context_wrapper(installed)
    assert torch.equal(plan.segment_block_table, before.segment_block_table)  # the step's plan is shared
    assert calls[-1][0] is not plan


def test_an_unknown_mode_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown"):
        engine_runner.install_shared_context_wrapper("wrong", tmp_path / "e")
