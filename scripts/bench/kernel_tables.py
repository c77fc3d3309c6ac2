"""The kernel benchmark's rows as results: the fastest backend per shape, Markdown tables, a plot."""

from __future__ import annotations

from typing import Any

from .sides import markdown_table

R1 = (128, 64, 128)  # (qk_nope, qk_rope, v) head dims of DeepSeek-V2/V3/R1
NON_R1 = (64, 32, 64)


def _shape_key(row: dict[str, Any]) -> tuple[str, tuple[int, ...], int, str]:
    return row["op"], tuple(row["dims"]), row["heads"], row["shape"]


def fastest_per_shape(rows: list[dict[str, Any]], capability: Any) -> list[dict[str, Any]]:
    """Per shape: the fastest backend measured, and what automatic selection picks on ``capability``
    (vLLM's ``DeviceCapability``, None: no GPU)."""
    import torch

    from mla_prefill_ext.selector import (
        MLAPrefillSelectorConfig,
        check_backend,
        mla_prefill_backend_priorities,
    )

    out = []
    rows = [r for r in rows if "error" not in r]
    for op, dims, heads, shape in sorted({_shape_key(r) for r in rows}):
        cands = {r["backend"]: r["backend_ms"] for r in rows if _shape_key(r) == (op, dims, heads, shape)}
        config = MLAPrefillSelectorConfig.from_dims(torch.bfloat16, *dims)
        order = mla_prefill_backend_priorities(capability)
        auto = next(m.name for m in order if not check_backend(m, capability, config)[1])
        best = min(cands, key=cands.get)
        ratio = cands[best] / cands[auto] if auto in cands else None
        row = dict(op=op, dims=list(dims), heads=heads, shape=shape, fastest=best, automatic=auto)
        out.append({**row, "auto_vs_fastest": ratio, "ms": cands})
    return out


def plot(kernel_rows: list[dict[str, Any]], path: str, dpi: int = 120) -> None:
    """TFLOP/s over tokens of one sequence, R1 dims: backend and bare kernel, per op and head count."""
    import matplotlib

    kernel_rows = [r for r in kernel_rows if "error" not in r]

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(op, heads) for op in ("new_tokens", "context_chunk") for heads in (16, 128)]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), sharey=True)
    for ax, (op, heads) in zip(axes, panels, strict=True):
        for name in ("FLASH_ATTN", "FLASHINFER", "TORCH_SDPA"):
            want = (op, heads, name, 1, list(R1))
            rows = [
                r for r in kernel_rows if (r["op"], r["heads"], r["backend"], r["seqs"], r["dims"]) == want
            ]
            if not rows:
                continue
            xs = [r["tokens"] for r in rows]
            ax.plot(xs, [r["backend_tflops"] for r in rows], marker="o", label=f"{name} (backend)")
            if "bare_tflops" in rows[0]:
                ax.plot(xs, [r["bare_tflops"] for r in rows], linestyle="--", label=f"{name} (bare kernel)")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{op}, {heads} heads, qk 192 / v 128")
        ax.set_xlabel("tokens (one sequence)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("TFLOP/s (bf16)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)


def _tflops(r: dict[str, Any]) -> str:
    """A row's TFLOP/s, next to its bare kernel's where it has one: ``backend / bare (ratio)``."""
    if "bare_tflops" not in r:
        return f"{r['backend_tflops']:.1f}"
    return f"{r['backend_tflops']:.0f} / {r['bare_tflops']:.0f} ({r['ratio']:.3f})"


def kernel_markdown(kernel_rows: list[dict[str, Any]]) -> list[str]:
    """Backend vs bare kernel per shape (TFLOP/s and ratio), then the first failure if any failed."""
    lines: list[str] = []
    rows = [r for r in kernel_rows if "error" not in r]
    if rows:
        columns = ["op", "dims (nope,rope,v)", "heads", "seqs x tokens"]
        columns += [f"{b} backend / bare TFLOP/s (ratio)" for b in ("FLASH_ATTN", "FLASHINFER")]
        keys = sorted(
            {(r["op"], tuple(r["dims"]), r["heads"], r["seqs"], r["shape"]) for r in rows},
            key=lambda k: (k[0] != "new_tokens", k[1] != R1, k[2], k[3] > 1, int(k[4].split("x")[1])),
        )
        table = []
        for op, dims, heads, _seqs, shape in keys:
            cell = {r["backend"]: _tflops(r) for r in rows if _shape_key(r) == (op, dims, heads, shape)}
            backends = [cell.get(b, "-") for b in ("FLASH_ATTN", "FLASHINFER", "TORCH_SDPA")]
            table.append([op, ",".join(map(str, dims)), str(heads), shape, *backends])
        lines += [*markdown_table([*columns, "TORCH_SDPA TFLOP/s"], table), ""]
    errors = [r for r in kernel_rows if "error" in r]
    if errors:
        err = errors[0]
        first = f"{err['backend']} {err['dims']}: {err['error']}"
        lines += [f"{len(errors)} cases failed to run; the first: {first}", ""]
    return lines


def selection_markdown(selection: list[dict[str, Any]]) -> list[str]:
    """Per shape where automatic's choice was measured: the fastest backend, and automatic's time."""
    columns = ("op", "dims", "heads", "seqs x tokens", "fastest", "automatic (SM90)", "auto time / fastest")
    rows = [
        [s["op"], ",".join(map(str, s["dims"])), str(s["heads"]), s["shape"], s["fastest"], s["automatic"], r]
        for s in selection
        if s["auto_vs_fastest"] is not None
        for r in [f"{1 / s['auto_vs_fastest']:.2f}x"]
    ]
    return [*markdown_table(columns, rows), ""]


def markdown(kernel_rows: list[dict[str, Any]], selection: list[dict[str, Any]]) -> str:
    """The result tables as Markdown (for docs/benchmarks.md)."""
    return "\n".join(kernel_markdown(kernel_rows) + (selection_markdown(selection) if selection else []))
