"""TORCH_SDPA: the portable backend, on PyTorch's scaled-dot-product attention.

Runs wherever PyTorch does (CPU, any GPU). V is zero-padded to the qk head dim
on every device, so that PyTorch takes its flash kernel (with unequal head dims
it falls back to the math kernel: about 12 TFLOP/s on an H200, 60x slower than
FA3), and so that the same kernel also returns the softmax LSE (natural log).
Sequences run one at a time: this is the slow, always-available path.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from mla_prefill_ext.backends.base import MLAPrefillBackend, context_chunks, host_query_start_loc


def _flash_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's flash kernel, which also returns the LSE. q/k/v: [1, H, L, D], equal D."""
    if q.device.type == "cuda":
        ret = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    else:
        ret = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return ret[0], ret[1]


def _math_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Explicit float32 attention; the fallback where no flash kernel takes the input."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        lq, lk = s.shape[-2], s.shape[-1]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=s.device).triu(lk - lq + 1)
        s = s.masked_fill(mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)
    return out, lse


class TorchSDPAPrefillBackend(MLAPrefillBackend):
    """Portable MLA prefill on ``torch.nn.functional.scaled_dot_product_attention``."""

    # Its clone serves a step of shared segments from the prepared metadata alone (checked against
    # vLLM's per-request plan on the H200: docs/benchmarks.md, shared-prefix layer).
    accepts_shared_context_segments: ClassVar[bool] = True

    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (
        torch.float16,
        torch.bfloat16,
        torch.float32,
    )
    hardware_note: ClassVar[str] = "CPU (CI); H200 (SM90)"
    # No warm-up (kernel_warmup stays None): PyTorch ships its attention kernels compiled; there is
    # nothing to build, and a first call costs what loading a kernel function costs (milliseconds).

    @staticmethod
    def get_name() -> str:
        return "TORCH_SDPA"

    def prepare_metadata(self, prefill_metadata: Any) -> None:
        super().prepare_metadata(prefill_metadata)
        # Sequence bounds from the host copies: no device read in the step path.
        self._q_bounds = host_query_start_loc(prefill_metadata).tolist()
        self._chunk_bounds = [c.cu_seq_lens_cpu.tolist() for c in context_chunks(prefill_metadata)]

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, want_lse: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One sequence: q [Lq, H, D], k [Lk, H, D], v [Lk, H, Dv] -> [Lq, H, Dv], [H, Lq]."""
        lq, heads, dv = q.shape[0], q.shape[1], v.shape[-1]
        if k.shape[0] == 0:  # a request with no context in this chunk
            out = q.new_zeros(lq, heads, dv)
            return out, q.new_full((heads, lq), float("-inf"), dtype=torch.float32)
        qh, kh = q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0)
        vh = F.pad(v, [0, q.shape[-1] - dv]) if dv != q.shape[-1] else v
        vh = vh.transpose(0, 1).unsqueeze(0)
        lse = None
        if not want_lse:
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, scale=self.scale)
        else:
            try:
                out, lse = _flash_with_lse(qh, kh, vh, causal, self.scale)
            except (RuntimeError, NotImplementedError):  # dtype/shape the flash kernel refuses
                out, lse = _math_with_lse(qh, kh, vh, causal, self.scale)
            lse = lse[0, :, :lq]
        return out[0, :, :, :dv].transpose(0, 1), lse

    def _varlen(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_bounds: list[int],
        k_bounds: list[int],
        causal: bool,
        want_lse: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
        lse = (
            torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
            if want_lse
            else None
        )
        for i in range(len(q_bounds) - 1):
            qs, qe, ks, ke = q_bounds[i], q_bounds[i + 1], k_bounds[i], k_bounds[i + 1]
            if qe == qs:
                continue
            o, l_ = self._attend(q[qs:qe], k[ks:ke], v[ks:ke], causal, want_lse)
            out[qs:qe] = o
            if lse is not None and l_ is not None:
                lse[:, qs:qe] = l_
        return out, lse

    def run_prefill_new_tokens(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, return_softmax_lse: bool
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if not hasattr(self, "_q_bounds"):
            self.prepare_metadata(self.prefill_metadata)
        b = self._q_bounds
        out, lse = self._varlen(q, k, v, b, b, True, return_softmax_lse)
        return (out, lse) if return_softmax_lse else out  # type: ignore[return-value]

    def run_prefill_context_chunk(
        self, chunk_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._chunk_bounds:
            raise RuntimeError("TORCH_SDPA: a context chunk ran without chunked_context metadata")
        out, lse = self._varlen(q, k, v, self._q_bounds, self._chunk_bounds[chunk_idx], False, True)
        assert lse is not None
        return out, lse


__all__ = ["TorchSDPAPrefillBackend"]
