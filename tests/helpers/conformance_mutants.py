"""Broken variants of TORCH_SDPA, one bug each, that the conformance suite must catch.

Each mutant changes one thing through the public backend interface (the constructor,
``self.scale``, ``prepare_metadata``, what the run methods return), not TORCH_SDPA's
internals, and names the property that must fail in ``FAILS``.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
import torch.nn.functional as F

from mla_prefill_ext.backends.torch_sdpa import TorchSDPAPrefillBackend


def _attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence in float32: q/k [L, H, D], v [L, H, Dv] -> out [L, H, Dv] (q's dtype), lse [H, L]."""
    s = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    if causal:
        lq, lk = s.shape[-2], s.shape[-1]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=s.device).triu(lk - lq + 1)
        s = s.masked_fill(mask, float("-inf"))
    out = torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v.float())
    return out.to(q.dtype).contiguous(), torch.logsumexp(s, dim=-1).contiguous()


class _Mutant(TorchSDPAPrefillBackend):
    FAILS = ""  # the property the conformance report must name

    @staticmethod
    def get_name() -> str:
        return "MUTANT"


class WrongScale(_Mutant):
    """Softmax with 1.02 x the layer's scale."""

    FAILS = "scale"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.scale *= 1.02


class DefaultScale(_Mutant):
    """Ignores the layer's scale: 1/sqrt(qk_head_dim), which drops DeepSeek's YaRN mscale."""

    FAILS = "scale"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.scale = self.qk_head_dim**-0.5


class Base2LSE(_Mutant):
    """Returns the LSE in base 2, as FlashInfer's kernels do, unconverted."""

    FAILS = "lse.natural_log"

    def run_prefill_new_tokens(self, q, k, v, return_softmax_lse):  # type: ignore[no-untyped-def]
        ret = super().run_prefill_new_tokens(q, k, v, return_softmax_lse)
        return (ret[0], ret[1] / math.log(2)) if return_softmax_lse else ret

    def run_prefill_context_chunk(self, chunk_idx, q, k, v):  # type: ignore[no-untyped-def]
        out, lse = super().run_prefill_context_chunk(chunk_idx, q, k, v)
        return out, lse / math.log(2)


class TransposedLSE(_Mutant):
    """Returns the LSE as [tokens, heads]."""

    FAILS = "lse.layout"

    def run_prefill_new_tokens(self, q, k, v, return_softmax_lse):  # type: ignore[no-untyped-def]
        ret = super().run_prefill_new_tokens(q, k, v, return_softmax_lse)
        return (ret[0], ret[1].t().contiguous()) if return_softmax_lse else ret

    def run_prefill_context_chunk(self, chunk_idx, q, k, v):  # type: ignore[no-untyped-def]
        out, lse = super().run_prefill_context_chunk(chunk_idx, q, k, v)
        return out, lse.t().contiguous()


class NonCausal(_Mutant):
    """New tokens attend to every new token of their request, later ones included."""

    FAILS = "causal"

    def run_prefill_new_tokens(self, q, k, v, return_softmax_lse):  # type: ignore[no-untyped-def]
        bounds = self.prefill_metadata.query_start_loc.tolist()
        parts = [
            _attention(q[s:e], k[s:e], v[s:e], self.scale, causal=False)
            for s, e in itertools.pairwise(bounds)
        ]
        out = torch.cat([o for o, _ in parts])
        return (out, torch.cat([lse for _, lse in parts], dim=1)) if return_softmax_lse else out


class CrossSequence(_Mutant):
    """Runs the new tokens of all requests as one causal sequence."""

    FAILS = "varlen.isolation"

    def run_prefill_new_tokens(self, q, k, v, return_softmax_lse):  # type: ignore[no-untyped-def]
        out, lse = _attention(q, k, v, self.scale, causal=True)
        return (out, lse) if return_softmax_lse else out


class PaddedOutput(_Mutant):
    """Returns the output padded to the qk head dim, as a kernel that padded V produced it."""

    FAILS = "output.unpadded"

    def _pad(self, out: torch.Tensor) -> torch.Tensor:
        return F.pad(out, [0, self.qk_head_dim - self.v_head_dim])

    def run_prefill_new_tokens(self, q, k, v, return_softmax_lse):  # type: ignore[no-untyped-def]
        ret = super().run_prefill_new_tokens(q, k, v, return_softmax_lse)
        return (self._pad(ret[0]), ret[1]) if return_softmax_lse else self._pad(ret)

    def run_prefill_context_chunk(self, chunk_idx, q, k, v):  # type: ignore[no-untyped-def]
        out, lse = super().run_prefill_context_chunk(chunk_idx, q, k, v)
        return self._pad(out), lse


class StridedOutput(_Mutant):
    """Returns the padded kernel output sliced back to v_head_dim, but as a strided view."""

    FAILS = "output.dense"

    def run_prefill_new_tokens(self, q, k, v, return_softmax_lse):  # type: ignore[no-untyped-def]
        ret = super().run_prefill_new_tokens(q, k, v, return_softmax_lse)
        out = ret[0] if return_softmax_lse else ret
        out = F.pad(out, [0, self.qk_head_dim - self.v_head_dim])[..., : self.v_head_dim]
        return (out, ret[1]) if return_softmax_lse else out


class MutatesInput(_Mutant):
    """Folds the scale into k in place (the caller's tensor), then runs with scale 1."""

    FAILS = "inputs.unmodified"

    def run_prefill_new_tokens(self, q, k, v, return_softmax_lse):  # type: ignore[no-untyped-def]
        k.mul_(self.scale)
        scale, self.scale = self.scale, 1.0
        try:
            return super().run_prefill_new_tokens(q, k, v, return_softmax_lse)
        finally:
            self.scale = scale


class StaleMetadata(_Mutant):
    """Keeps the first step's metadata: prepare_metadata does nothing after the first call."""

    FAILS = "metadata.restep"

    def prepare_metadata(self, prefill_metadata: Any) -> None:
        if not getattr(self, "_prepared_once", False):
            self._prepared_once = True
            super().prepare_metadata(prefill_metadata)


MUTANTS: list[type[_Mutant]] = [
    WrongScale,
    DefaultScale,
    Base2LSE,
    TransposedLSE,
    NonCausal,
    CrossSequence,
    PaddedOutput,
    StridedOutput,
    MutatesInput,
    StaleMetadata,
]


class R1Only(TorchSDPAPrefillBackend):
    """Correct, but claims DeepSeek-R1 dims only; records the dims of every instance built."""

    requires_r1_mla_dimensions = True
    built: list[tuple[int, int, int]] = []  # noqa: RUF012 (a record, reset by the test)

    @staticmethod
    def get_name() -> str:
        return "R1_ONLY"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        R1Only.built.append((self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim))
