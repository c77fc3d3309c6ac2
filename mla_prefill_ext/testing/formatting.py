"""How numbers, shapes and dtypes are written in the conformance report's text and JSON."""

from __future__ import annotations

import math
from typing import Any

import torch


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``bfloat16``."""
    return str(dtype).removeprefix("torch.")


def shape_str(t: Any) -> str:
    """A tensor's shape as ``[a, b, c]``; anything else by its type name."""
    return f"[{', '.join(str(s) for s in t.shape)}]" if isinstance(t, torch.Tensor) else type(t).__name__


def json_number(x: float | None) -> float | str | None:
    """Floats for JSON: a non-finite error (NaN output, say) as the string 'inf' or 'nan'."""
    return x if x is None or math.isfinite(x) else str(x)


def fmt(x: float | None) -> str:
    """A measured error or tolerance in three significant digits (``-`` for none)."""
    if x is None:
        return "-"
    if math.isinf(x) or math.isnan(x):
        return str(x)
    return f"{x:.3g}" if 1e-3 <= abs(x) < 1e4 or x == 0 else f"{x:.2e}"
