"""An out-of-tree MLA prefill backend, packaged: counts its calls, runs the best built-in kernel.

``ExamplePrefillBackend`` delegates each step to the fastest built-in backend that can
serve it: ``FLASH_ATTN`` on a CUDA GPU of compute capability 8.0 or newer (for the dtypes
and dims FlashAttention takes), ``TORCH_SDPA`` everywhere else (a CPU, float32). When the
environment variable ``MLA_PREFILL_EXAMPLE_COUNT_FILE`` names a file, every call appends
one line ``<pid> <kind>`` to it (kind: ``prepare_metadata``, ``new_tokens``,
``context_chunk``), so you can see which processes of vLLM ran it.

The package declares itself in the entry-point group ``mla_prefill_ext.backends`` as
``EXAMPLE``; check that it conforms with::

    from mla_prefill_ext.testing import assert_conformant
    assert_conformant(ExamplePrefillBackend, device="cpu")
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

import torch

from mla_prefill_ext import AutoSelectClaim, MLAPrefillBackend, MLAPrefillBackendEnum

__version__ = "0.1.0"

COUNT_FILE_ENV = "MLA_PREFILL_EXAMPLE_COUNT_FILE"


def _device_capability(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


class ExamplePrefillBackend(MLAPrefillBackend):
    """Counts its calls and runs FLASH_ATTN (CUDA, capability >= 8.0) or TORCH_SDPA."""

    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16, torch.float32)
    hardware_note: ClassVar[str] = "CPU (conformance suite)"

    # Join automatic selection in front of FLASH_ATTN on Hopper and on a CPU (honoured
    # because the package is installed through the entry-point group; an explicit choice
    # by the user still wins).
    auto_select_claim: ClassVar[AutoSelectClaim] = AutoSelectClaim(("9.x", "cpu"), before="FLASH_ATTN")

    @staticmethod
    def get_name() -> str:
        return "EXAMPLE"

    def __init__(
        self,
        num_heads: int,
        scale: float,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        vllm_config: Any,
    ) -> None:
        super().__init__(
            num_heads, scale, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, vllm_config
        )
        self._inners: dict[str, MLAPrefillBackend] = {}
        self.inner: MLAPrefillBackend | None = None
        self._count_file = os.environ.get(COUNT_FILE_ENV)

    def _inner_for(self, device: torch.device, dtype: torch.dtype) -> MLAPrefillBackend:
        """The built-in backend for this step's device and dtype (one instance per kind, kept)."""
        from mla_prefill_ext.selector import MLAPrefillSelectorConfig

        member = MLAPrefillBackendEnum.TORCH_SDPA
        cap = _device_capability(device)
        if cap is not None and cap >= (8, 0):
            from vllm.platforms.interface import DeviceCapability

            flash = MLAPrefillBackendEnum.FLASH_ATTN.get_class()
            config = MLAPrefillSelectorConfig.from_dims(
                dtype, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
            )
            if not flash.validate_configuration(DeviceCapability(*cap), config):
                member = MLAPrefillBackendEnum.FLASH_ATTN
        if member.name not in self._inners:
            self._inners[member.name] = member.get_class()(
                num_heads=self.num_heads,
                scale=self.scale,
                kv_lora_rank=self.kv_lora_rank,
                qk_nope_head_dim=self.qk_nope_head_dim,
                qk_rope_head_dim=self.qk_rope_head_dim,
                v_head_dim=self.v_head_dim,
                vllm_config=self.vllm_config,
            )
        return self._inners[member.name]

    def _record(self, kind: str) -> None:
        if self._count_file:
            with open(self._count_file, "a") as f:
                f.write(f"{os.getpid()} {kind}\n")

    def prepare_metadata(self, prefill_metadata: Any) -> None:
        self._record("prepare_metadata")
        super().prepare_metadata(prefill_metadata)
        dtype = prefill_metadata.q_data_type or prefill_metadata.output_dtype
        self.inner = self._inner_for(prefill_metadata.query_start_loc.device, dtype)
        self.inner.prepare_metadata(prefill_metadata)

    def _prepared(self) -> MLAPrefillBackend:
        if self.inner is None:
            raise RuntimeError(
                "ExamplePrefillBackend: prepare_metadata() was not called before the prefill ran"
            )
        return self.inner

    def run_prefill_new_tokens(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, return_softmax_lse: bool
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        self._record("new_tokens")
        return self._prepared().run_prefill_new_tokens(q, k, v, return_softmax_lse)

    def run_prefill_context_chunk(
        self, chunk_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._record("context_chunk")
        return self._prepared().run_prefill_context_chunk(chunk_idx, q, k, v)


__all__ = ["COUNT_FILE_ENV", "ExamplePrefillBackend"]
