"""Whether the shared-prefix path runs in an engine: the setting, then the exclusions (real VllmConfig)."""

from __future__ import annotations

import pytest

from mla_prefill_ext.hosts.core.shared_prefix import switch
from mla_prefill_ext.testing import vllm_host as host


@pytest.fixture
def activated(clean_selection):
    """The add-on active on this vLLM's host, vLLM's MLA module loaded (the path records each runner)."""
    from mla_layer_on_cpu import activate_on_this_vllm

    clean_selection.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    return activate_on_this_vllm(clean_selection)


@pytest.fixture
def config(model_dirs, clean_selection):
    clean_selection.delenv("MLA_PREFILL_SHARED_PREFIX", raising=False)
    clean_selection.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)  # vLLM's own runner choice
    return host.make_vllm_config(model_dirs["yarn"])


def test_on_by_default(config):
    assert switch.decide(config) == (
        True,
        "shared cached prefixes of a step's prefill requests are worked once per layer",
    )


@pytest.mark.parametrize("value", ["0", "false", "off", "No"])
def test_the_environment_turns_it_off(config, clean_selection, value):
    clean_selection.setenv("MLA_PREFILL_SHARED_PREFIX", value)
    assert switch.decide(config) == (False, "turned off by MLA_PREFILL_SHARED_PREFIX")


def test_additional_config_wins_over_the_environment(config, clean_selection):
    clean_selection.setenv("MLA_PREFILL_SHARED_PREFIX", "0")
    config.additional_config = {"mla_prefill_shared_prefix": True}
    assert switch.decide(config).on
    config.additional_config = {"mla_prefill_shared_prefix": "off"}
    clean_selection.setenv("MLA_PREFILL_SHARED_PREFIX", "1")
    assert switch.decide(config) == (False, "turned off by additional_config['mla_prefill_shared_prefix']")


def test_a_value_that_is_not_a_switch_stops_the_engine_naming_its_source(config, clean_selection):
    clean_selection.setenv("MLA_PREFILL_SHARED_PREFIX", "maybe")
    with pytest.raises(ValueError, match=r"MLA_PREFILL_SHARED_PREFIX='maybe' is not a switch"):
        switch.decide(config)


@pytest.mark.parametrize(
    ("section", "field", "value", "reason"),
    [
        ("cache_config", "cache_dtype", "fp8", "the KV cache is fp8 (an FP8 cache is not served yet)"),
        ("parallel_config", "decode_context_parallel_size", 2, "decode context parallelism is on"),
        ("parallel_config", "prefill_context_parallel_size", 2, "prefill context parallelism is on"),
        ("parallel_config", "enable_dbo", True, "dual-batch overlap (micro-batching) is on"),
    ],
)
def test_each_exclusion_turns_it_off_with_its_reason(config, section, field, value, reason):
    setattr(getattr(config, section), field, value)
    decision = switch.decide(config)
    assert not decision.on and reason in decision.reason, decision


def _runners_here() -> list[str]:
    """The model runners this vLLM has (0.34 has no V1 runner: choosing it is an error there)."""
    from mla_prefill_ext.hosts.core.shared_prefix import needs

    return [r for r in needs.RUNNERS if "does not import" not in " ".join(needs.problems("plan", r))]


@pytest.mark.parametrize("runner", ["V1", "V2"])
def test_each_runner_is_served_exactly_where_its_block_tables_can_be_read(
    activated, model_dirs, clean_selection, runner
):
    """The decision follows the table's rows for the engine's runner (what this vLLM has), and an "off"
    names the row that failed and a remedy this vLLM accepts (never V1 where vLLM has none)."""
    from mla_prefill_ext.hosts.core.shared_prefix import needs

    if runner not in _runners_here():
        pytest.skip(f"this vLLM has no {runner} model runner")
    clean_selection.delenv("MLA_PREFILL_SHARED_PREFIX", raising=False)
    clean_selection.setenv("VLLM_USE_V2_MODEL_RUNNER", "1" if runner == "V2" else "0")
    try:
        config = host.make_vllm_config(model_dirs["yarn"])
    except ValueError as e:  # vLLM 0.25 refuses its V2 runner without Triton (a CPU box): decide for it
        assert "requires Triton" in str(e), e
        clean_selection.delenv("VLLM_USE_V2_MODEL_RUNNER")
        config = host.make_vllm_config(model_dirs["yarn"])
        clean_selection.setattr(switch, "runner_of", lambda cfg: runner)
    assert switch.runner_of(config) == runner
    missing = needs.problems("plan", runner)
    decision = switch.decide(config)
    assert decision.on is not missing, decision
    if missing:
        assert f"vLLM's {runner} model runner ({missing[0]}" in decision.reason, decision
        other = "V1" if runner == "V2" else "V2"
        advised = f"selects the {other} runner" in decision.reason
        assert advised is (other in _runners_here() and not needs.problems("plan", other)), decision


def test_a_runner_the_add_on_does_not_know_is_off_with_its_reason(activated, config, monkeypatch):
    from mla_prefill_ext.hosts.core.shared_prefix import block_tables

    monkeypatch.setattr(switch, "runner_of", lambda cfg: "V3")
    decision = switch.decide(config)
    assert not decision.on and "vLLM's V3 model runner (not known to the add-on)" in decision.reason
    assert block_tables.RUNNER_PROBLEMS, "the instrumentor ran and recorded each runner"


def test_info_outlook_without_an_engine_names_an_unserved_runner(activated, clean_selection):
    """``info`` on each tested vLLM, its runner left to vLLM: 0.20 picks V1 (served); 0.25 may pick V2 by
    model (its builders are not told each row's request: not served, said); 0.33 may pick either, 0.34
    has V2 only (served)."""
    from mla_prefill_ext import versions

    clean_selection.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    line = (versions.release(versions.installed_vllm_version() or "") or (0, 0, 0))[:2]
    served, said = switch.runner_outlook()
    if line == (0, 25):  # on, with a caveat for the models vLLM runs on V2
        assert served and "not where vLLM picks another runner" in said, said
        assert "vLLM's V2 model runner (" in said and "req_idx" in said, said
        assert "VLLM_USE_V2_MODEL_RUNNER=0 selects the V1 runner" in said
    elif line in ((0, 20), (0, 33), (0, 34)):
        assert (served, said) == (True, ""), said
    clean_selection.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    served, said = switch.runner_outlook()
    assert served is (line >= (0, 33)), said  # V2 chosen: served where builders learn each row's request


def test_one_info_line_per_process_and_decision(config, clean_selection, addon_log):
    import logging

    from mla_prefill_ext import _logging

    _logging.forget_logged()
    logging.getLogger("vllm.mla_prefill_ext").setLevel(logging.INFO)
    switch.decide_and_say(config)
    switch.decide_and_say(config)
    clean_selection.setenv("MLA_PREFILL_SHARED_PREFIX", "0")
    switch.decide_and_say(config)
    lines = [r.getMessage() for r in addon_log if "shared-prefix" in r.getMessage()]
    assert len(lines) == 2, lines
    assert lines[0].startswith("MLA shared-prefix prefill (mla-prefill-ext): on (")
    assert lines[1] == (
        "MLA shared-prefix prefill (mla-prefill-ext): off (turned off by MLA_PREFILL_SHARED_PREFIX)."
    )


@pytest.mark.parametrize("variable", ["MLA_PREFILL_SHARED_PREFIX", "MLA_PREFILL_SHARED_DECODE"])
def test_an_invalid_switch_in_the_environment_stops_the_engine_when_vllms_mla_module_loads(variable):
    """As in an engine process: the add-on activated, vLLM's MLA module imported (the model's build)."""
    from child_python import run_python

    from mla_prefill_ext import versions

    if versions.decide().mode == versions.NONE:
        pytest.skip("no host on this vLLM")
    proc = run_python(
        """
        import importlib, mla_prefill_ext
        mla_prefill_ext.activate()
        importlib.import_module("vllm.model_executor.layers.attention.mla_attention")
        """,
        **{variable: "maybe"},
    )
    assert proc.returncode != 0
    assert (
        f"RuntimeError: mla-prefill-ext: {variable}='maybe' is not a switch: use 1/true/on or 0/false/off"
    ) in proc.stderr, proc.stderr[-3000:]


def test_decode_rows_are_off_unless_the_environment_turns_them_on(config, clean_selection):
    from mla_prefill_ext.hosts.core.shared_prefix import decode_rows

    clean_selection.delenv("MLA_PREFILL_SHARED_DECODE", raising=False)
    assert decode_rows.decide(config) == "turned off by the default"
    clean_selection.setenv("MLA_PREFILL_SHARED_DECODE", "on")
    assert decode_rows.decide(config) in (None, decode_rows.WRAP_PROBLEMS["any"])
    config.speculative_config = object()  # what decide reads: that one is configured
    assert decode_rows.decide(config) == "speculative decoding is on (not served)"
