"""The runner the side-by-side benchmarks share (first_request, serving): sides, caches, processes, tables.

A side is one engine (or server) lifetime in a process of its own, alone on the GPU: ``stock`` (the
add-on disabled), ``NAME`` (``MLA_PREFILL_BACKEND=NAME``) or ``NAME-warm`` (with a filled FlashInfer cache).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

WARM_SUFFIX = "-warm"
SIDE_ENV = ("MLA_PREFILL_EXT_DISABLE", "MLA_PREFILL_BACKEND")


@dataclass(frozen=True)
class Side:
    """One engine lifetime: ``stock``, a backend name, or a backend with a warm FlashInfer cache."""

    label: str
    backend: str | None  # None: stock (the add-on disabled)
    warm: bool = False


def parse_sides(text: str, warm_cache_given: bool = False) -> list[Side]:
    """``stock,FLASH_ATTN,FLASHINFER,FLASHINFER-warm`` -> sides; a warm side needs its cache's source."""
    sides: list[Side] = []
    for raw in text.split(","):
        label = raw.strip()
        if not label:
            raise ValueError(f"empty side in {text!r}")
        if label.lower() == "stock":
            side = Side("stock", None)
        elif label.endswith(WARM_SUFFIX):
            backend = label[: -len(WARM_SUFFIX)].upper()
            if not warm_cache_given and not any(s.backend == backend and not s.warm for s in sides):
                earlier = f"reuses the FlashInfer cache of an earlier side {backend!r}"
                raise ValueError(f"side {label!r} {earlier}: list that side first, or give --warm-cache DIR")
            side = Side(f"{backend}{WARM_SUFFIX}", backend, warm=True)
        else:
            side = Side(label.upper(), label.upper())
        if any(s.label == side.label for s in sides):
            raise ValueError(f"side {side.label!r} listed twice")
        sides.append(side)
    return sides


def side_env(side: Side) -> dict[str, str]:
    """The add-on's switches for a side's process (every other one of them removed)."""
    return {"MLA_PREFILL_EXT_DISABLE": "1"} if side.backend is None else {"MLA_PREFILL_BACKEND": side.backend}


def cache_env(flashinfer: Path, host: Path | None) -> dict[str, str]:
    """Where a side's process keeps FlashInfer's JIT cache, and vLLM's and Triton's (None: the host's)."""
    env = {"FLASHINFER_WORKSPACE_BASE": str(flashinfer)}
    if host is not None:
        env.update(VLLM_CACHE_ROOT=str(host / "vllm"), TRITON_CACHE_DIR=str(host / "triton"))
    return env


def process_env(side: Side, flashinfer: Path, host: Path | None, **extra: str) -> dict[str, str]:
    """A side's process environment: this one with the side's switch (the add-on's others removed),
    its caches (:func:`cache_env`), FlashInfer's sampler off and Hugging Face offline unless set."""
    env = {k: v for k, v in os.environ.items() if k not in SIDE_ENV}
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    env.setdefault("HF_HUB_OFFLINE", "1")
    return {**env, **side_env(side), **cache_env(flashinfer, host), **extra}


def against_stock(
    rows: list[dict], ran: str, ratios: Sequence[str], differences: Sequence[str] = ()
) -> list[dict]:
    """Each row that has ``ran`` with ``ratios`` (``X`` -> ``X_vs_stock``, its value / stock's) and
    ``differences`` (``X_s`` -> ``X_vs_stock_s``, its value - stock's), where stock has ``ran`` too."""
    stock = next((r for r in rows if r["side"] == "stock" and ran in r), None)
    for row in rows:
        if stock is not None and ran in row:
            row.update({f"{k.removesuffix('_s')}_vs_stock": row[k] / stock[k] for k in ratios})
            row.update({f"{k.removesuffix('_s')}_vs_stock_s": row[k] - stock[k] for k in differences})
    return rows


def modules_in_cache(base: Path) -> list[str]:
    """FlashInfer JIT modules compiled into the cache under ``base`` (a FLASHINFER_WORKSPACE_BASE)."""
    root = base / ".cache" / "flashinfer"
    if not root.is_dir():
        return []
    return sorted({so.parent.name for so in root.glob("*/*/cached_ops/*/*.so") if so.stem == so.parent.name})


def time_for_side(args: argparse.Namespace, min_s: float) -> tuple[float, str | None]:
    """Seconds the next side may take (``--side-timeout``, cut at ``--deadline``), and why it is skipped
    (None: it runs) when that is less than ``min_s``."""
    limit = args.side_timeout
    if args.deadline is not None:
        limit = min(limit, args.deadline - time.time())
    if limit < min_s:
        return limit, f"skipped: {max(limit, 0):.0f} s left before the deadline"
    return limit, None


def add_side_arguments(parser: argparse.ArgumentParser, *, side_timeout: float, what_logs: str) -> None:
    """The flags every side-by-side benchmark takes: output, logs, caches, time limits, GPU memory."""
    parser.add_argument(
        "--eager", action="store_true", help="enforce_eager: no torch.compile, no CUDA graphs"
    )
    parser.add_argument("--gpu-mem", type=float, default=0.5, help="gpu_memory_utilization")
    parser.add_argument("--json", help="write the raw results and the table here")
    parser.add_argument("--logs", help=f"folder for each side's {what_logs} log (default: the cache root)")
    parser.add_argument("--cache-root", help="folder for the sides' caches (default: a temporary one)")
    parser.add_argument("--side-timeout", type=float, default=side_timeout, help="seconds one side may take")
    parser.add_argument("--deadline", type=float, help="epoch seconds: no side runs past it (others skipped)")


def kill_tree(proc: subprocess.Popen) -> None:
    """Kill a side's process and every process under it: vLLM's engine core runs in a process of its
    own, and must not hold the GPU for the next side."""
    import psutil  # comes with vLLM

    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:  # already gone (and reaped): its children were re-parented or are gone
        children = []
    for child in children:
        child.kill()
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def run_child(command: list[str], env: dict[str, str], log: Path, limit: float) -> int | None:
    """Run one side's process; its exit status, or None when it ran out of time (then its whole tree is
    killed, :func:`kill_tree`)."""
    with open(log, "w") as log_file:
        proc = subprocess.Popen(command, env=env, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            return proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            return None


def stop_server(proc: subprocess.Popen) -> None:
    """SIGINT (vLLM's own shutdown), then whatever is left of its tree killed."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    kill_tree(proc)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear between the closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def markdown_table(columns: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """A Markdown table; a row with fewer cells than columns (a failed side) ends in empty ones."""
    lines = ["| " + " | ".join(columns) + " |", "| --- " * len(columns) + "|"]
    for cells in rows:
        lines.append("| " + " | ".join(cells) + " |" + " |" * (len(columns) - len(cells)))
    return lines
