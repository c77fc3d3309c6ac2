"""The wrappers that make vLLM 0.20's MLA layer own and run its prefill backend."""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

from mla_prefill_ext._logging import logger

# vLLM 0.20 announces its own (now bypassed) prefill choice; our selector logs the real one.
_STALE_MESSAGES = frozenset(
    {
        "Using FlashAttention prefill for MLA",
        "Using FlashInfer prefill for MLA",
        "Using CUDNN prefill for MLA",
        "Using TRT-LLM ragged DeepSeek prefill for MLA",
    }
)


class StalePrefillLogFilter(logging.Filter):
    """Drops vLLM's own prefill-kernel announcements, which no longer hold."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg not in _STALE_MESSAGES


def make_explicit_choice_guard(reason: str, refuse: Any) -> Any:
    """MLAAttention.__init__ when the patch could not land: refuse explicit choices only."""

    def guard(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> None:
        refuse(reason)  # raises when the configuration being built asks for a backend
        wrapped(*args, **kwargs)

    return guard


def prefill_is_ours(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> bool:
    """use_flashinfer_prefill & co.: vLLM's own prefill paths are never taken."""
    return False


def supports_prefill_query_quantization(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> bool:
    """FP8 prefill queries: only where the selected backend takes them (and on SM100)."""
    from vllm.config import get_current_vllm_config_or_none
    from vllm.platforms import current_platform

    from mla_prefill_ext.selector import get_mla_prefill_backend

    vllm_config = get_current_vllm_config_or_none()
    if vllm_config is None or not current_platform.is_device_capability_family(100):
        return False
    return get_mla_prefill_backend(vllm_config).supports_fp8_query


def _unavailable_flash_attn(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError(
        "vLLM's FlashAttention prefill path was called although the MLA prefill "
        "backend owns prefill (mla-prefill-ext)"
    )


def make_impl_init_wrapper(mla_module: ModuleType) -> Any:
    def impl_init(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> None:
        # With vLLM's prefill choices answering False, 0.20's __init__ takes its
        # FlashAttention branch, which refuses to build when no FlashAttention is
        # installed (CPU, ROCm without flash-attn) although that branch is dead
        # here: give it a placeholder for the duration of the call.
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


def bind_impl_to_backend(impl: Any) -> None:
    """Route the impl's two prefill hooks to the backend its layer owns.

    The layer sets ``impl.prefill_backend`` right after building the impl; the
    hooks look it up at call time. Backends return unpadded outputs, so 0.20's
    ``_pad_v`` slicing in ``forward_mha`` is switched off.
    """

    def backend_of() -> Any:
        backend = getattr(impl, "prefill_backend", None)
        if backend is None:
            raise RuntimeError(
                f"{type(impl).__name__} has no MLA prefill backend: it was not built by "
                "an MLAAttention layer patched by mla-prefill-ext"
            )
        return backend

    def run_prefill_new_tokens(prefill: Any, q: Any, k: Any, v: Any, return_softmax_lse: bool) -> Any:
        backend = backend_of()
        if backend._prefill_metadata is not prefill:
            backend.prepare_metadata(prefill)  # metadata built outside the patched builder
        return backend.run_prefill_new_tokens(q, k, v, return_softmax_lse)

    def run_prefill_context_chunk(prefill: Any, chunk_idx: int, q: Any, k: Any, v: Any) -> Any:
        backend = backend_of()
        if backend._prefill_metadata is not prefill:
            backend.prepare_metadata(prefill)
        return backend.run_prefill_context_chunk(chunk_idx, q, k, v)

    impl._run_prefill_new_tokens = run_prefill_new_tokens
    impl._run_prefill_context_chunk = run_prefill_context_chunk
    impl._pad_v = False


def layer_init(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> None:
    """MLAAttention.__init__: after vLLM's own, build the layer's prefill backend."""
    wrapped(*args, **kwargs)
    from vllm.config import get_current_vllm_config

    from mla_prefill_ext.selector import get_mla_prefill_backend

    vllm_config = get_current_vllm_config()
    backend_cls = get_mla_prefill_backend(vllm_config)
    layer = instance
    layer.prefill_backend = backend_cls(
        num_heads=layer.num_heads,
        scale=layer.scale,  # the layer's scale is the only scale (YaRN mscale included)
        kv_lora_rank=layer.kv_lora_rank,
        qk_nope_head_dim=layer.qk_nope_head_dim,
        qk_rope_head_dim=layer.qk_rope_head_dim,
        v_head_dim=layer.v_head_dim,
        vllm_config=vllm_config,
    )
    impl = getattr(layer, "impl", None)
    if impl is not None and hasattr(impl, "_run_prefill_new_tokens"):
        impl.prefill_backend = layer.prefill_backend
    logger.debug("MLA layer %s owns %r", getattr(layer, "layer_name", "?"), layer.prefill_backend)


def builder_init(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> None:
    """MLACommonMetadataBuilder.__init__: remember the KV-cache group's layers."""
    wrapped(*args, **kwargs)
    layer_names = kwargs.get("layer_names", args[1] if len(args) > 1 else None)
    instance._mla_prefill_layer_names = list(layer_names or [])
    instance._mla_prefill_backends = None  # resolved on the first build: layers exist by then


def _group_backends(builder: Any) -> list[Any]:
    backends = builder._mla_prefill_backends
    if backends is None:
        context = builder.vllm_config.compilation_config.static_forward_context
        seen: set[int] = set()
        backends = []
        for name in builder._mla_prefill_layer_names:
            backend = getattr(context.get(name), "prefill_backend", None)
            if backend is not None and id(backend) not in seen:
                seen.add(id(backend))
                backends.append(backend)
        builder._mla_prefill_backends = backends
    return backends


def builder_build(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    """MLACommonMetadataBuilder.build: hand the prefill metadata to the group's backends."""
    metadata = wrapped(*args, **kwargs)
    prefill = getattr(metadata, "prefill", None)
    if prefill is not None and hasattr(instance, "_mla_prefill_layer_names"):
        for backend in _group_backends(instance):
            backend.prepare_metadata(prefill)
    return metadata
