"""TRTLLM_RAGGED: FlashInfer's TensorRT-LLM ragged DeepSeek prefill (SM100, R1 dims).

Unverified on hardware: no machine available to this project has an SM100 GPU.
Its validation and argument plumbing are unit-tested; the kernel call mirrors
vLLM 0.20's ``_run_prefill_*_trtllm_ragged``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

from mla_prefill_ext.backends.base import KernelWarmup, MLAPrefillBackend, context_chunks

if TYPE_CHECKING:
    from vllm.platforms.interface import DeviceCapability


class TrtllmRaggedPrefillBackend(MLAPrefillBackend):
    """``flashinfer.prefill.trtllm_ragged_attention_deepseek`` for Blackwell."""

    requires_r1_mla_dimensions: ClassVar[bool] = True
    supports_fp8_query: ClassVar[bool] = True
    hardware_note: ClassVar[str] = "unverified on hardware (needs SM100)"
    # FlashInfer JIT-builds the TensorRT-LLM runner on its first call and then loads each kernel's
    # cubin as a variant first runs (from flashinfer-cubin, or downloaded into its cache): all at
    # engine start. Unverified on hardware, like the backend.
    kernel_warmup: ClassVar[KernelWarmup] = KernelWarmup(
        note="FlashInfer builds its TensorRT-LLM runner on a host's first start "
        "and loads it from its cache after that"
    )

    @staticmethod
    def get_name() -> str:
        return "TRTLLM_RAGGED"

    @classmethod
    def supports_compute_capability(cls, device_capability: DeviceCapability | None) -> bool:
        return device_capability is not None and device_capability.major == 10

    @classmethod
    def is_available(cls) -> bool:
        try:
            from flashinfer.prefill import trtllm_ragged_attention_deepseek  # noqa: F401
        except ImportError:
            return False
        return True

    @classmethod
    def unavailable_reason(cls) -> str:
        return "flashinfer.prefill.trtllm_ragged_attention_deepseek is not importable"

    _workspace_buffer: torch.Tensor | None = None

    def reserve_workspace(self, device: torch.device) -> None:
        # One per metadata builder, sized and zeroed as vLLM 0.20's builder does for this kernel.
        if self._workspace_buffer is None:
            import vllm.envs as envs

            self._workspace_buffer = torch.zeros(
                envs.VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE, dtype=torch.uint8, device=device
            )

    def prepare_metadata(self, prefill_metadata: Any) -> None:
        super().prepare_metadata(prefill_metadata)
        loc = prefill_metadata.query_start_loc
        self.reserve_workspace(loc.device)  # no-op once reserved
        self._query_seq_lens = loc[1:] - loc[:-1]  # on the device: no host read
        # The chunks' lengths live on the host; copy each once per step, not per layer.
        self._chunk_seq_lens = [
            c.seq_lens.to(loc.device, non_blocking=True) for c in context_chunks(prefill_metadata)
        ]

    def _call(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        seq_lens: torch.Tensor,
        max_kv_len: int,
        cum_seq_lens_kv: torch.Tensor,
        causal: bool,
        return_lse: bool,
    ) -> Any:
        from flashinfer.prefill import trtllm_ragged_attention_deepseek

        m = self.prefill_metadata
        out = torch.empty(q.shape[0], q.shape[1], v.shape[2], device=q.device, dtype=m.output_dtype)
        ret = trtllm_ragged_attention_deepseek(
            query=q,
            key=k,
            value=v,
            workspace_buffer=self._workspace_buffer,
            seq_lens=seq_lens,
            max_q_len=m.max_query_len,
            max_kv_len=max_kv_len,
            bmm1_scale=self.scale,
            bmm2_scale=1.0,
            o_sf_scale=1.0,
            batch_size=seq_lens.shape[0],
            window_left=-1,
            cum_seq_lens_q=m.query_start_loc,
            cum_seq_lens_kv=cum_seq_lens_kv,
            enable_pdl=False,
            is_causal=causal,
            return_lse=return_lse,
            out=out,
        )
        if isinstance(ret, tuple):
            # [tokens, heads] -> [heads, tokens]; natural log, as vLLM 0.20 merges it.
            return ret[0], ret[1].transpose(0, 1).contiguous()
        return ret

    def run_prefill_new_tokens(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, return_softmax_lse: bool
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        m = self.prefill_metadata
        return self._call(
            q,
            k,
            v,
            seq_lens=self._query_seq_lens,
            max_kv_len=m.max_query_len,
            cum_seq_lens_kv=m.query_start_loc,
            causal=True,
            return_lse=return_softmax_lse,
        )

    def run_prefill_context_chunk(
        self, chunk_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        chunks = context_chunks(self.prefill_metadata)
        if chunk_idx >= len(chunks):
            raise RuntimeError("TRTLLM_RAGGED: a context chunk ran without chunked_context metadata")
        chunk = chunks[chunk_idx]
        return self._call(
            q,
            k,
            v,
            seq_lens=self._chunk_seq_lens[chunk_idx],
            max_kv_len=chunk.max_seq_len,
            cum_seq_lens_kv=chunk.cu_seq_lens,
            causal=False,
            return_lse=True,
        )
