"""layer_host_cost: one MLA layer's host time in a fresh-prefill step, stock vLLM 0.20 and the add-on."""

from __future__ import annotations

import json

import pytest

from mla_prefill_ext import versions
from scripts.bench import layer_host_cost


@pytest.fixture
def on_the_patch(clean_selection):
    if versions.decide().mode != versions.PATCH:
        pytest.skip("the benchmark measures the vLLM 0.20 patch's host")
    clean_selection.setenv("MLA_PREFILL_BACKEND", "FLASH_ATTN")  # restored after the test
    return clean_selection


def test_both_sides_are_timed_and_each_ran_its_own_code(on_the_patch, tmp_path):
    # (no capsys: vLLM's layer building reads sys.stdout's file descriptor)
    out = tmp_path / "layer.json"
    assert layer_host_cost.main(["--rounds", "2", "--calls", "3", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["checked"] == {
        "stock": {"prepared_by_addon": False, "addon_backend_calls": 0},
        "stock:2": {"prepared_by_addon": False, "addon_backend_calls": 0},
        "add-on": {"prepared_by_addon": True, "addon_backend_calls": 1},
    }
    assert set(result["forward_mha_paired_difference"]) == {"add-on", "stock:2"}
    for side in ("stock", "stock:2", "add-on"):
        for part in ("forward_mha", "build"):
            stats = result["results"][side][part]
            assert 0 < stats["p10_us"] <= stats["median_us"] <= stats["p90_us"]
    assert result["args"]["requests"] == 16
    assert result["markdown"][-2].startswith("forward_mha, add-on minus stock per round")
    assert result["markdown"][-1].startswith("forward_mha, stock:2 minus stock per round")


def test_a_run_in_process_leaves_activation_dtype_and_environment_as_they_were(on_the_patch):
    import os

    import torch

    import mla_prefill_ext
    from mla_prefill_ext import activation

    on_the_patch.delenv("MLA_PREFILL_BACKEND")
    for active in (True, False):
        (mla_prefill_ext.activate if active else mla_prefill_ext.deactivate)()
        assert layer_host_cost.main(["--rounds", "1", "--calls", "1"]) == 0
        assert activation.is_active() is active
        assert torch.get_default_dtype() == torch.float32 and "MLA_PREFILL_BACKEND" not in os.environ
    mla_prefill_ext.activate()


def test_a_stock_side_that_runs_the_add_ons_code_stops_the_run(on_the_patch, monkeypatch):
    """The guard: were the add-on never switched off, both sides would time the add-on."""
    import mla_prefill_ext

    monkeypatch.setattr(mla_prefill_ext, "deactivate", lambda: None)
    with pytest.raises(SystemExit, match="did not run the code they name"):
        layer_host_cost.main(["--rounds", "1", "--calls", "1"])


def test_one_new_token_is_refused_it_is_a_decode(capsys):
    with pytest.raises(SystemExit):
        layer_host_cost.main(["--new", "1"])
    assert "at least 2" in capsys.readouterr().err
