"""FLASHINFER: FlashInfer's ragged-KV prefill (cutlass on SM100, fa3 on SM90)."""

from __future__ import annotations

import math
import weakref
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import torch

from mla_prefill_ext.backends.base import MLAPrefillBackend

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.platforms.interface import DeviceCapability

# FlashInfer's kernels (fa2, fa3 and the SM100 cutlass FMHA alike) return the LSE
# in base 2; vLLM's merge_attn_states needs natural log.
LN2 = math.log(2.0)


class GlobalHyperparameters(NamedTuple):
    """What FlashInfer plans with, shared by every MLA layer of the model."""

    sm_scale: float
    window_left: int
    logits_soft_cap: float


def flashinfer_kernel_backend(device_capability: DeviceCapability | None) -> str | None:
    """FlashInfer's kernel family for MLA prefill on this device (None: unsupported)."""
    if device_capability is None:
        return None
    if device_capability.major == 10:
        return "cutlass"  # what vLLM 0.20 uses on Blackwell
    if device_capability.major == 9:
        return "fa3"  # Hopper: not offered by vLLM 0.20; bit-identical to FA3 on the H200
    return None


class _SharedPlan:
    """Wrappers and workspace shared by the FlashInfer backends of one model.

    Every MLA layer owns a backend, but the plan depends only on the step's
    metadata and the (global) hyperparameters, so it is made once per step and
    shared, as vLLM 0.20's metadata builder did.
    """

    def __init__(self, kernel_backend: str) -> None:
        self.kernel_backend = kernel_backend
        self.workspace: torch.Tensor | None = None
        self.main: Any = None
        self.chunks: list[Any] = []
        self.planned_for: Any = None

    def _wrapper(self) -> Any:
        from flashinfer import BatchPrefillWithRaggedKVCacheWrapper

        assert self.workspace is not None
        return BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD", backend=self.kernel_backend)

    def ensure(self, device: torch.device, num_chunks: int) -> None:
        if self.workspace is None:
            import vllm.envs as envs

            self.workspace = torch.empty(
                envs.VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE, dtype=torch.uint8, device=device
            )
            self.main = self._wrapper()
        while len(self.chunks) < num_chunks:
            self.chunks.append(self._wrapper())


_SHARED_PLANS: weakref.WeakValueDictionary[tuple, _SharedPlan] = weakref.WeakValueDictionary()


class FlashInferPrefillBackend(MLAPrefillBackend):
    """FlashInfer ``BatchPrefillWithRaggedKVCacheWrapper``, planned in ``prepare_metadata``.

    The global hyperparameters (softmax scale, window, soft cap) are resolved on the
    first ``prepare_metadata`` from the MLA layers registered in the static forward
    context (not at construction, when the model's layers are not all built yet),
    then cached. Layers that disagree are an error naming them.
    """

    requires_r1_mla_dimensions: ClassVar[bool] = True
    supports_fp8_query: ClassVar[bool] = True  # the SM100 cutlass kernel takes FP8 q/k/v
    hardware_note: ClassVar[str] = "H200 (SM90, fa3); SM100 (cutlass) unverified on hardware"

    @staticmethod
    def get_name() -> str:
        return "FLASHINFER"

    @classmethod
    def supports_compute_capability(cls, device_capability: DeviceCapability | None) -> bool:
        return flashinfer_kernel_backend(device_capability) is not None

    @classmethod
    def is_available(cls) -> bool:
        from vllm.platforms import current_platform

        if current_platform.is_rocm():
            return False
        try:
            from flashinfer import BatchPrefillWithRaggedKVCacheWrapper  # noqa: F401
        except ImportError:
            return False
        return True

    @classmethod
    def unavailable_reason(cls) -> str:
        return "flashinfer (BatchPrefillWithRaggedKVCacheWrapper) is not importable on this platform"

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
        from mla_prefill_ext.selector import current_device_capability

        kernel_backend = flashinfer_kernel_backend(current_device_capability()) or "fa3"
        key = (id(vllm_config), kernel_backend, num_heads, self.qk_head_dim, v_head_dim)
        shared = _SHARED_PLANS.get(key)
        if shared is None:
            shared = _SharedPlan(kernel_backend)
            _SHARED_PLANS[key] = shared
        self._shared = shared  # strong reference keeps the shared plan alive
        self._global_hyperparameters: GlobalHyperparameters | None = None

    @property
    def kernel_backend(self) -> str:
        return self._shared.kernel_backend

    def _resolve_global_hyperparameters(self) -> GlobalHyperparameters:
        if self._global_hyperparameters is not None:
            return self._global_hyperparameters
        from mla_prefill_ext.patches.layers import mla_layer_hyperparameters

        per_layer = mla_layer_hyperparameters(self.vllm_config)
        if not per_layer:
            # Used on its own (no model built): this backend's own values.
            resolved = GlobalHyperparameters(self.scale, -1, 0.0)
        else:
            distinct: dict[GlobalHyperparameters, list[str]] = {}
            for name, params in per_layer.items():
                distinct.setdefault(GlobalHyperparameters(*params), []).append(name)
            if len(distinct) > 1:
                detail = "; ".join(f"{p} in {', '.join(names)}" for p, names in distinct.items())
                raise ValueError(
                    "FLASHINFER MLA prefill plans one (sm_scale, window_left, "
                    "logits_soft_cap) for all MLA layers, but the layers disagree: "
                    f"{detail}. Choose another MLA prefill backend (e.g. FLASH_ATTN)."
                )
            (resolved,) = distinct
        self._global_hyperparameters = resolved
        return resolved

    def prepare_metadata(self, prefill_metadata: Any) -> None:
        super().prepare_metadata(prefill_metadata)
        hp = self._resolve_global_hyperparameters()
        shared = self._shared
        if shared.planned_for is prefill_metadata:
            return  # another layer's backend planned this step already
        ctx = prefill_metadata.chunked_context
        num_chunks = 0 if ctx is None else int(ctx.cu_seq_lens.shape[0])
        qo_indptr = prefill_metadata.query_start_loc
        shared.ensure(qo_indptr.device, num_chunks)
        q_dtype = prefill_metadata.q_data_type or prefill_metadata.output_dtype
        common = dict(
            num_qo_heads=self.num_heads,
            num_kv_heads=self.num_heads,  # decompressed MLA: one K/V head per query head
            head_dim_qk=self.qk_head_dim,
            head_dim_vo=self.v_head_dim,
            sm_scale=hp.sm_scale,
            window_left=hp.window_left,
            logits_soft_cap=hp.logits_soft_cap,
            q_data_type=q_dtype,
            o_data_type=prefill_metadata.output_dtype,
        )
        shared.main.plan(qo_indptr=qo_indptr, kv_indptr=qo_indptr.clone(), causal=True, **common)
        for i in range(num_chunks):
            shared.chunks[i].plan(qo_indptr=qo_indptr, kv_indptr=ctx.cu_seq_lens[i], causal=False, **common)
        shared.planned_for = prefill_metadata

    @staticmethod
    def _natural_lse(lse: torch.Tensor) -> torch.Tensor:
        # [tokens, heads] base 2 -> [heads, tokens] natural log, dense for merge_attn_states.
        # Scaling the transposed view straight into a dense buffer is one kernel; scaling
        # then .contiguous() was two, which showed on small context chunks (host-bound).
        out = torch.empty((lse.shape[1], lse.shape[0]), dtype=lse.dtype, device=lse.device)
        return torch.mul(lse.t(), LN2, out=out)

    def run_prefill_new_tokens(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, return_softmax_lse: bool
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self._shared.planned_for is not self.prefill_metadata:
            self.prepare_metadata(self.prefill_metadata)
        ret = self._shared.main.run(q, k, v, return_lse=return_softmax_lse)
        if return_softmax_lse:
            out, lse = ret
            return out, self._natural_lse(lse)
        return ret

    def run_prefill_context_chunk(
        self, chunk_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._shared.planned_for is not self.prefill_metadata:
            self.prepare_metadata(self.prefill_metadata)
        out, lse = self._shared.chunks[chunk_idx].run(q, k, v, return_lse=True)
        return out, self._natural_lse(lse)
