"""Engine prefill throughput: stock vLLM and the add-on's backends, side by side, interleaved.

    python -m scripts.bench engine [--sides stock,FLASH_ATTN,FLASHINFER] [--reps 7]
        [--grid 1024x8,1024x64,...] [--max-num-batched-tokens 4096] [--json out.json]
        [--tree LABEL=DIR --sides ...,FLASHINFER@LABEL --compare FLASHINFER/FLASHINFER@LABEL]

One driver process holds one engine per side on one GPU, all alive at once, taking turns in an order
that rotates each repetition; the same fresh random prompts to every side (``max_tokens=1``), one
untimed repetition first; prompt tokens/s. Each engine core is spawned with its own environment:
``stock`` with ``MLA_PREFILL_EXT_DISABLE=1``, the others with ``MLA_PREFILL_BACKEND=<side>``; its
workers report what owns their MLA prefill and the run stops if a side is not what it claims. A side
``NAME@LABEL`` runs the add-on from another code tree (``--tree LABEL=DIR``, first on its PYTHONPATH).
Model (``--model``): the 61-layer DeepSeek-R1 slice of one GPU at TP=8 (``scripts/bench/models/``),
dummy weights; torch.compile and CUDA graphs unless ``--eager``. Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from . import common
from .common import ROOT
from .sides import SIDE_ENV, Side, markdown_table, side_env

MODEL_DIR = ROOT / "scripts" / "bench" / "models" / "r1_tp8_slice"
DEFAULT_GRID = "1024x8,1024x64,4096x2,4096x16,16384x1,16384x4"
SHARED_PREFIX_ENV = "MLA_PREFILL_SHARED_PREFIX"  # the shared-prefix path: "0" turns it off
CUDAGRAPH_MODE_ENV = "MLA_BENCH_CUDAGRAPH_MODE"  # a side's compilation_config cudagraph_mode (benchmark only)
GATHER_ENV = "MLA_PREFILL_SHARED_PREFIX_GATHER_MS"  # its engine core's gathering of a burst: "0" off


def parse_grid(text: str) -> list[tuple[int, int]]:
    return [(int(length), int(batch)) for length, batch in (p.lower().split("x") for p in text.split(","))]


def prefill_owners(worker: Any) -> dict[str, Any]:
    """Runs in each worker (collective_rpc): what owns prefill in this engine (vLLM 0.20's layers own
    none but the patch's; from 0.21 each owns vLLM's own or, bridged, the add-on's adapter)."""
    import sys as _sys

    owners, addon = set(), set()
    for module in worker.get_model().modules():
        if hasattr(module, "prefill_backend") and type(module).__name__ == "MLAAttention":
            backend = module.prefill_backend
            owners.add(backend.get_name() if backend is not None else "vLLM's own")
            addon.add(backend is not None and type(backend).__module__.startswith("mla_prefill_ext"))
    # The host's instrumentor: the patch (0.20; hosts.core.instrumentor in older trees) or the bridge.
    hosts = [f"mla_prefill_ext.hosts.{m}" for m in ("vllm_0_20.mla", "core.instrumentor", "vllm_0_23.bridge")]
    hosts = [getattr(_sys.modules.get(name), "is_instrumented", None) for name in hosts]
    package = _sys.modules.get("mla_prefill_ext")
    path = _sys.modules.get("mla_prefill_ext.hosts.core.shared_prefix.instrumentor")
    hashes = _sys.modules.get("mla_prefill_ext.hosts.core.shared_prefix.engine_core")
    report = dict(owners=sorted(owners), addon_owned=sorted(addon), pid=os.getpid())
    report["patched"] = any(h is not None and h() for h in hosts)
    report["package"] = getattr(package, "__file__", None)
    # The path's switches as this worker sees them (None: unset), its state and counters so far, and the
    # engine core's block-hash reuse where the engine core shares this worker's process (one GPU).
    report.update(shared_prefix_env=os.environ.get(SHARED_PREFIX_ENV), gather_env=os.environ.get(GATHER_ENV))
    report["shared_prefix"] = path.INSTRUMENTOR.report() if path is not None else None
    report["prefix_hashes"] = hashes.INSTRUMENTOR.report() if hashes is not None else None
    return report


def pause_shared_prefix(worker: Any, parts: list[str]) -> list[str]:
    """Runs in each worker (collective_rpc): pause those parts of the shared-prefix path in this
    process and resume the others (:mod:`scripts.bench.path_parts`); the parts paused now."""
    from scripts.bench import path_parts

    return path_parts.pause(parts)


def reset_memory_peak(worker: Any) -> None:
    """Runs in each worker (collective_rpc): forget the start-up's peak (vLLM's profile run), so that
    :func:`memory_peak` reads the workload's own."""
    import torch

    torch.cuda.reset_peak_memory_stats()


def memory_peak(worker: Any) -> dict[str, int]:
    """Runs in each worker (collective_rpc): the GPU memory this worker's PyTorch allocator peaked at
    since :func:`reset_memory_peak`, what it reserves now, the KV cache's bytes (allocated at start-up
    and held), and the device's total, all in bytes."""
    import torch

    caches = getattr(getattr(worker, "model_runner", None), "kv_caches", None) or []
    flat = caches if isinstance(caches, list) else list(caches.values())
    kv_bytes = sum(t.numel() * t.element_size() for t in flat if isinstance(t, torch.Tensor))
    _, total = torch.cuda.mem_get_info()
    peak, reserved = torch.cuda.max_memory_allocated(), torch.cuda.memory_reserved()
    return {"peak_allocated": peak, "reserved": reserved, "kv_cache": kv_bytes, "device_total": total}


def engine_kwargs(args: argparse.Namespace, **llm_options: Any) -> dict[str, Any]:
    """``LLM``'s arguments for one side (the same for every side; ``llm_options`` add to them)."""
    kwargs = dict(model=str(args.model), load_format="dummy", skip_tokenizer_init=True, seed=0)
    kwargs.update(max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens)
    kwargs.update(gpu_memory_utilization=args.gpu_mem, enforce_eager=args.eager, moe_backend="triton")
    return {**kwargs, **llm_options}


def start_engine(
    side: str,
    args: argparse.Namespace,
    extra_env: dict[str, str] | None = None,
    name: str | None = None,
    **llm_options: Any,
) -> tuple[Any, dict[str, Any]]:
    """Start one side's engine (``stock``, ``NAME`` or ``NAME@LABEL``) and check what owns its prefill.

    ``extra_env``: more of the add-on's switches for this engine's processes only; ``name``: the
    side as the run calls it (default ``side``); ``llm_options``: more arguments for ``LLM``.
    """
    from vllm import LLM

    name = name or side
    extra_env = extra_env or {}
    backend, _, label = side.partition("@")
    tree = args.trees[label] if label else None
    saved = {k: os.environ.pop(k, None) for k in (*SIDE_ENV, *extra_env, "PYTHONPATH")}
    os.environ.update(side_env(Side(backend, None if backend == "stock" else backend)))
    os.environ.update(extra_env)
    path = os.pathsep.join(filter(None, [str(tree) if tree else None, saved["PYTHONPATH"]]))
    if path:
        os.environ["PYTHONPATH"] = path
    if tree is not None:  # a spawned child takes its sys.path from this process, not from PYTHONPATH
        sys.path.insert(0, str(tree))
    if mode := extra_env.get(CUDAGRAPH_MODE_ENV):  # a side's own CUDA-graph mode (not an add-on switch)
        llm_options = {**llm_options, "compilation_config": {"cudagraph_mode": mode}}
    try:
        t0 = time.perf_counter()
        llm = LLM(**engine_kwargs(args, **llm_options))
        ready_s = time.perf_counter() - t0
    finally:
        if tree is not None:
            sys.path.remove(str(tree))
        for k, v in saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v
    reports = llm.collective_rpc(prefill_owners)
    config = llm.llm_engine.vllm_config
    scheduler = config.scheduler_config
    info = dict(ready_s=ready_s, workers=reports, max_num_batched_tokens=scheduler.max_num_batched_tokens)
    info["async_scheduling"] = getattr(scheduler, "async_scheduling", None)
    for report in reports:
        if side == "stock":
            ok = not report["patched"] and True not in report["addon_owned"]
        else:
            ok = report["patched"] and report["owners"] == [backend] and report["addon_owned"] == [True]
            if tree is not None:
                ok = ok and Path(report["package"]).parent == tree / "mla_prefill_ext"
        if not ok:
            raise SystemExit(f"side {name}: its engine reports {report}: not the side it claims to be")
    common.stamp(f"{name} ready in {ready_s:.0f} s: {json.dumps(info)}")
    return llm, info


def prepare_driver(extra_cleared: tuple[str, ...] = ()) -> None:
    """The driver's own environment: engine cores spawned (each reads the environment it is started
    with), functions allowed through collective_rpc, offline, and the add-on disabled here (no
    stamp on any engine's configuration) with its switches cleared (each side sets its own)."""
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"  # each engine core reads its own environment
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with a function
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["MLA_PREFILL_EXT_DISABLE"] = "1"  # the driver: no stamp, no patch
    for k in ("MLA_PREFILL_BACKEND", "MLA_PREFILL_BACKEND_OVERRIDES", *extra_cleared):
        os.environ.pop(k, None)


def prompts(length: int, batch: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(length)] for _ in range(batch)]


def tabulate(
    seconds: dict[str, dict[str, list[float]]],
    grid: list[tuple[int, int]],
    sides: list[str],
    pairs: list[tuple[str, str]],
) -> tuple[list[dict[str, Any]], dict[str, dict[str, float]]]:
    """Tokens/s per side and point, and the A/B ratios: of the medians, and paired (repetition i of
    every side, ``seconds[side][point][i]``, ran the same prompts back to back)."""
    table = []
    for length, batch in grid:
        point = f"{length}x{batch}"
        row: dict[str, Any] = {"point": point, "prompt_len": length, "batch": batch}
        for side in sides:
            tps = [length * batch / s for s in seconds[side][point]]
            row[side] = {"median": statistics.median(tps), "min": min(tps), "max": max(tps), "all": tps}
        for a, b in pairs:
            if a in sides and b in sides:
                row[f"{a}/{b}"] = row[a]["median"] / row[b]["median"]
                paired = [tb / ta for ta, tb in zip(seconds[a][point], seconds[b][point], strict=True)]
                row[f"{a}/{b} paired"] = statistics.median(paired)
        table.append(row)
    summary = {}
    for a, b in pairs:
        values = [row[f"{a}/{b}"] for row in table if f"{a}/{b}" in row]
        if values:
            summary[f"{a}/{b}"] = {"median_of_points": statistics.median(values), "min": min(values)}
            summary[f"{a}/{b}"]["max"] = max(values)
    return table, summary


def markdown(table: list[dict[str, Any]], sides: list[str]) -> list[str]:
    def tps(cell: dict[str, Any]) -> str:
        return f"{cell['median'] / 1e3:.0f}k ({cell['min'] / 1e3:.0f}-{cell['max'] / 1e3:.0f}k)"

    def ratios(row: dict[str, Any]) -> str:
        keys = [k for k in row if "/" in k and "paired" not in k]
        return ", ".join(f"{k} {row[k]:.3f}; {row[k + ' paired']:.3f}" for k in keys)

    columns = ["point", *(f"{s} tok/s (min-max)" for s in sides), "A/B: ratio of medians; paired"]
    rows = ([row["point"], *(tps(row[s]) for s in sides), ratios(row)] for row in table)
    return markdown_table(columns, rows)


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(__doc__)
    parser.add_argument("--model", type=Path, default=MODEL_DIR, help="model folder (config.json)")
    parser.add_argument("--eager", action="store_true", help="no torch.compile, no CUDA graphs")
    parser.add_argument("--sides", default="stock,FLASH_ATTN,FLASHINFER", help="stock and/or backend names")
    parser.add_argument("--grid", default=DEFAULT_GRID, help="prompt_len x batch points")
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions (one more untimed first)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--gpu-mem", type=float, default=0.25, help="gpu_memory_utilization per engine")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--tree", action="append", default=[], help="LABEL=DIR: an add-on for NAME@LABEL")
    compare = "FLASHINFER/FLASH_ATTN,FLASH_ATTN/stock,FLASHINFER/stock"
    parser.add_argument("--compare", default=compare, help="A/B ratios to report (of sides present)")
    args = parser.parse_args(argv)
    args.trees = {t.split("=", 1)[0]: Path(t.split("=", 1)[1]).resolve() for t in args.tree}
    sides = args.sides.split(",")
    pairs = [tuple(p.split("/", 1)) for p in args.compare.split(",")]
    grid = parse_grid(args.grid)
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]

    prepare_driver()
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engines, info = {}, {}
    for side in sides:
        engines[side], info[side] = start_engine(side, args)
    one = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    seconds: dict[str, dict[str, list[float]]] = {s: {} for s in sides}
    for rep in range(args.reps + 1):
        order = sides[rep % len(sides) :] + sides[: rep % len(sides)]
        for length, batch in grid:
            seed = (rep * 1_000_003 + length) * 131 + batch
            batch_prompts = [TokensPrompt(prompt_token_ids=p) for p in prompts(length, batch, seed, vocab)]
            for side in order:
                t = time.perf_counter()
                engines[side].generate(batch_prompts, one, use_tqdm=False)
                if rep:  # rep 0 warms every shape up
                    seconds[side].setdefault(f"{length}x{batch}", []).append(time.perf_counter() - t)
        common.stamp(f"repetition {rep}/{args.reps} done (order {order})")

    run_args = {**vars(args), "model": str(args.model), "trees": {k: str(v) for k, v in args.trees.items()}}
    record = common.record(args=run_args, engines=info, seconds=seconds)
    common.write_json(args.json, record)  # raw, written before any arithmetic on it
    table, summary = tabulate(seconds, grid, sides, pairs)
    print("\n".join(markdown(table, sides)))
    for key, s in summary.items():
        print(f"{key}: median over points {s['median_of_points']:.3f} ({s['min']:.3f}-{s['max']:.3f})")
    common.write_json(args.json, {**record, "table": table, "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
