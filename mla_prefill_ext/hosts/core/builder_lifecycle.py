"""A backend's life cycle when vLLM creates a metadata builder, the same on both hosts.

vLLM 0.20's ``MLACommonMetadataBuilder.__init__`` (patched) and vLLM 0.25+'s builder
(which calls the layer backend's ``clone()``, bridged) both come here: the backend's
kernels are warmed up for the step dtypes the builder hands over, then a clone gets its
workspace, both before vLLM sizes the KV cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from mla_prefill_ext.backends.base import MLAPrefillBackend


def builder_query_dtype(vllm_config: Any, model_dtype: torch.dtype) -> torch.dtype:
    """The prefill query dtype vLLM's metadata builder hands over for ``vllm_config``.

    vLLM's own answer (``MLACommonMetadataBuilder.determine_prefill_query_data_type``: FP8
    with an FP8 KV cache and prefill query quantization, where the prefill backend takes
    it; else the model's dtype), for a host that does not see the builder's ``q_data_type``.
    """
    import sys

    from mla_prefill_ext.mla_layers import MLA_MODULE

    builder = getattr(sys.modules.get(MLA_MODULE), "MLACommonMetadataBuilder", None)
    determine = getattr(builder, "determine_prefill_query_data_type", None)
    return model_dtype if determine is None else determine(vllm_config, model_dtype)


def builder_runner(
    backend: MLAPrefillBackend, device: torch.device, q_data_type: torch.dtype, model_dtype: torch.dtype
) -> MLAPrefillBackend:
    """Warm the backend's kernels up for ``(q_data_type, model_dtype)``, then a clone with its workspace.

    The warm-up runs once per process and configuration (``MLAPrefillBackend.warm_up``);
    the clone is the instance the builder prepares every step.
    """
    backend.warm_up(device, q_data_type, model_dtype)
    runner = backend.clone()
    runner.reserve_workspace(device)
    return runner
