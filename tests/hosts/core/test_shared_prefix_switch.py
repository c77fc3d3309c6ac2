"""Whether the shared-prefix path runs in an engine: the setting, then the exclusions (real VllmConfig)."""

from __future__ import annotations

import pytest

from mla_prefill_ext.hosts.core.shared_prefix import switch
from mla_prefill_ext.testing import vllm_host as host


@pytest.fixture
def config(model_dirs, clean_selection):
    clean_selection.delenv("MLA_PREFILL_SHARED_PREFIX", raising=False)
    # The runner the path serves (0.33 defaults to V2).
    clean_selection.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
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


def test_vllms_v2_model_runner_turns_it_off_with_its_reason(config, clean_selection):
    """The V2 runner keeps block tables on the GPU only: the path is off there, and says so (0.33's
    default for every model; VLLM_USE_V2_MODEL_RUNNER=1 picks it on 0.20 and 0.25 too)."""
    clean_selection.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    decision = switch.decide(config)
    assert not decision.on
    assert "vLLM's V2 model runner runs this engine" in decision.reason, decision
    assert "VLLM_USE_V2_MODEL_RUNNER=0 selects the V1 runner" in decision.reason


def test_vllms_own_runner_choice_is_the_one_read(config, clean_selection):
    """With the variable unset, vLLM's own choice decides: on 0.25+ ``VllmConfig.use_v2_model_runner``
    (0.33: V2 for this model; 0.25: V1, the model has MoE layers), before 0.25 the V1 runner."""
    clean_selection.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    v2 = bool(getattr(config, "use_v2_model_runner", False))
    assert switch.decide(config).on is not v2
    assert ("vLLM's V2 model runner runs this engine" in switch.decide(config).reason) is v2


@pytest.mark.parametrize(("value", "served"), [("1", False), ("0", True), (None, None)])
def test_info_outlook_without_an_engine_names_the_runner(clean_selection, value, served):
    from mla_prefill_ext import versions

    if value is None:
        clean_selection.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    else:
        clean_selection.setenv("VLLM_USE_V2_MODEL_RUNNER", value)
    version = versions.installed_vllm_version()
    on, reason = switch.runner_outlook(version)
    if served is None:  # unset: vLLM's default, by its release line
        line = versions.release(version or "") or (0, 0, 0)
        served = line[:2] < switch.V2_DEFAULT_FOR_EVERY_MODEL
        caveat = line[:2] >= (0, 25) and served
        assert ("vLLM 0.25 picks it for dense and DeepseekV2ForCausalLM models" in reason) is caveat, reason
    assert on is served, reason
    if not on:
        assert "VLLM_USE_V2_MODEL_RUNNER=0 selects the V1 runner" in reason


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


def test_an_invalid_switch_in_the_environment_stops_the_engine_when_vllms_mla_module_loads():
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
        MLA_PREFILL_SHARED_PREFIX="maybe",
    )
    assert proc.returncode != 0
    assert (
        "RuntimeError: mla-prefill-ext: MLA_PREFILL_SHARED_PREFIX='maybe' is not a switch: use "
        "1/true/on or 0/false/off"
    ) in proc.stderr, proc.stderr[-3000:]


def test_parts_are_paused_and_resumed_in_this_process(paused_parts):
    from mla_prefill_ext.hosts.core.shared_prefix.instrumentor import INSTRUMENTOR

    assert not any(switch.paused(p) for p in switch.PARTS)
    assert paused_parts(["hits", "route"]) == ["route", "hits"]  # in the parts' order
    assert switch.paused("route") and switch.paused("hits") and not switch.paused("plan")
    assert INSTRUMENTOR.report()["paused"] == ["route", "hits"]
    # What a part implies: no routing without the plan, no gathering without the hash reuse's record.
    assert paused_parts(["plan"]) == ["plan", "route"]
    assert paused_parts(["hashes"]) == ["hashes", "gather"] and not switch.paused("plan")
    assert paused_parts() == list(switch.PARTS)  # all
    assert paused_parts(()) == [] and not any(switch.paused(p) for p in switch.PARTS)
    with pytest.raises(ValueError, match=r"unknown shared-prefix part\(s\) \['hash'\]: the parts are plan"):
        paused_parts(["hash"])
    assert not any(switch.paused(p) for p in switch.PARTS)  # a refused call changes nothing
