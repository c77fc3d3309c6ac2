"""The cases the suite runs (dtype x MLA dims x head count) and the steps each case runs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mla_prefill_ext.backends.base import R1_MLA_DIMS
from mla_prefill_ext.testing.formatting import dtype_name
from mla_prefill_ext.testing.problem import PrefillProblem, deepseek_yarn_scale, make_problem
from mla_prefill_ext.testing.tolerances import TOLERANCES

DEFAULT_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)
DEFAULT_DIMS: tuple[tuple[int, int, int], ...] = (R1_MLA_DIMS, (64, 32, 64))
DEFAULT_NUM_HEADS: tuple[int, ...] = (16, 1)
KV_LORA_RANK = 512

# The step every case runs: three requests (25 new tokens), cached context in two
# chunks; request 1 has no context, request 2 none in chunk 1 (empty chunk rows).
NEW_LENS = [7, 13, 5]
CONTEXT_LENS = [20, 0, 9]
NUM_CHUNKS = 2
# Steps with other shapes for metadata.restep: (new tokens, context, chunks).
RESTEP_SHAPES: list[tuple[list[int], list[int] | None, int]] = [
    ([3, 11, 1, 6], [5, 30, 2, 0], 3),
    ([9, 4], None, 1),
]


@dataclass(frozen=True)
class ConformanceCase:
    """One configuration the suite runs: input dtype, MLA dims, head count."""

    dtype: torch.dtype
    dims: tuple[int, int, int]
    num_heads: int
    scale: float

    @property
    def label(self) -> str:
        nope, rope, v = self.dims
        return f"{dtype_name(self.dtype)}, qk {nope}+{rope} v {v}, {self.num_heads} heads"

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "dtype": dtype_name(self.dtype),
            "dims": list(self.dims),
            "num_heads": self.num_heads,
            "scale": self.scale,
        }

    def layer_kwargs(self, kv_lora_rank: int) -> dict[str, Any]:
        """The seven keyword arguments the MLA layer constructs its prefill backend with."""
        return dict(
            num_heads=self.num_heads,
            scale=self.scale,
            kv_lora_rank=kv_lora_rank,
            qk_nope_head_dim=self.dims[0],
            qk_rope_head_dim=self.dims[1],
            v_head_dim=self.dims[2],
            vllm_config=None,
        )

    def problem(
        self,
        new_lens: list[int],
        context_lens: list[int] | None,
        chunks: int,
        device: torch.device,
        seed: int,
    ) -> PrefillProblem:
        """One step of this case's dtype, dims and heads: ``new_lens`` new tokens, context in ``chunks``."""
        nope, rope, v = self.dims
        return make_problem(
            new_lens,
            context_lens,
            num_chunks=chunks,
            num_heads=self.num_heads,
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope,
            v_head_dim=v,
            dtype=self.dtype,
            device=device,
            seed=seed,
        )


def parse_dtypes(dtype: Any) -> list[torch.dtype]:
    """``run_conformance``'s ``dtype`` argument (None, one, several; names or dtypes) as dtypes."""
    if dtype is None:
        return list(DEFAULT_DTYPES)
    items = [dtype] if isinstance(dtype, (torch.dtype, str)) else list(dtype)
    out = []
    for d in items:
        if isinstance(d, str):
            d = getattr(torch, d.removeprefix("torch."), None)
        if d not in TOLERANCES:
            raise ValueError(
                f"conformance dtype must be one of {', '.join(map(dtype_name, TOLERANCES))}, not {d}"
            )
        out.append(d)
    return out


def make_cases(
    dtypes: list[torch.dtype],
    dims: Sequence[tuple[int, int, int]],
    num_heads: Sequence[int],
    scale: float | None,
) -> list[ConformanceCase]:
    """Every dtype x dims x heads; the scale defaults to DeepSeek's YaRN-scaled one for the qk head dim."""
    return [
        ConformanceCase(d, tuple(dm), h, scale if scale is not None else deepseek_yarn_scale(dm[0] + dm[1]))
        for d in dtypes
        for dm in dims
        for h in num_heads
    ]
