"""The values backends, selector and hosts share: selector config, MLA dims, context chunks,
warm-up declarations, auto-selection claims.

It imports nothing of the add-on (not even for type hints) and vLLM or PyTorch only for type hints,
so that every module can depend on it: a backend is chosen (``backends/`` reads these types), it does not
choose (it never imports the selector). ``Selection`` names a backend class, so it lives with
the selector.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from enum import Enum
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch
    from vllm.platforms.interface import DeviceCapability


class MLADims(NamedTuple):
    """The head dims of an MLA model's prefill attention."""

    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


R1_MLA_DIMS = MLADims(128, 64, 128)
"""DeepSeek-R1/V3 MLA dims: (qk_nope_head_dim, qk_rope_head_dim, v_head_dim)."""


LayerHyperparametersReader = Callable[[Any], Mapping[str, tuple[float, int, float]]]
"""Reads {layer name: (sm_scale, window_left, logits_soft_cap)} of a model's MLA layers from its
vLLM config: what the host hands a backend (``MLAPrefillBackend.accept_layer_hyperparameters``)."""


class MLAPrefillSelectorConfig(NamedTuple):
    """The model facts backend selection depends on, in hashable form."""

    dtype: torch.dtype
    is_r1_compatible: bool

    @classmethod
    def from_dims(
        cls, dtype: torch.dtype, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int
    ) -> MLAPrefillSelectorConfig:
        dims = (qk_nope_head_dim, qk_rope_head_dim, v_head_dim)
        return cls(dtype=dtype, is_r1_compatible=dims == R1_MLA_DIMS)


class Automatic(str, Enum):
    """The source of a selection that no setting asked for: by device and model.

    A ``str`` whose value is ``"automatic"``, so that diagnostics print and serialise it
    as before; code compares by identity (``source is AUTOMATIC``).
    """

    AUTOMATIC = "automatic"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


AUTOMATIC = Automatic.AUTOMATIC


class ContextChunk(NamedTuple):
    """One context chunk of a prefill step, named as upstream vLLM (0.29+) names it.

    ``cu_seq_lens_cpu`` is the host copy of ``cu_seq_lens``: plan from it, never from
    the device tensor (reading a device tensor on the host stalls the CPU).
    """

    index: int
    query_start_loc: torch.Tensor
    max_query_len: int
    cu_seq_lens: torch.Tensor
    cu_seq_lens_cpu: torch.Tensor
    max_seq_len: int
    seq_lens: torch.Tensor


class AutoSelectClaim(NamedTuple):
    """Where an out-of-tree backend asks to join automatic selection.

    ``capabilities``: where the claim holds: ``"9.0"`` (exact), ``"9.x"`` (a major
    version), ``"cpu"`` (no GPU). ``before``: the built-in backend it goes in front
    of; when that one is not in the device's list, it goes in front of the portable
    ``TORCH_SDPA`` fallback. Honoured only for backends registered by call or
    installed through the ``mla_prefill_ext.backends`` entry-point group, and only
    when the user made no explicit choice; the backend's own
    ``validate_configuration`` still decides whether it can serve.
    """

    capabilities: tuple[str, ...]
    before: str = "FLASH_ATTN"

    @classmethod
    def of(cls, value: Any) -> AutoSelectClaim | None:
        """Normalise a claim given as this tuple or a dict; None when there is none."""
        if value is None or isinstance(value, AutoSelectClaim):
            return value
        if isinstance(value, dict):
            caps = value.get("capabilities", ())
            caps = (caps,) if isinstance(caps, str) else tuple(caps)
            return cls(tuple(str(c) for c in caps), str(value.get("before", "FLASH_ATTN")))
        raise TypeError(f"auto_select_claim must be an AutoSelectClaim or a dict, not {value!r}")

    def matches(self, device_capability: DeviceCapability | None) -> bool:
        for cap in self.capabilities:
            spec = cap.strip().lower()
            if device_capability is None:
                if spec == "cpu":
                    return True
                continue
            major, _, minor = spec.partition(".")
            if major == str(device_capability.major) and minor in ("x", "*", str(device_capability.minor)):
                return True
        return False


class KernelWarmup(NamedTuple):
    """The kernel variants a backend builds or loads at engine start, before the first request.

    The layers call three variants: ``new_tokens`` (causal, output only: steps without
    cached context), ``new_tokens_lse`` (causal, with the LSE: steps with cached context)
    and ``context_chunk`` (non-causal over a context chunk, with the LSE). Declare a
    warm-up when the first call of a variant is slow (a JIT build, a kernel download, a
    library load): :meth:`MLAPrefillBackend.warm_up` then runs the flagged variants once
    per process and configuration, in the model's dtype and head configuration, when vLLM
    creates its metadata builder (before the engine reports ready). ``note`` is said in
    the start-up log line, e.g. what takes long and when.
    """

    new_tokens: bool = True
    new_tokens_lse: bool = True
    context_chunk: bool = True
    note: str = ""

    @property
    def variants(self) -> tuple[str, ...]:
        """The flagged variants' names, in the order they run."""
        return tuple(
            name for name in ("new_tokens", "new_tokens_lse", "context_chunk") if getattr(self, name)
        )
