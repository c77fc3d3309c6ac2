"""output.* and lse.layout / lse.dtype: the shapes, dtypes and layouts of what the run methods return."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mla_prefill_ext.testing.checks.context import CaseContext
from mla_prefill_ext.testing.conventions import pair
from mla_prefill_ext.testing.formatting import dtype_name, shape_str
from mla_prefill_ext.testing.properties import FAIL, PASS
from mla_prefill_ext.testing.recorder import CaseRecorder

PROPS = ("output.shape", "output.unpadded", "output.dtype", "output.dense", "lse.layout", "lse.dtype")


@dataclass(frozen=True)
class Usability:
    """Which results the value checks can compare: outputs of the right shape, LSEs of the right layout."""

    outputs: bool
    lse: bool


NOTHING_USABLE = Usability(outputs=False, lse=False)


def outputs(ctx: CaseContext) -> list[tuple[str, Any]]:
    """(where, output) of every call of the main step."""
    main = ctx.main
    outs = [("new tokens", pair(main.new)[0]), ("new tokens without LSE", main.plain)]
    outs += [(f"context chunk {i}", pair(c)[0]) for i, c in enumerate(main.chunks)]
    return outs


def lses(ctx: CaseContext) -> list[tuple[str, Any, Any]]:
    """(call, raw result, lse or None) of every call of the main step that returns an LSE."""
    convention = ctx.driver.convention
    res = [(convention.new_tokens_call(True), ctx.main.new)]
    res += [(convention.chunk_call(i), c) for i, c in enumerate(ctx.main.chunks)]
    return [(w, r, pair(r)[1]) for w, r in res]


def check_structure(ctx: CaseContext, rec: CaseRecorder) -> Usability:
    """Every output and LSE of the main step; says which of them the value checks can use."""
    check_outputs(ctx, rec)
    check_lses(ctx, rec)
    return Usability(
        outputs=rec.passed("output.shape") and rec.passed("output.unpadded"), lse=rec.passed("lse.layout")
    )


def check_outputs(ctx: CaseContext, rec: CaseRecorder) -> None:
    T, H, dv, qk = ctx.tokens, ctx.heads, ctx.v_head_dim, ctx.case.dims[0] + ctx.case.dims[1]
    want_dtype = ctx.problem.metadata.output_dtype
    shape, unpadded, dtype, dense = [], [], [], []
    for where, out in outputs(ctx):
        if where == "new tokens without LSE" and isinstance(out, (tuple, list)):
            out = out[0] if out else None  # reported under new_tokens.without_lse
        if not isinstance(out, torch.Tensor):
            shape.append(f"{where}: got {type(out).__name__}, not a tensor")
            continue
        if out.dim() != 3 or tuple(out.shape[:2]) != (T, H):
            shape.append(f"{where}: {shape_str(out)}, expected [{T}, {H}, {dv}]")
        elif out.shape[2] != dv:
            if out.shape[2] > dv:
                padded = " (the qk head dim: V padded for the kernel, output not sliced back)"
                unpadded.append(
                    f"{where}: last dim {out.shape[2]}, expected v_head_dim {dv}"
                    + (padded if out.shape[2] == qk else "")
                )
            else:
                shape.append(f"{where}: {shape_str(out)}, expected [{T}, {H}, {dv}]")
        if out.dtype != want_dtype:
            dtype.append(f"{where}: {dtype_name(out.dtype)}, expected {dtype_name(want_dtype)}")
        if not out.is_contiguous():
            dense.append(
                f"{where}: strides {tuple(out.stride())} for shape {shape_str(out)} (not contiguous)"
            )
    for prop, bad, good in (
        ("output.shape", shape, f"[{T}, {H}, {dv}]"),
        ("output.unpadded", unpadded, f"last dim {dv}"),
        ("output.dtype", dtype, dtype_name(want_dtype)),
        ("output.dense", dense, "contiguous"),
    ):
        rec.add(prop, FAIL if bad else PASS, "; ".join(bad) if bad else good)


def check_lses(ctx: CaseContext, rec: CaseRecorder) -> None:
    T, H = ctx.tokens, ctx.heads
    layout, ltype = [], []
    for where, raw, lse in lses(ctx):
        if lse is None:
            layout.append(f"{where} returned {type(raw).__name__}, not a tuple (output, lse)")
            continue
        if not isinstance(lse, torch.Tensor):
            layout.append(f"{where}: LSE is {type(lse).__name__}, not a tensor")
            continue
        if tuple(lse.shape) != (H, T):
            hint = " (transposed: [tokens, heads])" if tuple(lse.shape) == (T, H) else ""
            layout.append(
                f"{where}: LSE shape {shape_str(lse)}, expected [num_heads, tokens] = [{H}, {T}]{hint}"
            )
        elif not lse.is_contiguous():
            layout.append(f"{where}: LSE strides {tuple(lse.stride())} (not contiguous; a transposed view?)")
        if lse.dtype != torch.float32:
            ltype.append(f"{where}: LSE {dtype_name(lse.dtype)}, expected float32")
    rec.add(
        "lse.layout", FAIL if layout else PASS, "; ".join(layout) if layout else f"[{H}, {T}], contiguous"
    )
    rec.add("lse.dtype", FAIL if ltype else PASS, "; ".join(ltype) if ltype else "float32")
