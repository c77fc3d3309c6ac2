"""The layer's side: MLAAttention builds and owns its prefill backend, MLACommonImpl runs it."""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

from mla_prefill_ext._logging import log_once, logger
from mla_prefill_ext.hosts.core.refusal import explicit_choice
from mla_prefill_ext.hosts.vllm_0_20.hooks.dispatch import bind_impl_to_backend


def _unavailable_flash_attn(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError(
        "vLLM's FlashAttention prefill path was called although the MLA prefill "
        "backend owns prefill (mla-prefill-ext)"
    )


def make_impl_init_wrapper(mla_module: ModuleType) -> Any:
    """MLACommonImpl.__init__: vLLM's own, then its prefill hooks routed to the layer's backend."""

    def impl_init(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> None:
        from mla_prefill_ext.hosts.vllm_0_20.scope import stock_reason

        reason = stock_reason(instance, mla_module.MLACommonImpl, explicit=explicit_choice() is not None)
        if reason is not None:
            instance._mla_prefill_stock_reason = reason
            wrapped(*args, **kwargs)
            return
        # With vLLM's prefill choices answering False, 0.20's __init__ takes its
        # FlashAttention branch, which refuses to build when no FlashAttention is
        # installed (CPU) although that branch is dead here: give it a placeholder
        # for the duration of the call.
        missing_fa = getattr(mla_module, "flash_attn_varlen_func", None) is None
        if missing_fa:
            mla_module.flash_attn_varlen_func = _unavailable_flash_attn
        try:
            wrapped(*args, **kwargs)
        finally:
            if missing_fa:
                mla_module.flash_attn_varlen_func = None
        bind_impl_to_backend(instance)

    return impl_init


def layer_init(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> None:
    """MLAAttention.__init__: after vLLM's own, build the layer's prefill backend."""
    wrapped(*args, **kwargs)
    from vllm.config import get_current_vllm_config

    from mla_prefill_ext import settings
    from mla_prefill_ext.hosts.vllm_0_20.legacy_flags import backend_for
    from mla_prefill_ext.mla_layers import mla_layer_hyperparameters

    vllm_config = get_current_vllm_config()
    refuse_if_settings_differ(vllm_config)
    layer = instance
    impl = getattr(layer, "impl", None)
    stock = getattr(impl, "_mla_prefill_stock_reason", None)
    if stock is not None:
        layer.prefill_backend = None
        log_once(
            logging.INFO,
            ("stock", stock),
            "mla-prefill-ext leaves vLLM's own MLA prefill in place: %s. Set %s to choose a backend.",
            stock,
            settings.BACKEND_ENV,
        )
        return
    backend_cls = backend_for(vllm_config)
    backend = backend_cls(
        num_heads=layer.num_heads,
        scale=layer.scale,  # the layer's scale is the only scale (YaRN mscale included)
        kv_lora_rank=layer.kv_lora_rank,
        qk_nope_head_dim=layer.qk_nope_head_dim,
        qk_rope_head_dim=layer.qk_rope_head_dim,
        v_head_dim=layer.v_head_dim,
        vllm_config=vllm_config,
    )
    backend.accept_layer_hyperparameters(mla_layer_hyperparameters)  # read at FLASHINFER's first plan
    layer.prefill_backend = backend
    if impl is not None and hasattr(impl, "_run_prefill_new_tokens"):
        impl.prefill_backend = layer.prefill_backend
    logger.debug("MLA layer %s owns %r", getattr(layer, "layer_name", "?"), layer.prefill_backend)


def refuse_if_settings_differ(vllm_config: Any) -> None:
    """Fail at start when this process's settings differ from those the engine was created with."""
    from mla_prefill_ext import settings

    problem = settings.engine_mismatch(getattr(vllm_config, "additional_config", None))
    if problem is not None:
        raise RuntimeError(f"mla-prefill-ext: {problem}.")
