"""The MLA prefill backend abstraction every backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any, ClassVar

import torch

# The value types live in value_types (it imports nothing of the add-on); backend authors import
# them from here.
from mla_prefill_ext.value_types import R1_MLA_DIMS, AutoSelectClaim, ContextChunk, KernelWarmup

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.platforms.interface import DeviceCapability

    from mla_prefill_ext.value_types import LayerHyperparametersReader, MLAPrefillSelectorConfig

__all__ = [
    "R1_MLA_DIMS",
    "AutoSelectClaim",
    "ContextChunk",
    "KernelWarmup",
    "MLAPrefillBackend",
    "context_chunks",
    "host_query_start_loc",
]


def host_query_start_loc(prefill_metadata: Any) -> torch.Tensor:
    """The host copy of ``query_start_loc`` (int32, CPU).

    The patched metadata builder attaches it from the host tensors it already has;
    for metadata built elsewhere (tests, benchmarks) it is copied once, with a sync.
    """
    host = getattr(prefill_metadata, "query_start_loc_cpu", None)
    if host is None:
        host = prefill_metadata.query_start_loc.to("cpu")
        prefill_metadata.query_start_loc_cpu = host
    return host


def context_chunks(prefill_metadata: Any) -> list[ContextChunk]:
    """The step's context chunks (empty without cached context); host copies included."""
    chunks = getattr(prefill_metadata, "mla_prefill_context_chunks", None)
    if chunks is not None:
        return chunks
    ctx = prefill_metadata.chunked_context
    chunks = []
    if ctx is not None:
        # seq_lens is [chunks, requests] on the host (vLLM computes it there).
        lens = torch.as_tensor(ctx.seq_lens).to("cpu", torch.int32)
        cu_cpu = torch.zeros(lens.shape[0], lens.shape[1] + 1, dtype=torch.int32)
        torch.cumsum(lens, dim=1, out=cu_cpu[:, 1:])
        for i in range(lens.shape[0]):
            chunks.append(
                ContextChunk(
                    index=i,
                    query_start_loc=prefill_metadata.query_start_loc,
                    max_query_len=prefill_metadata.max_query_len,
                    cu_seq_lens=ctx.cu_seq_lens[i],
                    cu_seq_lens_cpu=cu_cpu[i],
                    max_seq_len=int(ctx.max_seq_lens[i]),
                    seq_lens=lens[i],
                )
            )
    prefill_metadata.mla_prefill_context_chunks = chunks
    return chunks


class MLAPrefillBackend(ABC):
    """One MLA prefill attention kernel, owned by one MLA attention layer.

    Prefill in MLA runs ordinary multi-head attention on decompressed keys and
    values. Every backend holds these conventions, so the layer can merge its
    results with vLLM's ``merge_attn_states``:

    * ``q`` and ``k``: ``[tokens, num_heads, qk_nope_head_dim + qk_rope_head_dim]``.
    * ``v``: ``[tokens, num_heads, v_head_dim]``.
    * output: ``[tokens, num_heads, v_head_dim]`` (never padded: a backend that pads
      V for its kernel slices the output back before returning it) and contiguous:
      vLLM 0.20's ``merge_attn_states`` reads both of its inputs with one head stride.
    * LSE: ``[num_heads, tokens]``, ``float32``, natural log (``merge_attn_states``
      uses ``exp``; FlashInfer's base-2 LSE is converted).
    * The softmax scale is ``self.scale``: the owning layer's ``scale``, nothing
      else (for DeepSeek-V2/V3 it includes the YaRN mscale the model computes).

    Life cycle: each MLA layer builds its backend once, with its own ``scale`` and
    dims. Each vLLM metadata builder (one per KV-cache group, one more per micro-batch
    with dual-batch overlap) makes one :meth:`clone` per distinct set of those
    parameters, calls :meth:`reserve_workspace` on it at once (before vLLM sizes the
    KV cache; :meth:`warm_up` runs just before, once per process and configuration,
    see :class:`KernelWarmup`), and per step calls :meth:`prepare_metadata` on it once with vLLM's
    ``MLACommonPrefillMetadata``. Every layer whose parameters are equal runs on that
    prepared instance: :meth:`run_prefill_new_tokens` (causal attention among the
    new tokens) and, when requests have cached context,
    :meth:`run_prefill_context_chunk` once per context chunk (non-causal attention of
    the new tokens over that chunk). So per-step work in ``prepare_metadata`` runs
    once per step, whatever the number of layers, and never mixes micro-batches.

    The prefill metadata a backend may read: ``query_start_loc`` (int32
    ``[num_prefills + 1]`` on the device) and its host copy
    :func:`host_query_start_loc`, ``max_query_len``, ``q_data_type``,
    ``output_dtype``, and the context chunks through :func:`context_chunks`. Never
    read a device tensor on the host in the step path (``.item()``, ``.tolist()``,
    ``.cpu()``): it stalls the CPU until the GPU catches up.
    """

    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16)
    """Model dtypes the kernel takes."""

    requires_r1_mla_dimensions: ClassVar[bool] = False
    """True when the kernel only takes DeepSeek-R1 dims (qk_nope 128, qk_rope 64, v 128)."""

    supports_fp8_query: ClassVar[bool] = False
    """True when the kernel takes an FP8 query (vLLM's prefill query quantization)."""

    hardware_note: ClassVar[str] = ""
    """Where the backend has been verified on real hardware (for the docs table)."""

    auto_select_claim: ClassVar[AutoSelectClaim | dict[str, Any] | None] = None
    """Out-of-tree backends: where to join automatic selection (see :class:`AutoSelectClaim`)."""

    kernel_warmup: ClassVar[KernelWarmup | None] = None
    """What to build or load at engine start (see :class:`KernelWarmup`); None: nothing."""

    accepts_shared_context_segments: ClassVar[bool] = False
    """True when a :meth:`clone`, prepared with a step whose "requests" are shared prefixes (each
    one query sequence of several requests' new tokens against one key sequence), computes that
    step's context chunks from the prepared metadata alone; False keeps vLLM's per-request chunks."""

    @staticmethod
    @abstractmethod
    def get_name() -> str:
        """The name users select the backend by (built-ins: the enum member name)."""

    @classmethod
    def supports_compute_capability(cls, device_capability: DeviceCapability | None) -> bool:
        """Whether the kernel runs on a device of this capability (None: no GPU)."""
        return True

    @classmethod
    def supports_dtype(cls, dtype: torch.dtype) -> bool:
        return dtype in cls.supported_dtypes

    @classmethod
    def is_available(cls) -> bool:
        """Whether the kernel's library can be imported in this process."""
        return True

    @classmethod
    def unavailable_reason(cls) -> str:
        """What is missing when :meth:`is_available` is False."""
        return "required kernel library is not importable"

    @classmethod
    def validate_configuration(
        cls,
        device_capability: DeviceCapability | None,
        selector_config: MLAPrefillSelectorConfig,
    ) -> list[str]:
        """Every reason this backend cannot serve; empty when it can."""
        reasons: list[str] = []
        if not cls.supports_compute_capability(device_capability):
            reasons.append(
                "needs a GPU (this is a CPU or a platform that reports no compute capability)"
                if device_capability is None
                else f"compute capability {device_capability.major}.{device_capability.minor} not supported"
            )
        if not cls.supports_dtype(selector_config.dtype):
            names = ", ".join(str(d).removeprefix("torch.") for d in cls.supported_dtypes)
            reasons.append(
                f"dtype {str(selector_config.dtype).removeprefix('torch.')} not supported (supports {names})"
            )
        if not cls.is_available():
            reasons.append(cls.unavailable_reason())
        if cls.requires_r1_mla_dimensions and not selector_config.is_r1_compatible:
            reasons.append(
                "model does not have DeepSeek-R1 MLA dimensions "
                "(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)"
            )
        return reasons

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
        self.num_heads = num_heads
        self.scale = float(scale)
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.vllm_config = vllm_config
        self._prefill_metadata: Any = None
        self._init_kwargs = dict(
            num_heads=num_heads,
            scale=scale,
            kv_lora_rank=kv_lora_rank,
            qk_nope_head_dim=qk_nope_head_dim,
            qk_rope_head_dim=qk_rope_head_dim,
            v_head_dim=v_head_dim,
            vllm_config=vllm_config,
        )

    def clone(self) -> MLAPrefillBackend:
        """A fresh instance with the same parameters (as upstream vLLM 0.25+)."""
        return type(self)(**self._init_kwargs)

    @property
    def step_key(self) -> Hashable:
        """Instances with equal keys compute the same attention: one can run for all."""
        kw = self._init_kwargs
        return (
            type(self),
            kw["num_heads"],
            float(kw["scale"]),
            kw["kv_lora_rank"],
            kw["qk_nope_head_dim"],
            kw["qk_rope_head_dim"],
            kw["v_head_dim"],
            id(kw["vllm_config"]),
        )

    def accept_layer_hyperparameters(self, read: LayerHyperparametersReader) -> None:
        """Receive the host's reader of the model's MLA layers (default: not needed).

        The host (the code that knows vLLM's layers) calls it on each layer's backend right
        after building it. A backend that plans with hyperparameters shared by every layer
        (FLASHINFER) keeps ``read`` and calls it once the model's layers are all built; a
        backend never imports the host to find them.
        """
        return None

    def reserve_workspace(self, device: torch.device) -> None:
        """Allocate what every step needs (kernel workspaces), once.

        Called on each builder's instance when vLLM creates the metadata builder, as
        vLLM 0.20 allocates its own prefill workspaces, so that the memory is taken
        before the KV cache is sized. Default: nothing to allocate.
        """
        return None

    def warm_up(
        self, device: torch.device, q_data_type: torch.dtype, output_dtype: torch.dtype
    ) -> float | None:
        """Run the declared :attr:`kernel_warmup` once per process and configuration.

        The host calls this when vLLM creates a metadata builder (engine start, before the
        KV cache is allocated), with the step dtypes the builder will hand over. It runs a
        :meth:`clone` through a small synthetic step (:meth:`reserve_workspace`,
        :meth:`prepare_metadata`, then each flagged run method) and drops it: results are
        discarded and nothing is left on this instance or on any other. Returns the seconds
        it took, or None when nothing ran (nothing declared, or this configuration warmed
        up already in this process).
        """
        # Here, not at the top: warmup logs through vLLM's logger, and the base class loads without vLLM.
        from mla_prefill_ext.backends.warmup import warm_up_once

        return warm_up_once(self, torch.device(device), q_data_type, output_dtype)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def prefill_metadata(self) -> Any:
        """The prefill metadata of the current step (set by :meth:`prepare_metadata`)."""
        if self._prefill_metadata is None:
            raise RuntimeError(
                f"{type(self).__name__}: prepare_metadata() was not called before the prefill ran"
            )
        return self._prefill_metadata

    def prepare_metadata(self, prefill_metadata: Any) -> None:
        """Take this step's prefill metadata; do per-step work once here, not per call."""
        self._prefill_metadata = prefill_metadata

    @abstractmethod
    def run_prefill_new_tokens(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        return_softmax_lse: bool,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Causal attention among the new tokens: output, or (output, LSE)."""

    @abstractmethod
    def run_prefill_context_chunk(
        self,
        chunk_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Non-causal attention of the new tokens over context chunk ``chunk_idx``."""

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_heads={self.num_heads}, scale={self.scale:.6g}, "
            f"qk={self.qk_nope_head_dim}+{self.qk_rope_head_dim}, v={self.v_head_dim})"
        )
