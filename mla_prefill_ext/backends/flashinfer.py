"""FLASHINFER: FlashInfer's ragged-KV prefill (cutlass on SM100, fa3 on SM90)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, cast

import torch

from mla_prefill_ext.backends.base import (
    KernelWarmup,
    MLAPrefillBackend,
    context_chunks,
    host_query_start_loc,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.platforms.interface import DeviceCapability

    from mla_prefill_ext.value_types import LayerHyperparametersReader

# FlashInfer's kernels (fa2, fa3 and the SM100 cutlass FMHA alike) return the LSE
# in base 2; vLLM's merge_attn_states needs natural log.
LN2 = math.log(2.0)

# vLLM's FlashInfer attention backend under VLLM_BATCH_INVARIANT=1: a fixed split size,
# no split-KV, and a larger workspace (vllm/v1/attention/backends/flashinfer.py).
BATCH_INVARIANT_FIXED_SPLIT_SIZE = 4096
BATCH_INVARIANT_WORKSPACE_BYTES = 2048 * 1024 * 1024


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


class FlashInferPrefillBackend(MLAPrefillBackend):
    """FlashInfer ``BatchPrefillWithRaggedKVCacheWrapper``, planned in ``prepare_metadata``.

    Each metadata builder's instance owns a workspace (allocated by
    :meth:`reserve_workspace` when the builder is created, sized as vLLM 0.20 sizes
    its own) and plans once per step from the host copies of the step's offsets: no
    device-to-host read, so vLLM's asynchronous scheduling keeps the CPU ahead.
    The global hyperparameters (softmax scale, window, soft cap) are resolved on the
    first ``prepare_metadata`` (not at construction, when the model's layers are not
    all built yet), then cached, from every MLA layer of the model as
    :attr:`read_layer_hyperparameters` reads them: the host hands that reader in when
    a layer builds its backend (:meth:`accept_layer_hyperparameters`; the host is the
    code that knows vLLM's layers), and :meth:`clone` passes it on. Without one (the
    backend on its own) it plans with its own values. Layers that disagree are an error naming them.
    """

    # Its clone serves a step of shared segments from the prepared metadata alone (checked against
    # vLLM's per-request plan on the H200: docs/benchmarks.md, shared-prefix layer).
    accepts_shared_context_segments: ClassVar[bool] = True

    requires_r1_mla_dimensions: ClassVar[bool] = True
    supports_fp8_query: ClassVar[bool] = True  # the SM100 cutlass kernel takes FP8 q/k/v
    hardware_note: ClassVar[str] = "H200 (SM90, fa3); SM100 (cutlass) unverified on hardware"
    # FlashInfer JIT-compiles a kernel family the first time a plan() needs it (about a minute for
    # fa3 on an H200 host) and loads it from its cache after that: at engine start, not on the
    # first request. One family serves all three variants today (the mask and the LSE are run-time
    # arguments); all three are declared so that a FlashInfer that splits them is covered too.
    kernel_warmup: ClassVar[KernelWarmup] = KernelWarmup(
        note="FlashInfer compiles them on a host's first start (about a minute on an H200) "
        "and loads them from its cache (FLASHINFER_WORKSPACE_BASE) after that"
    )

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
        from vllm.platforms import current_platform

        self.kernel_backend = flashinfer_kernel_backend(current_platform.get_device_capability()) or "fa3"
        import vllm.envs as envs

        self._batch_invariant = bool(envs.VLLM_BATCH_INVARIANT)
        self._global_hyperparameters: GlobalHyperparameters | None = None
        # {layer name: (sm_scale, window_left, logits_soft_cap)} of the model's MLA layers, for a
        # vLLM config; called once, at the first plan.
        self.read_layer_hyperparameters: LayerHyperparametersReader | None = None
        self._workspace: torch.Tensor | None = None
        self._main: Any = None
        self._chunks: list[Any] = []

    def accept_layer_hyperparameters(self, read: LayerHyperparametersReader) -> None:
        self.read_layer_hyperparameters = read

    def clone(self) -> FlashInferPrefillBackend:
        twin = cast(FlashInferPrefillBackend, super().clone())
        twin.read_layer_hyperparameters = self.read_layer_hyperparameters  # the builders' instances too
        return twin

    def _wrapper(self) -> Any:
        from flashinfer import BatchPrefillWithRaggedKVCacheWrapper

        return BatchPrefillWithRaggedKVCacheWrapper(self._workspace, "NHD", backend=self.kernel_backend)

    def reserve_workspace(self, device: torch.device) -> None:
        if self._workspace is None:
            import vllm.envs as envs

            size = envs.VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE  # what vLLM 0.20's MLA builder takes
            if self._batch_invariant:
                size = max(size, BATCH_INVARIANT_WORKSPACE_BYTES)
            self._workspace = torch.empty(size, dtype=torch.uint8, device=device)

    def _resolve_global_hyperparameters(self) -> GlobalHyperparameters:
        if self._global_hyperparameters is not None:
            return self._global_hyperparameters
        read = self.read_layer_hyperparameters
        per_layer = read(self.vllm_config) if read is not None else {}
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
        self.reserve_workspace(prefill_metadata.query_start_loc.device)  # no-op once reserved
        chunks = context_chunks(prefill_metadata)
        if self._main is None:
            self._main = self._wrapper()
        while len(self._chunks) < len(chunks):
            self._chunks.append(self._wrapper())
        qo_indptr = host_query_start_loc(prefill_metadata)  # host copies: plan() syncs on device ones
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
        if self._batch_invariant:
            common["fixed_split_size"] = BATCH_INVARIANT_FIXED_SPLIT_SIZE
            common["disable_split_kv"] = True
        self._main.plan(qo_indptr=qo_indptr, kv_indptr=qo_indptr, causal=True, **common)
        for chunk in chunks:
            self._chunks[chunk.index].plan(
                qo_indptr=qo_indptr, kv_indptr=chunk.cu_seq_lens_cpu, causal=False, **common
            )

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
        ret = self._main.run(q, k, v, return_lse=return_softmax_lse)
        if return_softmax_lse:
            out, lse = ret
            return out, self._natural_lse(lse)
        return ret

    def run_prefill_context_chunk(
        self, chunk_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = self._chunks[chunk_idx].run(q, k, v, return_lse=True)
        return out, self._natural_lse(lse)
