"""Element-wise comparisons of tensors in float64, with the NaN and infinity rules the checks need."""

from __future__ import annotations

import math

import torch


def max_abs_diff(a: torch.Tensor, b: torch.Tensor, nan_equal: bool = False) -> float:
    """max |a - b| in float64: NaN is inf (unless both are NaN and ``nan_equal``); equal infinities
    count as equal."""
    if a.numel() == 0:
        return 0.0
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    d = (a64 - b64).abs()
    same = torch.isinf(a64) & (a64 == b64)
    if nan_equal:
        same |= torch.isnan(a64) & torch.isnan(b64)
    d = torch.where(same, 0.0, d)
    return torch.nan_to_num(d, nan=math.inf).max().item()


def changed(before: torch.Tensor, after: torch.Tensor) -> tuple[int, float]:
    """(elements changed, max |change|) with NaN == NaN; shapes must match."""
    if before.shape != after.shape:
        return before.numel(), math.inf
    same = (before == after) | (torch.isnan(before) & torch.isnan(after))
    n = int((~same).sum().item())
    return n, (max_abs_diff(before, after) if n else 0.0)
