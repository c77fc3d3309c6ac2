"""The values backends, selector and hosts share: selector config, MLA dims, Selection.

It imports nothing of the add-on, vLLM or PyTorch at run time, so that every module
can depend on it: a backend is chosen (``backends/`` reads these types), it does not
choose (it never imports the selector).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch
    from vllm.platforms.interface import DeviceCapability

    from mla_prefill_ext.backends.base import MLAPrefillBackend


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


@dataclass
class Selection:
    """The outcome of a selection, how it was chosen, and why every other candidate was passed over.

    ``source`` is the setting that chose ``name`` (``MLA_PREFILL_BACKEND``,
    ``additional_config[...]``, a legacy flag) or :data:`AUTOMATIC`.
    """

    backend: type[MLAPrefillBackend]
    name: str
    source: str
    capability: DeviceCapability | None
    config: MLAPrefillSelectorConfig
    rejected: dict[str, list[str]] = field(default_factory=dict)

    @property
    def is_automatic(self) -> bool:
        return self.source is AUTOMATIC
