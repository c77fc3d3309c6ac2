"""Reading vLLM's MLA layers: what the backends need to know about them."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import VllmConfig

MLA_MODULE = "vllm.model_executor.layers.attention.mla_attention"


def mla_layer_hyperparameters(
    vllm_config: VllmConfig | None,
) -> dict[str, tuple[float, int, float]]:
    """(sm_scale, window_left, logits_soft_cap) of every MLA layer registered so far.

    The scale is the layer's own ``scale`` (the only scale); window and soft cap
    come from the layer's attention implementation, as vLLM 0.20 reads them.
    FLASHINFER is handed this reader when a layer builds it (``wrappers.layer_init``):
    backends never import the patch.
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
