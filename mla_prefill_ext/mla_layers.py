"""Reading vLLM's MLA layers, for both hosts: what the backends need to know about them.

The MLA layer and its module path are the same on every vLLM the add-on serves (0.20's
patch and 0.23+'s bridge), so one reader serves both; each host hands it to a layer's
backend through the base-class hook ``accept_layer_hyperparameters``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import VllmConfig

MLA_MODULE = "vllm.model_executor.layers.attention.mla_attention"


def mla_layer_hyperparameters(
    vllm_config: VllmConfig | None,
) -> dict[str, tuple[float, int, float]]:
    """(sm_scale, window_left, logits_soft_cap) of every MLA layer registered so far.

    The scale is the layer's own ``scale`` (the only scale, as vLLM 0.23+ also hands it to
    its prefill backends); window and soft cap come from the layer's attention
    implementation, as vLLM's FlashInfer prefill reads them. FLASHINFER is handed this
    reader when a layer builds it: backends never import a host.
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
