"""Backend warm-up at engine start: the declared kernel variants run once per process and configuration."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple, Protocol

import torch

from mla_prefill_ext._logging import logger
from mla_prefill_ext.value_types import ContextChunk, KernelWarmup

# The synthetic step: two requests, new tokens over one context chunk. Small, so that the
# warm-up costs what building or loading the kernels costs and nothing more.
NEW_TOKENS = (16, 8)
CONTEXT_TOKENS = (32, 16)

_VARIANT_WORDS = {
    "new_tokens": "new tokens",
    "new_tokens_lse": "new tokens with LSE",
    "context_chunk": "context chunks",
}


class WarmupRecord(NamedTuple):
    """One warm-up this process ran: what, for which configuration, and how long it took."""

    backend: str
    variants: tuple[str, ...]
    num_heads: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_data_type: str
    output_dtype: str
    device: str
    seconds: float


# Configuration -> its record. Module state on purpose: "once per process" is its job. A lock,
# not just the dict: a second caller (another builder of the same process) waits for the first.
_DONE: dict[tuple, WarmupRecord] = {}
_LOCK = threading.RLock()


def completed() -> list[WarmupRecord]:
    """The warm-ups this process ran, in order."""
    with _LOCK:
        return list(_DONE.values())


@dataclass
class WarmupPrefillMetadata:
    """A prefill step's metadata as a backend may read it (the fields ``MLAPrefillBackend`` documents).

    The host copies and the context chunks are attached, as the patched builder attaches
    them, so ``host_query_start_loc`` and ``context_chunks`` never reach for vLLM's own fields.
    """

    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    max_query_len: int
    q_data_type: torch.dtype
    output_dtype: torch.dtype
    mla_prefill_context_chunks: list[ContextChunk] = field(default_factory=list)
    chunked_context: None = None


@dataclass
class WarmupStep:
    """Inputs of the synthetic step, laid out as vLLM's ``forward_mha`` hands them over."""

    metadata: WarmupPrefillMetadata
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    chunk_k: torch.Tensor
    chunk_v: torch.Tensor


class WarmableBackend(Protocol):
    """What a warm-up uses of a backend: ``MLAPrefillBackend`` has it. Named here, not imported from
    ``base``, so that the base class can depend on this module without either knowing the other."""

    kernel_warmup: ClassVar[KernelWarmup | None]
    num_heads: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int: ...
    @staticmethod
    def get_name() -> str: ...
    @classmethod
    def supports_compute_capability(cls, device_capability: Any) -> bool: ...
    def clone(self) -> WarmableBackend: ...
    def reserve_workspace(self, device: torch.device) -> None: ...
    def prepare_metadata(self, prefill_metadata: Any) -> None: ...
    def run_prefill_new_tokens(self, q: Any, k: Any, v: Any, return_softmax_lse: bool) -> Any: ...
    def run_prefill_context_chunk(self, chunk_idx: int, q: Any, k: Any, v: Any) -> Any: ...


def _offsets(lengths: tuple[int, ...]) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)  # vLLM's offsets are int32
    torch.cumsum(torch.tensor(lengths, dtype=torch.int32), dim=0, out=out[1:])
    return out


def synthetic_step(
    backend: WarmableBackend, device: torch.device, q_data_type: torch.dtype, output_dtype: torch.dtype
) -> WarmupStep:
    """New tokens of two requests over one context chunk, in the backend's head configuration.

    Zeros: the values do not matter (the results are dropped), and zeros are valid in every
    dtype a backend may get, FP8 included. V is the tail of ``[k_nope | v]`` rows, as vLLM
    splits it off ``kv_b_proj``'s output.
    """
    heads, nope, qk, dv = backend.num_heads, backend.qk_nope_head_dim, backend.qk_head_dim, backend.v_head_dim
    loc_cpu, cu_cpu = _offsets(NEW_TOKENS), _offsets(CONTEXT_TOKENS)
    loc, cu = loc_cpu.to(device), cu_cpu.to(device)

    def qk_rows(tokens: int) -> torch.Tensor:
        return torch.zeros(tokens, heads, qk, dtype=q_data_type, device=device)

    def v_view(tokens: int) -> torch.Tensor:
        return torch.zeros(tokens, heads, nope + dv, dtype=q_data_type, device=device)[..., nope:]

    chunk = ContextChunk(
        index=0,
        query_start_loc=loc,
        max_query_len=max(NEW_TOKENS),
        cu_seq_lens=cu,
        cu_seq_lens_cpu=cu_cpu,
        max_seq_len=max(CONTEXT_TOKENS),
        seq_lens=torch.tensor(CONTEXT_TOKENS, dtype=torch.int32),
    )
    metadata = WarmupPrefillMetadata(
        query_start_loc=loc,
        query_start_loc_cpu=loc_cpu,
        max_query_len=max(NEW_TOKENS),
        q_data_type=q_data_type,
        output_dtype=output_dtype,
        mla_prefill_context_chunks=[chunk],
    )
    new, ctx = sum(NEW_TOKENS), sum(CONTEXT_TOKENS)
    return WarmupStep(metadata, qk_rows(new), qk_rows(new), v_view(new), qk_rows(ctx), v_view(ctx))


def run_variants(
    probe: WarmableBackend,
    spec: KernelWarmup,
    device: torch.device,
    q_data_type: torch.dtype,
    output_dtype: torch.dtype,
) -> None:
    """One synthetic step through ``probe``'s own methods, as the patched builder and layers call them."""
    with torch.inference_mode():
        step = synthetic_step(probe, device, q_data_type, output_dtype)
        probe.reserve_workspace(device)
        probe.prepare_metadata(step.metadata)
        if spec.new_tokens:
            probe.run_prefill_new_tokens(step.q, step.k, step.v, False)
        if spec.new_tokens_lse:
            probe.run_prefill_new_tokens(step.q, step.k, step.v, True)
        if spec.context_chunk:
            probe.run_prefill_context_chunk(0, step.q, step.chunk_k, step.chunk_v)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the time logged is the kernels' too, not just their launch


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def warm_up_once(
    backend: WarmableBackend, device: torch.device, q_data_type: torch.dtype, output_dtype: torch.dtype
) -> float | None:
    """``MLAPrefillBackend.warm_up``: see there. Seconds taken, or None when nothing ran."""
    spec = type(backend).kernel_warmup
    if spec is None or not spec.variants:
        return None
    if device.type == "cpu" and not type(backend).supports_compute_capability(None):
        # Only a test builds a GPU-only backend's builder on the CPU; no step of it can run there.
        logger.debug("%s: no warm-up on the CPU (the backend needs a GPU)", backend.get_name())
        return None
    key = (
        type(backend),
        backend.num_heads,
        backend.qk_nope_head_dim,
        backend.qk_rope_head_dim,
        backend.v_head_dim,
        q_data_type,
        output_dtype,
        str(device),
    )
    name = backend.get_name()
    with _LOCK:
        if key in _DONE:
            return None
        # Always at INFO, before and after: the first line has to come before the wait, when its
        # length is unknown (a build on a host's first start, a cache load afterwards), and the
        # duration in the second tells an operator which of the two happened.
        logger.info(
            "%s: building or loading the MLA prefill kernels for this host before the engine serves "
            "(%s; %s, %d heads, qk %d+%d, v %d)%s",
            name,
            ", ".join(_VARIANT_WORDS[v] for v in spec.variants),
            _dtype_name(q_data_type),
            backend.num_heads,
            backend.qk_nope_head_dim,
            backend.qk_rope_head_dim,
            backend.v_head_dim,
            f"; {spec.note}" if spec.note else "",
        )
        start = time.perf_counter()
        try:
            run_variants(backend.clone(), spec, device, q_data_type, output_dtype)
        except Exception:
            logger.error(
                "%s: warming up its MLA prefill kernels failed; its first prefill would fail the same "
                "way, so the engine stops here",
                name,
            )
            raise
        seconds = time.perf_counter() - start
        _DONE[key] = WarmupRecord(
            name,
            spec.variants,
            backend.num_heads,
            backend.qk_nope_head_dim,
            backend.qk_rope_head_dim,
            backend.v_head_dim,
            _dtype_name(q_data_type),
            _dtype_name(output_dtype),
            str(device),
            seconds,
        )
    logger.info("%s: MLA prefill kernels ready in %.1f s", name, seconds)
    return seconds
