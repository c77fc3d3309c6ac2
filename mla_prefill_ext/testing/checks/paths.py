"""The main step's result paths (new tokens, each context chunk) with their float64 references."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mla_prefill_ext.testing.checks.context import CaseContext
from mla_prefill_ext.testing.checks.structure import Usability
from mla_prefill_ext.testing.compare import max_abs_diff
from mla_prefill_ext.testing.conventions import pair
from mla_prefill_ext.testing.reference import ScaledReference


@dataclass(frozen=True)
class Piece:
    """One request's part of one path: its rows and its reference at any scale."""

    rows: slice
    ref: ScaledReference


class ResultPath:
    """New tokens or one context chunk: the backend's usable tensors and the references."""

    def __init__(
        self, name: str, pieces: list[Piece], out: torch.Tensor | None, lse: torch.Tensor | None
    ) -> None:
        self.name, self.pieces, self.out, self.lse = name, pieces, out, lse
        self._out64 = [None if out is None else out[p.rows].double() for p in pieces]
        self._lse64 = [None if lse is None else lse[:, p.rows].double() for p in pieces]

    def errors(self, scale: float) -> tuple[float, float, float, float]:
        """At ``scale``: (max |out - ref|, max |ref|, max |lse - ref lse|, max |lse * ln 2 - ref lse|).

        The last is the LSE's error if it were in base 2 (0 for LSE-less paths).
        """
        out_err = ref_max = lse_err = lse2_err = 0.0
        for piece, out, lse in zip(self.pieces, self._out64, self._lse64, strict=True):
            ro, rl = piece.ref(scale)
            if out is not None:
                out_err = max(out_err, max_abs_diff(out, ro))
                ref_max = max(ref_max, ro.abs().max().item() if ro.numel() else 0.0)
            if lse is not None:
                lse_err = max(lse_err, max_abs_diff(lse, rl))
                lse2_err = max(lse2_err, max_abs_diff(lse * math.log(2), rl))
        return out_err, ref_max, lse_err, lse2_err


def new_token_path(ctx: CaseContext, usable: Usability) -> ResultPath:
    """The new tokens: each request's causal attention among its own new tokens."""
    p = ctx.problem
    out, lse = pair(ctx.main.new)
    pieces = []
    for s, e in zip(ctx.query_bounds[:-1], ctx.query_bounds[1:], strict=True):
        if e > s:
            pieces.append(Piece(slice(s, e), ScaledReference(p.q[s:e], p.k[s:e], p.v[s:e], causal=True)))
    return ResultPath("new tokens", pieces, out if usable.outputs else None, lse if usable.lse else None)


def chunk_paths(ctx: CaseContext, usable: Usability) -> list[ResultPath]:
    """Each context chunk: each request's attention over its keys in that chunk (requests with keys)."""
    p, qb = ctx.problem, ctx.query_bounds
    paths = []
    for c, cu in enumerate(ctx.chunk_bounds):
        out, lse = pair(ctx.main.chunks[c])
        pieces = []
        for r in range(ctx.num_requests):
            s, e, ks, ke = qb[r], qb[r + 1], cu[r], cu[r + 1]
            if e > s and ke > ks:
                kc, vc = p.chunk_k[c][ks:ke], p.chunk_v[c][ks:ke]
                pieces.append(Piece(slice(s, e), ScaledReference(p.q[s:e], kc, vc, causal=False)))
        paths.append(
            ResultPath(
                f"context chunk {c}", pieces, out if usable.outputs else None, lse if usable.lse else None
            )
        )
    return paths
