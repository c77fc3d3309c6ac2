"""Reading vLLM 0.23+'s MLA layers: what a bridged backend needs to know about them."""

from __future__ import annotations

from typing import Any

MLA_MODULE = "vllm.model_executor.layers.attention.mla_attention"


def mla_layer_hyperparameters(vllm_config: Any) -> dict[str, tuple[float, int, float]]:
    """(sm_scale, window_left, logits_soft_cap) of every MLA layer registered so far.

    The scale is the layer's own ``scale`` (the only scale, as vLLM hands it to its
    prefill backends); window and soft cap come from the layer's attention
    implementation, as vLLM's FlashInfer prefill reads them. The bridge's own copy
    of the patch's reader: the two hosts import nothing from each other.
    """
    if vllm_config is None:
        return {}
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    result: dict[str, tuple[float, int, float]] = {}
    for name, layer in vllm_config.compilation_config.static_forward_context.items():
        if not isinstance(layer, MLAAttention):
            continue
        impl = getattr(layer, "impl", None)
        window = getattr(impl, "sliding_window", None)
        window_left = -1 if window is None else int(window[0] if isinstance(window, tuple) else window)
        soft_cap = float(getattr(impl, "logits_soft_cap", None) or 0.0)
        result[name] = (float(layer.scale), window_left, soft_cap)
    return result


def hand_layer_reader(backend: Any) -> None:
    """Hand a layer's backend the reader of the model's layers, as the patch does (a base-class hook)."""
    backend.accept_layer_hyperparameters(mla_layer_hyperparameters)
