"""FLASH_ATTN: vLLM's bundled FlashAttention varlen kernel (upstream flash-attn where absent)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from mla_prefill_ext.backends.base import MLAPrefillBackend, context_chunks

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.platforms.interface import DeviceCapability


@functools.cache
def _varlen_kernel() -> tuple[Any, bool] | None:
    """(flash_attn_varlen_func, is_vllm_fa), or None when no FlashAttention is installed."""
    from vllm.platforms import current_platform

    if not current_platform.is_rocm():
        try:
            from vllm.vllm_flash_attn import flash_attn_varlen_func

            return flash_attn_varlen_func, True
        except ImportError:
            pass
    try:  # ROCm, or a build without vLLM's FlashAttention: the upstream package
        from flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func, False
    except ImportError:
        return None


def fa3_takes_head_dims(qk_head_dim: int, v_head_dim: int) -> bool:
    """Whether FA3 (Hopper) runs unequal q/k and v head dims natively.

    The ranges are FA3's own check ("If V headdim is different from Q/K dim, we only
    support Q/K headdim in (128, 192] and V headdim in (96, 128], or (Q/K <= 64 and
    V <= 512)"); vLLM 0.20 assumes every MLA shape fits and fails on the others.
    """
    if qk_head_dim == v_head_dim:
        return True
    return (128 < qk_head_dim <= 192 and 96 < v_head_dim <= 128) or (qk_head_dim <= 64 and v_head_dim <= 512)


def widened_v(v: torch.Tensor, pad: int) -> torch.Tensor | None:
    """``v`` seen ``pad`` columns wider on the left, without a copy; None where it cannot be.

    vLLM splits V off kv_b_proj's output right after k_nope (``[k_nope | v]`` per head), so
    the ``pad`` elements before each V row are memory of the same buffer. Handing FA that
    wider view replaces the zero-padded copy of V. Each output column depends only on the
    same column of V, so whatever the extra columns hold stays in output columns the
    backend drops. Needs: V's last dim dense, ``pad`` elements of storage before it, and
    the 16-byte alignment FA3's TMA loads want (base pointer and strides).
    """
    if v.stride(-1) != 1 or v.storage_offset() < pad or v.dim() != 3:
        return None
    item = v.element_size()
    if (v.data_ptr() - pad * item) % 16 or any((s * item) % 16 for s in v.stride()[:-1]):
        return None
    shape = (*v.shape[:-1], v.shape[-1] + pad)
    return v.as_strided(shape, v.stride(), v.storage_offset() - pad)


class FlashAttnPrefillBackend(MLAPrefillBackend):
    """FlashAttention varlen prefill.

    FA3 on Hopper and FA4 take qk head dim 192 with v head dim 128 natively (FA3 only
    within its ranges, see :func:`fa3_takes_head_dims`). FA2 (other architectures, the
    upstream package) and FA3 outside those ranges need equal head dims: V is widened
    to the qk dim (in place where vLLM's layout allows, see :func:`widened_v`, else
    zero-padded) and the output sliced back and made contiguous before it leaves the
    backend, so what the layer merges is never padded.
    """

    # Its clone serves a step of shared segments from the prepared metadata alone (checked against
    # vLLM's per-request plan on the H200: docs/benchmarks.md, shared-prefix layer).
    accepts_shared_context_segments: ClassVar[bool] = True

    hardware_note: ClassVar[str] = "H200 (SM90, FA3)"
    # No warm-up (kernel_warmup stays None): vLLM's wheel (or flash-attn's) ships these kernels
    # compiled, and the library is loaded with vLLM. A variant's first call only loads its
    # function from it (CUDA lazy loading, milliseconds), as in stock vLLM, which runs this kernel.

    @staticmethod
    def get_name() -> str:
        return "FLASH_ATTN"

    @classmethod
    def supports_compute_capability(cls, device_capability: DeviceCapability | None) -> bool:
        return device_capability is not None and device_capability.major >= 8

    @classmethod
    def is_available(cls) -> bool:
        return _varlen_kernel() is not None

    @classmethod
    def unavailable_reason(cls) -> str:
        return "neither vllm.vllm_flash_attn nor the flash-attn package is importable"

    def __init__(
        self,
        num_heads: int,
        scale: float,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        vllm_config: VllmConfig | None,
    ) -> None:
        super().__init__(
            num_heads, scale, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, vllm_config
        )
        kernel = _varlen_kernel()
        if kernel is None:
            raise RuntimeError(f"FLASH_ATTN MLA prefill backend: {self.unavailable_reason()}")
        varlen, self.is_vllm_fa = kernel

        import vllm.envs as envs
        from vllm.platforms import current_platform

        self.fa_version: int | None = None
        if self.is_vllm_fa:
            from vllm.v1.attention.backends.fa_utils import get_flash_attn_version

            self.fa_version = get_flash_attn_version(head_size=self.qk_head_dim)
        self._varlen = (
            functools.partial(varlen, fa_version=self.fa_version) if self.fa_version is not None else varlen
        )
        capability = current_platform.get_device_capability()
        native_diff_headdims = self.fa_version == 4 or (
            self.fa_version == 3
            and capability is not None
            and capability.major == 9
            and fa3_takes_head_dims(self.qk_head_dim, v_head_dim)
        )
        self.requires_v_padding = self.qk_head_dim != v_head_dim and not native_diff_headdims
        # vLLM's kernel names the flag return_softmax_lse, upstream flash-attn return_attn_probs.
        self._lse_flag = "return_softmax_lse" if self.is_vllm_fa else "return_attn_probs"
        # Read once: the environment is fixed for the engine's life, and this is the hot path.
        self._extra: dict[str, Any] = {"num_splits": 1} if envs.VLLM_BATCH_INVARIANT else {}
        self._new_tokens_kwargs: dict[str, Any] = {}
        self._chunk_kwargs: dict[int, dict[str, Any]] = {}

    def prepare_metadata(self, prefill_metadata: Any) -> None:
        super().prepare_metadata(prefill_metadata)
        loc = prefill_metadata.query_start_loc
        self._new_tokens_kwargs = dict(
            cu_seqlens_q=loc,
            cu_seqlens_k=loc,
            max_seqlen_q=prefill_metadata.max_query_len,
            max_seqlen_k=prefill_metadata.max_query_len,
            softmax_scale=self.scale,
            causal=True,
            **self._extra,
        )
        self._chunk_kwargs = {}

    def _context_chunk_kwargs(self, chunk_idx: int) -> dict[str, Any]:
        kwargs = self._chunk_kwargs.get(chunk_idx)
        if kwargs is None:
            chunks = context_chunks(self.prefill_metadata)
            if chunk_idx >= len(chunks):
                raise RuntimeError("FLASH_ATTN: a context chunk ran without chunked_context metadata")
            chunk = chunks[chunk_idx]
            kwargs = dict(
                cu_seqlens_q=chunk.query_start_loc,
                cu_seqlens_k=chunk.cu_seq_lens,
                max_seqlen_q=chunk.max_query_len,
                max_seqlen_k=chunk.max_seq_len,
                softmax_scale=self.scale,
                causal=False,  # the context precedes every new token
                **self._extra,
            )
            self._chunk_kwargs[chunk_idx] = kwargs
        return kwargs

    def _run(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, want_lse: bool, kwargs: dict[str, Any]
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        v_in, keep = v, slice(None)
        if self.requires_v_padding:
            pad = q.shape[-1] - v.shape[-1]
            widened = widened_v(v, pad)
            if widened is not None:
                v_in, keep = widened, slice(pad, None)
            else:
                v_in, keep = torch.nn.functional.pad(v, [0, pad], value=0), slice(None, v.shape[-1])
        ret = self._varlen(q=q, k=k, v=v_in, **kwargs, **{self._lse_flag: want_lse})
        out, lse = (ret[0], ret[1]) if isinstance(ret, tuple) else (ret, None)
        if self.requires_v_padding:
            # Slice here, inside the backend, and keep it dense. A view would save a copy only
            # where a merge follows, and vLLM 0.20's merge_attn_states (CUDA and Triton) reads
            # the suffix with the prefix's head stride: after two or more context chunks the
            # prefix is a dense tensor while this view's heads are qk-wide, so the merge would
            # read the wrong columns. Without a merge, forward_mha's flatten copies a view anyway.
            out = out[..., keep].contiguous()
        if want_lse:
            return out, lse
        return out

    def run_prefill_new_tokens(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, return_softmax_lse: bool
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if not self._new_tokens_kwargs:
            self.prepare_metadata(self.prefill_metadata)
        return self._run(q, k, v, return_softmax_lse, self._new_tokens_kwargs)

    def run_prefill_context_chunk(
        self, chunk_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._run(q, k, v, True, self._context_chunk_kwargs(chunk_idx))  # type: ignore[return-value]
