"""What ``bench`` measures: prefill shapes and MLA dims, named sets of them, and their parsing.

Needs neither vLLM nor PyTorch: the command line parses these before it checks that they import.
"""

from __future__ import annotations

import re
from typing import NamedTuple


class BenchShape(NamedTuple):
    """One prefill step: ``seqs`` sequences of ``new`` new tokens, each after ``context`` cached
    tokens that arrive in ``chunks`` context chunks (none when ``context`` is 0)."""

    seqs: int
    new: int
    context: int = 0
    chunks: int = 1

    @property
    def label(self) -> str:
        """``8x2048`` or ``8x2048+4096`` (one chunk) or ``8x2048+4096/2``: the spec ``--shapes`` takes."""
        text = f"{self.seqs}x{self.new}"
        if self.context:
            text += f"+{self.context}" + (f"/{self.chunks}" if self.chunks != 1 else "")
        return text

    @property
    def tokens(self) -> int:
        """New tokens in the step (what the prefill computes outputs for)."""
        return self.seqs * self.new

    def new_lens(self) -> list[int]:
        return [self.new] * self.seqs

    def context_lens(self) -> list[int]:
        return [self.context] * self.seqs


class MLADims(NamedTuple):
    """A model's MLA attention dims as one GPU's prefill sees them."""

    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    num_heads: int
    name: str = ""  # the preset's, '' for dims given as numbers

    @property
    def label(self) -> str:
        nope, rope, v, heads = self[:4]
        named = f" ({self.name})" if self.name else ""
        return f"qk {nope}+{rope}, v {v}, {heads} heads{named}"


# The shapes: new tokens alone and after cached context, 1 to 64 sequences, 1k to 32k new
# tokens. Each is also in scripts/bench/kernel.py's grid (one context chunk as long as the new
# tokens there), so the two benchmarks can be compared shape by shape.
SHAPE_SETS: dict[str, tuple[BenchShape, ...]] = {
    "default": (
        BenchShape(1, 1024),
        BenchShape(1, 8192),
        BenchShape(1, 32768),
        BenchShape(8, 2048),
        BenchShape(32, 512),
        BenchShape(64, 128),
        BenchShape(1, 4096, 4096),
        BenchShape(8, 2048, 2048),
        BenchShape(64, 128, 128),
    ),
    # A CPU's: the same kinds of step, small enough for a CPU to time in seconds.
    "small": (
        BenchShape(1, 256),
        BenchShape(4, 64),
        BenchShape(1, 128, 256),
        BenchShape(4, 64, 128, 2),
    ),
}

DIMS_PRESETS: dict[str, MLADims] = {
    # DeepSeek-V3/R1 (128 heads) served with tensor parallelism 8: 16 heads per GPU.
    "r1": MLADims(128, 64, 128, 16, "r1"),
    # The same model on one GPU (or with tensor parallelism 1 for attention).
    "r1-tp1": MLADims(128, 64, 128, 128, "r1-tp1"),
    # DeepSeek-V2-Lite: R1's head dims, 16 heads.
    "v2-lite": MLADims(128, 64, 128, 16, "v2-lite"),
}
DEFAULT_DIMS = "r1"
DEFAULT_SHAPES = "default"

_SHAPE = re.compile(r"(\d+)x(\d+)(?:\+(\d+)(?:/(\d+))?)?")


def parse_shapes(text: str) -> list[BenchShape]:
    """``--shapes``: set names and shape specs, comma-separated; ValueError says what is wrong."""
    shapes: list[BenchShape] = []
    for item in (p.strip() for p in text.split(",")):
        if item.lower() in SHAPE_SETS:
            shapes.extend(s for s in SHAPE_SETS[item.lower()] if s not in shapes)
            continue
        match = _SHAPE.fullmatch(item)
        if match is None:
            raise ValueError(
                f"{item!r} is neither a shape set ({', '.join(SHAPE_SETS)}) nor a shape "
                "SEQSxNEW[+CONTEXT[/CHUNKS]] (e.g. 8x2048, 1x4096+4096, 4x1024+8192/2)"
            )
        seqs, new, context, chunks = (int(g) if g else None for g in match.groups())
        shape = BenchShape(seqs or 0, new or 0, context or 0, chunks or 1)
        if min(shape.seqs, shape.new, shape.chunks) < 1:
            raise ValueError(f"{item!r}: sequences, new tokens and chunks must be at least 1")
        if shape.context and shape.chunks > shape.context:
            raise ValueError(f"{item!r}: more context chunks ({shape.chunks}) than context tokens")
        if shape not in shapes:
            shapes.append(shape)
    return shapes


DIMS_METAVAR = "PRESET|NOPE,ROPE,V,HEADS"


def dims_help(heads_needed: bool) -> str:
    """``--dims``'s help, the same in select and bench (``heads_needed``: bench's)."""
    presets = ", ".join(f"{n} ({d.label.split(' (')[0]})" for n, d in DIMS_PRESETS.items())
    three = (
        ""
        if heads_needed
        else "; qk_nope,qk_rope,v is taken too (the head count does not change the selection)"
    )
    return (
        f"the model's MLA dims as one GPU sees them: a preset, {presets}, or qk_nope,qk_rope,v,heads "
        f"(default: {DEFAULT_DIMS}){three}"
    )


def parse_dims(text: str, heads_needed: bool = True) -> MLADims:
    """``--dims`` of select and bench: a preset name, or ``NOPE,ROPE,V,HEADS``; ValueError says what is wrong.

    Without ``heads_needed`` (select, whose choice does not depend on the head count),
    ``NOPE,ROPE,V`` is taken too, with ``num_heads`` 0 (not given).
    """
    preset = DIMS_PRESETS.get(text.strip().lower())
    if preset is not None:
        return preset
    try:
        values = [int(p) for p in text.split(",")]
    except ValueError:
        values = []
    if len(values) == 3 and min(values) > 0:
        if not heads_needed:
            return MLADims(*values, num_heads=0)
        raise ValueError(
            f"{text!r} gives no head count: bench needs four numbers qk_nope,qk_rope,v,heads, heads as "
            f"one GPU sees them (e.g. {text.strip()},16), or a preset ({', '.join(DIMS_PRESETS)})"
        )
    if len(values) != 4 or min(values) <= 0:
        three = "" if heads_needed else " (or three, qk_nope,qk_rope,v)"
        raise ValueError(
            f"expected a preset ({', '.join(DIMS_PRESETS)}) or four positive numbers "
            f"qk_nope,qk_rope,v,heads{three} (e.g. 128,64,128,16), got {text!r}"
        )
    return MLADims(*values)
