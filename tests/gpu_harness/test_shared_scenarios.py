"""The shared-prefix parity scenarios' runner additions, on the CPU: the ``shared`` prompt set's shape,
the scenarios' flags, and the shared-context wrapper (installed over the add-on's own function, its
plan changes, its evidence, removed). The GPU verdicts are tests/gpu/test_shared_prefix.py.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from engine_prompt_limits import BLOCK_SLACK, DECODE_THRESHOLD

from scripts.gpu_harness import engine_runner, scenarios

STOCK = ["stock-shared", "stock-shared-2"]


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
        "stock-shared-prefill-compiled",
        "shim-fa-shared-compiled",
    ]
    prefill_path = [
        "stock-shared-prefill",
        "stock-shared-prefill-2",
        "stock-shared-prefill-3",
        "stock-shared-prefill-chunks",
    ]
    assert [n for n, f in flags.items() if "--stock" in f] == [
        *STOCK,
        *prefill_path,
        "stock-shared-prefill-compiled",
    ]
    # The references for the path on (which routes short extends) serve them on vLLM's prefill path.
    assert [n for n, f in flags.items() if "--decode-threshold" in f] == [
        *prefill_path,
        "stock-shared-prefill-compiled",
    ]
    assert all(flags[n][flags[n].index("--decode-threshold") + 1] == "1" for n in prefill_path)
    assert dict(scenarios.SCENARIOS["shim-fa-shared-off"].env) == {"MLA_PREFILL_SHARED_PREFIX": "0"}
    assert not any(scenarios.SCENARIOS[n].env for n in flags if n != "shim-fa-shared-off")
    assert {f[f.index("--shared-mutant") + 1] for n, f in flags.items() if "--shared-mutant" in f} == set(
        engine_runner.SHARED_MUTANTS
    )
    for name in ("shim-fa-shared-chunks", "stock-shared-prefill-chunks"):
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
        assert layer.compute_context is installed[0][2] and layer.compute_context.__wrapped__ is original
        kv_cache = torch.zeros(10, BS, 8)
        q = torch.zeros(9, 2, 8)
        segment_backend = SimpleNamespace(scale=0.125)
        out, lse = layer.compute_context(
            q, plan, torch.zeros(3, 4), object(), segment_backend, SimpleNamespace(kv_cache=kv_cache)
        )
    finally:
        engine_runner.uninstall(installed)
    assert layer.compute_context is original
    seen, seen_backend = calls[-1]
    if mode == "record":
        assert seen is plan and seen_backend is segment_backend
        assert torch.equal(out, torch.ones(9, 2, 4)) and torch.equal(lse, torch.zeros(2, 9))
    elif mode == "segment-scale":
        # The plan as it was; a copy of the segment instance with the scale 2% off, the step's untouched.
        assert seen is plan and seen_backend is not segment_backend
        assert seen_backend.scale == pytest.approx(0.125 * 1.02) and segment_backend.scale == 0.125
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
        engine_runner.uninstall(installed)
    assert torch.equal(plan.segment_block_table, before.segment_block_table)  # the step's plan is shared
    assert calls[-1][0] is not plan


def test_an_unknown_mode_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown"):
        engine_runner.install_shared_context_wrapper("wrong", tmp_path / "e")


# --- the stock reference with short extends on vLLM's prefill path ------------------------------


def test_the_decode_threshold_wrapper_lowers_a_real_builders_threshold_and_unwraps(
    clean_selection, model_dirs, tmp_path
):
    """vLLM's MLA builder, constructed as the engine constructs it, with FLASH_ATTN_MLA's class-level
    threshold of 512: after the wrapper's init the instance holds 1 (the runner reads it from there).
    The add-on is active only so that a layer can be built on a CPU on every vLLM of the matrix."""
    from mla_layer_on_cpu import activate_on_this_vllm, build_layer
    from vllm.config import set_current_vllm_config

    from mla_prefill_ext.testing import vllm_host as host

    mla_attention = activate_on_this_vllm(clean_selection)

    cfg = host.make_vllm_config(model_dirs["yarn"])
    layer = build_layer(cfg, None)
    base = layer.attn_backend.get_builder_cls()
    assert issubclass(base, mla_attention.MLACommonMetadataBuilder)
    # As FLASH_ATTN_MLA declares it: short extends (<= 512 new tokens) are decodes.
    varlen = type(base.query_len_support).VARLEN
    wide = type(
        "WideThresholdBuilder",
        (base,),
        {"reorder_batch_threshold": DECODE_THRESHOLD, "query_len_support": varlen},
    )

    def build() -> Any:
        with host.gpu_view(None), set_current_vllm_config(cfg):
            spec = layer.get_kv_cache_spec(cfg)
            return wide(spec, [layer.layer_name], cfg, torch.device("cpu"))

    assert build().reorder_batch_threshold == DECODE_THRESHOLD  # unwrapped: vLLM's own value
    evidence = tmp_path / "run.threshold"
    [(_, path, _)] = installed = engine_runner.install_builder_wrappers(evidence, threshold=1)
    try:
        assert build().reorder_batch_threshold == 1
    finally:
        engine_runner.uninstall(installed)
    assert build().reorder_batch_threshold == DECODE_THRESHOLD
    assert path == "MLACommonMetadataBuilder.__init__"
    assert evidence.read_text().splitlines() == [f"{os.getpid()} threshold {DECODE_THRESHOLD} 1"]
    summary = engine_runner.decode_threshold_evidence(evidence, 1)
    # Written from this process here; in a scenario, from the engine's.
    assert summary["stock_thresholds"] == [DECODE_THRESHOLD] and summary["thresholds"] == [1]
    assert not summary["ran_in_engine_process"]


def test_each_evidence_reader_takes_only_its_wrappers_lines_of_the_one_file(tmp_path):
    """A run's wrappers all write to one evidence file (--context-chunk-tokens with --decode-threshold,
    --shared-evidence with --shared-decode): each summary counts only the lines of its own kind."""
    evidence = tmp_path / "run.evidence"
    lines = ["7 init 65536 2048", "7 threshold 512 1", "7 chunks 4 2048", "7 context record 1 0 16:6144:200"]
    evidence.write_text("\n".join([*lines, "7 decode record 16:2048"]) + "\n")
    chunks = engine_runner.chunk_evidence(evidence, 2048)
    assert (chunks["builder_inits"], chunks["chunks_per_step"], chunks["ran_in_engine_process"]) == (
        1,
        [4],
        True,
    )
    assert engine_runner.decode_threshold_evidence(evidence, 1)["thresholds"] == [1]
    context = engine_runner.shared_context_evidence(evidence)
    assert (context["calls"], context["max_members"], context["max_short_extend_members"]) == (1, 16, 16)
    assert engine_runner.shared_decode_evidence(evidence)["max_prefix_tokens"] == 2048


def test_the_pairs_of_the_recorded_h200_run_read_as_the_docs_say(capsys):
    """docs/results/h200-2026-12-01-shared-prefix-parity: the path on within the prefill-path lifetimes'
    bound against each of them, both mutants outside it against every stock lifetime."""
    from pathlib import Path

    from scripts.gpu_harness import shared_pairs

    record = Path(__file__).resolve().parents[2] / "docs/results/h200-2026-12-01-shared-prefix-parity"
    assert shared_pairs.main([str(record / "run1"), str(record / "run2")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "lifetime bound: 0.1767" in lines
    on = [line for line in lines if line.startswith("shim-fa-shared") and "prefill" in line.split(":")[0]]
    assert len(on) == 6 and all(": pass (bound 0.177)" in line for line in on)
    mutants = [line for line in lines if line.startswith("mutant-")]
    assert len(mutants) == 10 and all(": FAIL" in line for line in mutants)


def test_the_tp2_shared_session_runs_every_tp2_scenario_and_the_ray_ones_it_judges():
    from scripts.gpu_harness import session
    from tests.gpu import test_shared_prefix_tp2 as tp2

    assert sorted(session.SHARED_TP2_QUEUE) == sorted(scenarios.SHARED_TP2_SCENARIOS)
    judged = {*tp2.STOCK, *tp2.STOCK_PREFILL, *tp2.ON, *tp2.OFF, tp2.MUTANT}
    assert judged == {*session.SHARED_TP2_QUEUE, *session.SHARED_RAY_QUEUE}
    for name in judged:
        s = session.ALL[name]
        assert s.gpus == 2 and s.flags[s.flags.index("--tp") + 1] == "2" and "--eager" in s.flags, name
        executor = s.flags[s.flags.index("--executor") + 1] if "--executor" in s.flags else "mp"
        assert executor == ("ray" if name.endswith("-ray") else "mp"), name
    # The off switch is set in the driver's environment only; the Ray runs carry no test-only wrapper.
    assert dict(session.ALL["shim-fa-shared-off-ray"].env)["MLA_PREFILL_SHARED_PREFIX"] == "0"
    assert dict(session.ALL["shim-fa-shared-off-tp2"].env) == {"MLA_PREFILL_SHARED_PREFIX": "0"}
    ray_flags = [f for n in session.SHARED_RAY_QUEUE for f in session.ALL[n].flags]
    assert not {"--shared-evidence", "--shared-mutant", "--decode-threshold"} & set(ray_flags)
    # The path-on references serve short extends on vLLM's prefill path, as the path routes them.
    for name in tp2.STOCK_PREFILL:
        assert session.ALL[name].flags[session.ALL[name].flags.index("--decode-threshold") + 1] == "1"


def test_the_shared_multi_order_keeps_one_engine_per_gpu(monkeypatch, tmp_path):
    """Single-GPU scenarios one per GPU, then each TP=2 one alone, then the Ray ones inside a cluster's
    lifetime: never two engines on one GPU (vLLM 0.25.1's memory profiling fails beside another)."""
    from scripts.gpu_harness import session

    events: list[tuple[str, str]] = []
    monkeypatch.setattr(session, "ensure_checkpoint", lambda _: None)
    monkeypatch.setattr(session, "run_scenario", lambda name, _, devices: events.append((name, devices)))
    monkeypatch.setattr(session.ray_cluster, "start", lambda _: events.append(("ray start", "")))
    monkeypatch.setattr(session.ray_cluster, "stop", lambda: events.append(("ray stop", "")))
    monkeypatch.setattr(scenarios.time, "sleep", lambda _: None)
    singles = ["stock-shared", "shim-fa-shared-off"]
    session.only(tmp_path, [*session.SHARED_RAY_QUEUE, *singles, *session.SHARED_TP2_QUEUE])
    names = [n for n, _ in events]
    # Two lanes (GPU 0, GPU 1) take them from one queue, so which GPU runs which is not fixed.
    assert sorted(names[:2]) == sorted(singles) and {d for _, d in events[:2]} <= {"0", "1"}
    assert names[2 : 2 + len(session.SHARED_TP2_QUEUE)] == session.SHARED_TP2_QUEUE
    assert names[2 + len(session.SHARED_TP2_QUEUE) :] == [
        "ray stop",
        "ray start",
        *session.SHARED_RAY_QUEUE,
        "ray stop",
    ]
    assert all(d == "0,1" for n, d in events[2:] if not n.startswith("ray "))
