"""The wrappers that make vLLM 0.20's MLA layer own and run its prefill backend."""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Hashable
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
    """use_flashinfer_prefill & co.: vLLM's own prefill paths are never taken where the add-on serves.

    On a platform where vLLM keeps its own prefill (see :mod:`scope`) they answer as stock.
    """
    from mla_prefill_ext.patches.scope import platform_reason

    if platform_reason() is not None and current_explicit_choice() is None:
        return wrapped(*args, **kwargs)
    return False


def current_explicit_choice() -> Any:
    """The user's explicit choice for the engine configuration being built here (or None)."""
    from mla_prefill_ext import settings

    try:
        from vllm.config import get_current_vllm_config_or_none

        config = get_current_vllm_config_or_none()
    except ImportError:
        config = None
    return settings.explicit_choice(getattr(config, "additional_config", None))


def supports_prefill_query_quantization(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> bool:
    """FP8 prefill queries: only where the selected backend takes them (and on SM100)."""
    from vllm.config import get_current_vllm_config_or_none
    from vllm.platforms import current_platform

    from mla_prefill_ext.patches.legacy_flags import backend_for
    from mla_prefill_ext.patches.scope import platform_reason

    if platform_reason() is not None and current_explicit_choice() is None:
        return wrapped(*args, **kwargs)
    vllm_config = get_current_vllm_config_or_none()
    if vllm_config is None or not current_platform.is_device_capability_family(100):
        return False
    return backend_for(vllm_config).supports_fp8_query


def _unavailable_flash_attn(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError(
        "vLLM's FlashAttention prefill path was called although the MLA prefill "
        "backend owns prefill (mla-prefill-ext)"
    )


_LOGGED_STOCK_REASONS: set[str] = set()


def make_impl_init_wrapper(mla_module: ModuleType) -> Any:
    def impl_init(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> None:
        from mla_prefill_ext.patches.scope import stock_reason

        reason = stock_reason(
            instance, mla_module.MLACommonImpl, explicit=current_explicit_choice() is not None
        )
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


_NO_STEP = object()  # no step seen yet: never the identity of a step's prefill metadata


class _StepCell:
    """The last step seen by the layers whose backends share one ``step_key``.

    ``last`` is ``(prefill metadata, the instance its builder prepared for that key)``;
    ``found`` is ``(a builder's runners, the instance for that key in them)``, so that
    the next step of the same builder needs no hashing of the key. Each is one tuple
    replaced whole: the two micro-batch threads of dual-batch overlap may call hooks at
    once and must never see one step's metadata with another's instance.
    """

    __slots__ = ("__weakref__", "found", "last")

    def __init__(self) -> None:
        self.last: tuple[Any, Any] = (_NO_STEP, None)
        self.found: tuple[Any, Any] = (None, None)


# One cell per step_key, shared by the layers with that key (all 61 of DeepSeek-V3), so that
# only the first layer of a step looks its instance up; it lives as long as a layer uses it.
_STEP_CELLS: weakref.WeakValueDictionary[Hashable, _StepCell] = weakref.WeakValueDictionary()
_STEP_CELLS_LOCK = threading.Lock()


def _step_cell(key: Hashable) -> _StepCell:
    with _STEP_CELLS_LOCK:
        cell = _STEP_CELLS.get(key)
        if cell is None:
            cell = _STEP_CELLS[key] = _StepCell()
        return cell


def bind_impl_to_backend(impl: Any) -> None:
    """Route the impl's two prefill hooks to the backend its layer owns.

    The layer sets ``impl.prefill_backend`` right after building the impl. At call
    time the hooks run the instance the metadata builder prepared for this step (one
    per builder and distinct backend parameters, see ``builder_build``); a layer
    whose step was prepared elsewhere (metadata built outside the patched builder)
    prepares its own instance. Backends return unpadded outputs, so 0.20's
    ``_pad_v`` slicing in ``forward_mha`` is switched off.

    Every layer calls these hooks once per step for the new tokens and once per
    context chunk, with the step's one metadata object. The lookup of a step's
    instance is kept with that object in a cell shared by the layers with the same
    ``step_key``: after the first call of a step, a call is one identity check.
    """
    # The backend, hence its key, is only set after this bind (by layer_init, once vLLM's
    # __init__ returned): the key is read at the first call from a builder's step, as before.
    key: list[Hashable] = []
    cell = _StepCell()  # this layer's own until its key is known: never hit

    def runner(prefill: Any) -> Any:
        nonlocal cell
        backend = getattr(impl, "prefill_backend", None)
        if backend is None:
            raise RuntimeError(
                f"{type(impl).__name__} has no MLA prefill backend: it was not built by "
                "an MLAAttention layer patched by mla-prefill-ext"
            )
        runners = getattr(prefill, "mla_prefill_runners", None)
        if runners is not None:
            if not key:
                key.append(backend.step_key)
                cell = _step_cell(key[0])
            seen_runners, prepared = cell.found
            if seen_runners is not runners:  # a builder's runners never change once attached
                prepared = runners.get(key[0])
                cell.found = (runners, prepared)
            if prepared is not None:
                cell.last = (prefill, prepared)
                return prepared
        # Never kept: the layer's own instance is prepared again whenever another step used it.
        if backend._prefill_metadata is not prefill:
            backend.prepare_metadata(prefill)
        return backend

    def run_prefill_new_tokens(prefill: Any, q: Any, k: Any, v: Any, return_softmax_lse: bool) -> Any:
        seen, prepared = cell.last
        if seen is not prefill:
            prepared = runner(prefill)
        return prepared.run_prefill_new_tokens(q, k, v, return_softmax_lse)

    def run_prefill_context_chunk(prefill: Any, chunk_idx: int, q: Any, k: Any, v: Any) -> Any:
        seen, prepared = cell.last
        if seen is not prefill:
            prepared = runner(prefill)
        return prepared.run_prefill_context_chunk(chunk_idx, q, k, v)

    impl._run_prefill_new_tokens = run_prefill_new_tokens
    impl._run_prefill_context_chunk = run_prefill_context_chunk
    impl._pad_v = False


def layer_init(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> None:
    """MLAAttention.__init__: after vLLM's own, build the layer's prefill backend."""
    wrapped(*args, **kwargs)
    from vllm.config import get_current_vllm_config

    from mla_prefill_ext import settings
    from mla_prefill_ext.patches.layers import mla_layer_hyperparameters
    from mla_prefill_ext.patches.legacy_flags import backend_for

    vllm_config = get_current_vllm_config()
    refuse_if_settings_differ(vllm_config)
    layer = instance
    impl = getattr(layer, "impl", None)
    stock = getattr(impl, "_mla_prefill_stock_reason", None)
    if stock is not None:
        layer.prefill_backend = None
        if stock not in _LOGGED_STOCK_REASONS:
            _LOGGED_STOCK_REASONS.add(stock)
            logger.info(
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


def _arg(args: Any, kwargs: Any, name: str, index: int) -> Any:
    return kwargs[name] if name in kwargs else (args[index] if len(args) > index else None)


def builder_init(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> None:
    """MLACommonMetadataBuilder.__init__: its own backend instances, workspaces reserved now.

    Stock vLLM allocates its prefill workspaces here, before the KV cache is sized;
    so does the add-on (``reserve_workspace``). Each builder gets its own instances,
    so the two builders of dual-batch overlap never share per-step state.
    """
    wrapped(*args, **kwargs)
    instance._mla_prefill_layer_names = list(_arg(args, kwargs, "layer_names", 1) or [])
    instance._mla_prefill_runners = None
    _runners(instance)


def _runners(builder: Any) -> dict[Any, Any] | None:
    """One prepared instance per distinct backend parameters among the builder's layers.

    None while the layers are not built yet (resolved again on the next build). Complete
    when attached to the builder and never changed after: the prefill hooks keep what they
    found in it.
    """
    runners = builder._mla_prefill_runners
    if runners is not None:
        return runners
    context = builder.vllm_config.compilation_config.static_forward_context
    layers = [context.get(name) for name in builder._mla_prefill_layer_names]
    if not any(layer is not None for layer in layers):
        return None
    runners = {}
    for layer in layers:
        backend = getattr(layer, "prefill_backend", None)
        if backend is not None and backend.step_key not in runners:
            # Kernels built or loaded now, at engine start, not on a first request (once per process).
            backend.warm_up(builder.device, builder.q_data_type, builder.model_config.dtype)
            runner = backend.clone()
            runner.reserve_workspace(builder.device)
            runners[backend.step_key] = runner
    builder._mla_prefill_runners = runners
    return runners


def builder_build(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    """MLACommonMetadataBuilder.build: prepare this step once, for every layer of the group."""
    metadata = wrapped(*args, **kwargs)
    prefill = getattr(metadata, "prefill", None)
    if prefill is None or not hasattr(instance, "_mla_prefill_layer_names"):
        return metadata
    runners = _runners(instance)
    if not runners:
        return metadata
    common = _arg(args, kwargs, "common_attn_metadata", 1)
    host = getattr(common, "query_start_loc_cpu", None)
    if host is not None:
        # The prefills follow the decodes; vLLM builds the device tensor the same way. A fresh
        # tensor, not a view: vLLM refills its host buffers for the next step while a kernel
        # library may still be copying this step's offsets from them (non-blocking copies).
        start = metadata.num_decodes
        # Pageable, not pinned: pinning them made no measurable difference to FlashInfer's planning
        # on the H200 (docs/benchmarks.md 6b) and would cost an allocation per step.
        prefill.query_start_loc_cpu = host[start:] - host[start]
    prefill.mla_prefill_runners = runners
    for runner in runners.values():
        runner.prepare_metadata(prefill)
    return metadata
