"""The GPU suite's scenarios as the runner reads them, and the engine arguments it makes of them (CPU, the
installed vLLM's own config classes): a typo in a scenario fails here, not after a GPU lease started."""

from __future__ import annotations

import pytest

from scripts.gpu_harness import engine_runner, scenarios


@pytest.mark.parametrize("name", sorted(scenarios.SCENARIOS))
def test_every_scenario_parses_into_engine_arguments(name, tmp_path):
    s = scenarios.SCENARIOS[name]
    args = engine_runner.make_parser().parse_args(
        ["--name", name, "--out", str(tmp_path / "r.json"), *s.flags]
    )
    args.model_dir = tmp_path  # the sharp checkpoint's folder, as scenarios.command passes it
    kwargs = engine_runner.llm_kwargs(args)
    assert kwargs["enforce_eager"] == ("--eager" in s.flags)
    assert kwargs["tensor_parallel_size"] == (
        int(s.flags[s.flags.index("--tp") + 1]) if "--tp" in s.flags else 1
    )


def test_the_fa2_calibration_asks_vllm_for_flash_attention_2(tmp_path):
    """stock-fa2-eager: the add-on disabled, vLLM's own attention config set to FA2, which the installed
    vLLM's AttentionConfig accepts (and refuses a version it does not know)."""
    from vllm.config import AttentionConfig

    s = scenarios.SCENARIOS["stock-fa2-eager"]
    args = engine_runner.make_parser().parse_args(
        ["--name", s.name, "--out", str(tmp_path / "r.json"), *s.flags]
    )
    args.model_dir = tmp_path
    kwargs = engine_runner.llm_kwargs(args)
    assert args.stock and kwargs["attention_config"] == {"flash_attn_version": 2}
    assert AttentionConfig(**kwargs["attention_config"]).flash_attn_version == 2
    with pytest.raises(Exception, match="flash_attn_version"):
        AttentionConfig(flash_attn_version=5)
    stock = engine_runner.make_parser().parse_args(["--name", "stock", "--out", "o", "--stock"])
    stock.model_dir = tmp_path
    assert "attention_config" not in engine_runner.llm_kwargs(
        stock
    )  # stock stays vLLM's default (FA3 on SM90)
