"""Which prefill runs: vLLM 0.20's own kernel choices answered, and each layer's calls routed to its backend.

The per-layer hot path lives here (:func:`bind_impl_to_backend`): after the first call
of a step, a prefill call costs one identity check before the backend runs.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Hashable
from typing import Any

from mla_prefill_ext.backend_errors import note_backend_error
from mla_prefill_ext.hosts.core.refusal import explicit_choice
from mla_prefill_ext.hosts.vllm_0_20.scope import platform_reason

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


def prefill_is_ours(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> bool:
    """use_flashinfer_prefill & co.: vLLM's own prefill paths are never taken where the add-on serves.

    On a platform where vLLM keeps its own prefill (see :mod:`scope`) they answer as stock.
    """
    if platform_reason() is not None and explicit_choice() is None:
        return wrapped(*args, **kwargs)
    return False


def supports_prefill_query_quantization(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> bool:
    """FP8 prefill queries: only where the selected backend takes them (and on SM100)."""
    from vllm.config import get_current_vllm_config_or_none
    from vllm.platforms import current_platform

    from mla_prefill_ext.hosts.vllm_0_20.legacy_flags import backend_for

    if platform_reason() is not None and explicit_choice() is None:
        return wrapped(*args, **kwargs)
    vllm_config = get_current_vllm_config_or_none()
    if vllm_config is None or not current_platform.is_device_capability_family(100):
        return False
    return backend_for(vllm_config).supports_fp8_query


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
            try:
                backend.prepare_metadata(prefill)
            except Exception as e:
                note_backend_error(e, backend, "prepare_metadata (the layer's own instance)")
                raise
        return backend

    def run_prefill_new_tokens(prefill: Any, q: Any, k: Any, v: Any, return_softmax_lse: bool) -> Any:
        seen, prepared = cell.last
        if seen is not prefill:
            prepared = runner(prefill)
        try:
            return prepared.run_prefill_new_tokens(q, k, v, return_softmax_lse)
        except Exception as e:  # never caught: named, it stops the engine in vLLM's worker
            note_backend_error(e, prepared, "run_prefill_new_tokens", q=q, k=k, v=v)
            raise

    def run_prefill_context_chunk(prefill: Any, chunk_idx: int, q: Any, k: Any, v: Any) -> Any:
        seen, prepared = cell.last
        if seen is not prefill:
            prepared = runner(prefill)
        try:
            return prepared.run_prefill_context_chunk(chunk_idx, q, k, v)
        except Exception as e:
            note_backend_error(
                e, prepared, f"run_prefill_context_chunk, context chunk {chunk_idx}", q=q, k=k, v=v
            )
            raise

    impl._run_prefill_new_tokens = run_prefill_new_tokens
    impl._run_prefill_context_chunk = run_prefill_context_chunk
    impl._pad_v = False
