"""What ``bench`` reports: every backend measured on every shape, as text or JSON; or why it stopped."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mla_prefill_ext.bench.spec import BenchShape, MLADims
from mla_prefill_ext.cli.common import EXIT_OK, EXIT_PROBLEM, Report, cap_str, disabled_lines


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


@dataclass
class BenchStopped(Report):
    """A bench that could not start: a backend cannot serve here (exit code 1), or it cannot run (2)."""

    facts: dict[str, Any]
    message: str
    exit_code: int = EXIT_PROBLEM

    def to_json(self) -> dict[str, Any]:
        return {**self.facts, "ok": False, "error": self.message, "exit_code": self.exit_code}

    def text_lines(self) -> list[str]:
        label = "FAIL" if self.exit_code == EXIT_PROBLEM else "cannot check"
        return [f"{label}: {self.message}"]


@dataclass
class BenchReport(Report):
    """Every backend measured on every shape, with each one's ratio to the fastest built-in."""

    facts: dict[str, Any]
    capability: Any  # vLLM's DeviceCapability, None: no GPU
    dims: MLADims
    scale: float
    candidates: list[Any]  # mla_prefill_ext.bench.run.Candidate
    sources: dict[str, str]  # backend under test -> where it was named
    builtins_left_out: dict[str, list[str]]
    rows: list[Any]  # mla_prefill_ext.bench.run.Measurement
    shapes: list[BenchShape] = field(default_factory=list)

    @property
    def under_test(self) -> list[str]:
        return [c.name for c in self.candidates if c.under_test]

    @property
    def failures(self) -> list[Any]:
        return [r for r in self.rows if r.error is not None and r.backend in self.under_test]

    @property
    def exit_code(self) -> int:  # type: ignore[override]
        return EXIT_PROBLEM if self.failures else EXIT_OK

    def to_json(self) -> dict[str, Any]:
        flops = {r.shape: r.flops for r in self.rows if r.flops}
        return {
            **self.facts,
            "ok": not self.failures,
            "dims": {
                "qk_nope_head_dim": self.dims.qk_nope_head_dim,
                "qk_rope_head_dim": self.dims.qk_rope_head_dim,
                "v_head_dim": self.dims.v_head_dim,
                "num_heads": self.dims.num_heads,
                "preset": self.dims.name or None,
            },
            "scale": self.scale,
            "backends": [
                {
                    "name": c.name,
                    "class": c.class_path,
                    "under_test": c.under_test,
                    "builtin": c.builtin,
                    "source": self.sources.get(c.name),
                }
                for c in self.candidates
            ],
            "builtins_left_out": self.builtins_left_out,
            "shapes": [
                {
                    "label": s.label,
                    "seqs": s.seqs,
                    "new_tokens": s.new,
                    "context_tokens": s.context,
                    "chunks": s.chunks if s.context else 0,
                    "tokens": s.tokens,
                    "flops": flops.get(s),
                }
                for s in self.shapes
            ],
            "results": [
                {
                    "backend": r.backend,
                    "shape": r.shape.label,
                    "time_ms": _ms(r.timing and r.timing.median_s),
                    "times_ms": [t * 1e3 for t in r.timing.samples_s] if r.timing else [],
                    "calls_per_repetition": r.timing.calls_per_repetition if r.timing else None,
                    "flops": r.flops,
                    "tflops": r.tflops,
                    "fastest_builtin": r.fastest_builtin,
                    "speed_vs_fastest_builtin": r.speed_vs_fastest_builtin,
                    "error": r.error,
                }
                for r in self.rows
            ],
            "exit_code": self.exit_code,
        }

    def _table(self) -> list[str]:
        header = ("shape", "backend", "time ms", "TFLOP/s", "vs fastest built-in")
        cells = [header]
        for r in self.rows:
            name = f"{r.backend}{' *' if r.backend in self.under_test else ''}"
            if r.timing is None:
                cells.append((r.shape.label, name, "-", "-", "error (below)"))
                continue
            ratio = r.speed_vs_fastest_builtin
            vs = "-" if ratio is None else f"{ratio:.2f}x ({r.fastest_builtin})"
            cells.append((r.shape.label, name, f"{r.timing.median_s * 1e3:.3f}", f"{r.tflops:.3g}", vs))
        widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
        right = (False, False, True, True, False)
        return [
            "  ".join(
                c.rjust(w) if r else c.ljust(w) for c, w, r in zip(row, widths, right, strict=True)
            ).rstrip()
            for row in cells
        ]

    def text_lines(self) -> list[str]:
        f = self.facts
        measured = [c.name for c in self.candidates if c.builtin]
        left = "; ".join(f"{n}: {'; '.join(r)}" for n, r in self.builtins_left_out.items())
        under = ", ".join(
            f"{c.name} ({c.class_path}; {self.sources[c.name]})" for c in self.candidates if c.under_test
        )
        lines = [
            *disabled_lines(f["disabled_by_env"], "this benchmark runs the backends directly"),
            f"under test (*): {under}",
            f"built-ins that can serve here: {', '.join(measured) or 'none (no ratio to show)'}",
            *([f"built-ins left out: {left}"] if left else []),
            f"device: {f['device']}, capability {cap_str(self.capability)}, dtype {f['dtype']}; "
            f"vLLM {f['vllm_version']}, {f['calls']}",
            f"MLA dims: {self.dims.label}, scale {self.scale:.6f}",
            f"timing: median of {f['repeat']} repetitions after {f['warmup']} warm-up steps, device "
            "synchronised; a step is the new tokens then each context chunk (vLLM's merge not timed)",
            *self._table(),
            "TFLOP/s: QK^T and PV, the causal half of the new tokens plus the new tokens against their "
            "context. vs fastest built-in: its time over this one's (above 1.00x: faster than every "
            "built-in measured here).",
        ]
        for r in self.rows:
            if r.error is not None:
                lines.append(f"error: {r.backend} on {r.shape.label}: {r.error}")
        if self.failures:
            lines.append(f"FAIL: {len(self.failures)} step(s) of the backend(s) under test did not run.")
        return lines
