"""The metadata builder's side: its own backend instances, workspaces at creation, one preparation a step."""

from __future__ import annotations

from typing import Any

from mla_prefill_ext.backend_errors import note_backend_error
from mla_prefill_ext.hosts.core.builder_lifecycle import builder_runner


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
            runners[backend.step_key] = builder_runner(
                backend, builder.device, builder.q_data_type, builder.model_config.dtype
            )
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
        # on the H200 (docs/results/h200-2026-11-30-speed/README.md, 6b) and would cost an allocation
        # per step.
        prefill.query_start_loc_cpu = host[start:] - host[start]
    prefill.mla_prefill_runners = runners
    for runner in runners.values():
        try:
            runner.prepare_metadata(prefill)
        except Exception as e:  # never caught: named, it stops the engine in vLLM's worker
            note_backend_error(e, runner, "prepare_metadata (the step)")
            raise
    return metadata
