"""Reading vLLM's MLA layers (both hosts): each layer's scale, window and soft cap, by layer name."""

from __future__ import annotations

from typing import Any

import pytest

from mla_prefill_ext import mla_layers
from mla_prefill_ext.testing import vllm_host as host


def layers_of(cfg: Any, count: int) -> list[Any]:
    """``count`` real MLA layers of ``cfg`` (vLLM registers each in the config's forward context)."""
    with host.gpu_view(None):
        return [
            host.mla_layer(host.build_deepseek_attention(cfg, prefix=f"model.layers.{i}.self_attn"))
            for i in range(count)
        ]


@pytest.fixture
def layer_backend(clean_selection: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """On vLLM 0.23+ each layer asks vLLM's selector for its prefill backend: the add-on's portable one
    here (vLLM's own automatic pick imports its GPU kernels, which a CPU lacks)."""
    from mla_prefill_ext import versions

    if versions.decide().mode == versions.BRIDGE:
        import importlib

        import mla_prefill_ext
        from mla_prefill_ext.hosts import vllm_0_23 as bridge

        clean_selection.setenv("MLA_PREFILL_BACKEND", "TORCH_SDPA")
        mla_prefill_ext.activate()
        importlib.import_module(bridge.PREFILL_PACKAGE)
    return clean_selection


def test_the_module_the_hosts_hook_is_vllms_mla_layer_module():
    import importlib

    module = importlib.import_module(mla_layers.MLA_MODULE)
    assert hasattr(module, "MLAAttention")


def test_no_configuration_has_no_layers():
    assert mla_layers.mla_layer_hyperparameters(None) == {}


def test_every_mla_layer_is_read_by_its_name(layer_backend, model_dirs):
    cfg = host.make_vllm_config(model_dirs["yarn"])
    assert mla_layers.mla_layer_hyperparameters(cfg) == {}  # nothing built yet
    layers = layers_of(cfg, 2)
    found = mla_layers.mla_layer_hyperparameters(cfg)
    assert list(found) == [layer.layer_name for layer in layers]
    # The layer's own scale (YaRN's mscale included), no window, no soft cap.
    assert found[layers[0].layer_name] == (layers[0].scale, -1, 0.0)
    assert layers[0].scale != pytest.approx(192**-0.5)


def test_window_and_soft_cap_come_from_the_layers_implementation(layer_backend, model_dirs):
    cfg = host.make_vllm_config(model_dirs["plain"])
    first, second = layers_of(cfg, 2)
    first.impl.sliding_window = (127, 0)  # vLLM's (left, right) form
    first.impl.logits_soft_cap = 30.0
    second.impl.sliding_window = 63
    second.scale = 0.125
    found = mla_layers.mla_layer_hyperparameters(cfg)
    assert found[first.layer_name] == (first.scale, 127, 30.0)
    assert found[second.layer_name] == (0.125, 63, 0.0)


def test_what_is_not_an_mla_layer_is_skipped(layer_backend, model_dirs):
    cfg = host.make_vllm_config(model_dirs["plain"])
    (layer,) = layers_of(cfg, 1)
    context = cfg.compilation_config.static_forward_context
    context["model.layers.0.mlp"] = object()  # another kind of layer in the same context
    assert list(mla_layers.mla_layer_hyperparameters(cfg)) == [layer.layer_name]
