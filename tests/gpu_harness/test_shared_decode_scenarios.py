"""The shared-prefix decode parity scenarios' runner additions, on the CPU: the ``shared_decode`` prompt set's
shape, the scenarios' flags, and the shared-decode wrapper (installed over the add-on's own
``decode_attention`` where the decode-rows hook calls it: the crossover lowered, its evidence, each mutant
wrong against vLLM's one paged call in the float64 reference, removed). The GPU verdicts are
tests/gpu/test_shared_prefix_decode.py.
"""

from __future__ import annotations

import importlib
import os

import numpy as np
import pytest
import torch
from engine_prompt_limits import BLOCK_SLACK, DECODE_THRESHOLD
from shared_decode_step import BS, ROWS, SCALE, SEQ_LENS, step, vllm_decode

from mla_prefill_ext.hosts.core.shared_prefix import costs
from mla_prefill_ext.shared_prefix.decode import DECODE_CROSSOVER, plan_decode
from mla_prefill_ext.testing.reference import merge_attn_states_torch, paged_latent_attention
from scripts.gpu_harness import engine_runner, scenarios


def test_the_decode_set_shares_one_cached_prefix_and_fits_one_prefill_step():
    sets = engine_runner.shared_decode_prompt_sets()
    assert list(sets) == list(engine_runner.SHARED_DECODE_SETS)
    (prefix,) = sets["shared_decode_warm"]
    extends = sets["shared_decode"]
    n, new = engine_runner.DECODE_REQUESTS, engine_runner.DECODE_NEW
    assert len(prefix) == engine_runner.DECODE_PREFIX and engine_runner.DECODE_PREFIX % BLOCK_SLACK == 0
    assert len(extends) == n >= 8 and all(
        p[: len(prefix)] == prefix and len(p) == len(prefix) + new for p in extends
    )
    # Distinct from the first block after the prefix: the group shares the prefix and nothing more.
    assert len({tuple(p[len(prefix) : len(prefix) + BLOCK_SLACK]) for p in extends}) == n
    # Extends past vLLM's decode threshold: the first token on its prefill path, stock's and the path's alike.
    assert new > DECODE_THRESHOLD
    args = engine_runner.make_parser().parse_args(
        ["--name", "d", "--out", "o", *scenarios.SCENARIOS["shim-fa-shared-decode"].flags]
    )
    args.model_dir = "ckpt"
    kwargs = engine_runner.llm_kwargs(args)
    assert n * new <= kwargs["max_num_batched_tokens"]  # one step: every request decodes from the next one
    assert len(extends[0]) + engine_runner.DECODE_MAX_TOKENS <= kwargs["max_model_len"]
    assert engine_runner.DECODE_MAX_TOKENS >= 96  # most tokens come from decode steps
    data = {"results": {key: [{"set": key}] for key in engine_runner.SHARED_DECODE_SETS}}
    assert [r["set"] for r in engine_runner.records(data)] == list(engine_runner.SHARED_DECODE_SETS)


def test_the_decode_scenarios_ask_for_what_they_compare():
    flags = {n: scenarios.SCENARIOS[n].flags for n in scenarios.DECODE_SCENARIOS}
    assert not set(flags) & set(scenarios.SHARED_SCENARIOS)
    assert all("--eager" in f and f[f.index("--prompts") + 1] == "shared_decode" for f in flags.values())
    stock = [n for n, f in flags.items() if "--stock" in f]
    assert stock == [*scenarios.SHARED_DECODE_STOCK, scenarios.SHARED_DECODE_OTHER_KERNEL]
    # the calibration: vLLM's FlashMLA decode, asked of vLLM by name; the lifetimes its automatic choice
    other = flags[scenarios.SHARED_DECODE_OTHER_KERNEL]
    assert other[other.index("--attention-backend") + 1] == "FLASHMLA"
    assert not any("--attention-backend" in flags[n] for n in scenarios.SHARED_DECODE_STOCK)
    args = engine_runner.make_parser().parse_args(["--name", "d", "--out", "o", *other])
    args.shared_mode = args.decode_mode = None
    assert engine_runner.llm_kwargs(args)["attention_backend"] == "FLASHMLA"
    assert not any(
        "--shared-decode" in f or "--shared-decode-mutant" in f for n, f in flags.items() if n in stock
    )
    addon = {n: f for n, f in flags.items() if n not in stock}
    assert all(f[f.index("--backend-env") + 1] == "FLASH_ATTN" for f in addon.values())
    assert "--shared-decode" in addon.pop("shim-fa-shared-decode")
    assert sorted(f[f.index("--shared-decode-mutant") + 1] for f in addon.values()) == sorted(
        engine_runner.SHARED_MUTANTS
    )
    with pytest.raises(SystemExit):  # recording and a mutant are one wrapper: never both
        engine_runner.make_parser().parse_args(
            ["--name", "d", "--out", "o", "--shared-decode", "--shared-decode-mutant", "other-prefix"]
        )


@pytest.fixture
def hook(monkeypatch: pytest.MonkeyPatch):
    """The decode-rows hook's module; the crossover the wrapper lowers is restored afterwards."""
    monkeypatch.setattr(costs, "DECODE_VALUE", costs.DECODE_VALUE)
    return importlib.import_module(engine_runner.SHARED_DECODE_MODULE)


@pytest.mark.parametrize("mode", ["record", *engine_runner.SHARED_MUTANTS])
def test_the_shared_decode_wrapper_serves_the_step_and_is_wrong_only_as_a_mutant(hook, tmp_path, mode):
    original = hook.decode_attention
    assert plan_decode(ROWS, SEQ_LENS, np.ones_like(SEQ_LENS), BS, DECODE_CROSSOVER) is None  # the tiny step
    evidence = tmp_path / "r.decode"
    installed = engine_runner.install_shared_decode_wrapper(mode, evidence)
    try:
        assert hook.decode_attention is installed[0][2] and hook.decode_attention.__wrapped__ is original
        plan = plan_decode(ROWS, SEQ_LENS, np.ones_like(SEQ_LENS), BS, costs.DECODE_VALUE)  # now served
        cache, q_pe, q_nope = step()
        attend = paged_latent_attention(cache, SCALE)
        want, _ = vllm_decode(attend, q_pe, q_nope)
        device_plan = plan.to(torch.from_numpy(ROWS), torch.from_numpy(SEQ_LENS).int())
        cu = torch.arange(len(SEQ_LENS) + 1, dtype=torch.int32)
        out, _ = hook.decode_attention(q_pe, q_nope, device_plan, cu, 1, attend, merge_attn_states_torch)
    finally:
        engine_runner.uninstall(installed)
    assert hook.decode_attention is original
    members = slice(0, 4)  # rows 0-3 share three blocks
    torch.testing.assert_close(out[4:].double(), want[4:].double(), rtol=1e-5, atol=1e-5)
    wrong = (out[members].double() - want[members].double()).abs().max()
    if mode == "record":
        assert wrong < 1e-5
    else:
        assert wrong > 1e-2, mode
    ev = engine_runner.shared_decode_evidence(evidence)
    assert ev["modes"] == [mode] and ev["calls_with_groups"] == 1, ev
    assert ev["max_members"] == 4 and ev["max_prefix_tokens"] == 3 * BS, ev
    assert ev["pids"] == [os.getpid()] and not ev["ran_in_engine_process"], (
        ev
    )  # written here, not by an engine
