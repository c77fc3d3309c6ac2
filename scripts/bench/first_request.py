"""First requests after a fresh start: start-up time and first-wave latency, per backend and stock.

    python -m scripts.bench first_request [--sides stock,FLASH_ATTN,FLASHINFER,FLASHINFER-warm]
        [--quick] [--eager] [--requests N] [--max-num-batched-tokens N] [--json out.json]
        [--logs DIR] [--cache-root DIR] [--warm-cache DIR] [--flashinfer-cache DIR]
        [--keep-host-caches]

Each side (``stock``: the add-on disabled; ``NAME``: ``MLA_PREFILL_BACKEND=NAME``; ``NAME-warm``: with the
FlashInfer cache side ``NAME`` filled, or ``--warm-cache DIR``) is one ``AsyncLLM`` lifetime (the GPU
suite's tiny DeepSeek-V2, dummy weights) in a fresh process alone on the GPU, with fresh caches under
``--cache-root``. "Up after": launch to ready. First wave: ``--requests`` requests sent at once when ready,
8 tokens each, a request's latency to its last token. Each worker reports the backend owning MLA prefill,
the add-on's warm-ups and the FlashInfer modules mapped, after start-up and after the wave. Raw results
go to ``--json`` after each side. What it measures and the results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from . import common
from . import sides as runner
from .engine import prefill_owners

DEFAULT_SIDES = "stock,FLASH_ATTN,FLASHINFER,FLASHINFER-warm"
MIN_SIDE_S = 45.0  # a side given less than this before --deadline is skipped, not started
MODEL_DIR = common.ROOT / "scripts" / "gpu_harness" / "tiny_deepseek_v2"  # the GPU suite's tiny DeepSeek-V2
VOCAB = 32000
MAX_TOKENS = 8
MAPPED = "flashinfer_modules"


@dataclass(frozen=True)
class Wave:
    """The first wave's shape: how many requests, their prompt lengths, the shared prefix."""

    requests: int = 64
    min_len: int = 100
    max_len: int = 12000
    prefix_len: int = 6000
    share_every: int = 4  # every fourth request starts with the shared prefix
    seed: int = 0


QUICK_WAVE = Wave(requests=16, max_len=6000, prefix_len=3000)


def make_wave(wave: Wave) -> list[list[int]]:
    """The first wave's prompts (token ids), the same for every side."""
    rng = random.Random(wave.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(2, VOCAB) for _ in range(n)]

    prefix = tokens(wave.prefix_len)
    prompts = []
    for i in range(wave.requests):
        if i % wave.share_every == 0:
            prompts.append(prefix + tokens(rng.randint(wave.min_len, wave.max_len - wave.prefix_len)))
        else:
            prompts.append(tokens(rng.randint(wave.min_len, wave.max_len)))
    return prompts


def mapped_modules(maps: str, dirs: list[str]) -> list[str]:
    """Names of the FlashInfer modules a process has mapped, from its /proc/self/maps text."""
    found = set()
    for line in maps.splitlines():
        path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
        if path.endswith(".so") and any(path.startswith(d.rstrip("/") + "/") for d in dirs):
            found.add(Path(path).parent.name)
    return sorted(found)


def side_summary(raw: dict[str, Any]) -> dict[str, Any]:
    """One side's figures from its raw record."""
    row: dict[str, Any] = {"side": raw["side"], "ok": raw.get("ok", False)}
    if not row["ok"]:
        row["error"] = raw.get("error", "no result")
        return row
    latencies = [r["done_s"] for r in raw["requests"]]
    before, after = raw["workers_ready"], raw["workers_after_wave"]
    row.update(
        up_after_s=raw["ready_wall"] - raw["launched_at"],
        engine_s=raw["ready_wall"] - raw["engine_started_wall"],
        warmup_s=sum(w["seconds"] for report in before for w in report["warmups"]),
        p50_s=runner.percentile(latencies, 50),
        p99_s=runner.percentile(latencies, 99),
        max_s=max(latencies),
        ttft_p99_s=runner.percentile([r["first_token_s"] for r in raw["requests"]], 99),
        requests=len(latencies),
        cached_prompt_tokens=sum(r["num_cached_tokens"] or 0 for r in raw["requests"]),
        modules_loaded_in_wave=sorted(  # those a worker mapped between its two reports
            {m for a, b in zip(before, after, strict=True) for m in set(b[MAPPED]) - set(a[MAPPED])}
        ),
        modules_built=sorted(set(raw["cache_after"]) - set(raw["cache_before"])),
        flashinfer_cache=raw["flashinfer_cache_state"],
    )
    return row


def summarize(sides: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every side's figures, with its p99 and start-up next to stock's where stock ran."""
    return runner.against_stock([side_summary(raw) for raw in sides], "p99_s", ["p99_s"], ["up_after_s"])


COLUMNS = ["side", "FlashInfer cache", "up after", "of it, prefill warm-up", "first wave p50", "p99", "max"]
COLUMNS += ["p99 / stock", "FlashInfer modules loaded during the wave"]
LATENCIES = ("p50_s", "p99_s", "max_s")


def cells(r: dict[str, Any]) -> list[str]:
    """One side's row of the table."""
    if not r["ok"]:
        return [r["side"], f"failed: {r['error']}"]
    times = [f"{r['up_after_s']:.0f} s", f"{r['warmup_s']:.1f} s", *(f"{r[k]:.2f} s" for k in LATENCIES)]
    ratio = f"{r['p99_vs_stock']:.2f}" if "p99_vs_stock" in r else "-"
    return [r["side"], r["flashinfer_cache"], *times, ratio, ", ".join(r["modules_loaded_in_wave"]) or "none"]


def markdown(rows: list[dict[str, Any]]) -> list[str]:
    return runner.markdown_table(COLUMNS, map(cells, rows))


def worker_report(worker: Any) -> dict[str, Any]:
    """Runs in each worker: what owns MLA prefill, the add-on's warm-ups, FlashInfer's loaded modules."""
    import os as _os
    import sys as _sys

    owners = prefill_owners(worker)["owners"]
    warmup = _sys.modules.get("mla_prefill_ext.backends.warmup")
    warmups = [record._asdict() for record in warmup.completed()] if warmup is not None else []
    # FLASHINFER's per-builder context-chunk wrappers: one per chunk a step planned.
    groups = [g for gs in getattr(worker.model_runner, "attn_groups", []) for g in gs]
    builders = [b for g in groups for b in getattr(g, "metadata_builders", [])]
    steps = [r for b in builders for r in (getattr(b, "_mla_prefill_runners", None) or {}).values()]
    chunk_plans = [len(getattr(step, "_chunks", [])) for step in steps]
    env = _sys.modules.get("flashinfer.jit.env")
    modules, misses = [], {}
    if env is not None:
        # Resolved: the maps name the files the loader opened, links followed.
        dirs = [_os.path.realpath(env.FLASHINFER_JIT_DIR), _os.path.realpath(env.FLASHINFER_AOT_DIR)]
        with open("/proc/self/maps") as f:
            modules = mapped_modules(f.read(), dirs)
    prefill = _sys.modules.get("flashinfer.prefill")
    if prefill is not None:
        for name in dir(prefill):
            info = getattr(getattr(prefill, name), "cache_info", None)
            if name.startswith("get_") and name.endswith("_module") and callable(info):
                misses[name] = info().misses
    report = dict(pid=_os.getpid(), owners=owners, warmups=warmups, context_chunk_wrappers=chunk_plans)
    return {**report, MAPPED: modules, "flashinfer_getter_misses": misses}


async def run_side(args: argparse.Namespace) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.async_llm import AsyncLLM

    wave = QUICK_WAVE if args.quick else Wave()
    if args.requests:
        wave = Wave(**{**asdict(wave), "requests": args.requests})
    prompts = make_wave(wave)
    record: dict[str, Any] = {"engine_started_wall": time.time()}
    engine_args = dict(model=str(MODEL_DIR), load_format="dummy", skip_tokenizer_init=True, seed=0)
    engine_args.update(max_model_len=16384, max_num_batched_tokens=args.max_num_batched_tokens)
    engine_args.update(
        enable_prefix_caching=True, enforce_eager=args.eager, gpu_memory_utilization=args.gpu_mem
    )
    # Triton MoE: vLLM's automatic choice on Hopper is FlashInfer's CUTLASS MoE, whose JIT build would
    # take minutes on every side with a cold cache (not the MLA prefill path).
    engine_args.update(moe_backend="triton", disable_log_stats=True)
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args))
    try:
        record["ready_wall"] = time.time()
        record["workers_ready"] = await engine.collective_rpc(worker_report)
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, detokenize=False)

        async def one(i: int, prompt: list[int]) -> dict[str, Any]:
            start, first, final = time.perf_counter(), None, None
            async for out in engine.generate(TokensPrompt(prompt_token_ids=prompt), params, f"wave-{i}"):
                if first is None:
                    first = time.perf_counter() - start
                final = out
            assert final is not None and final.finished
            done = dict(prompt_len=len(prompt), first_token_s=first, done_s=time.perf_counter() - start)
            return {
                **done,
                "output_tokens": len(final.outputs[0].token_ids),
                "num_cached_tokens": final.num_cached_tokens,
            }

        wave_start = time.perf_counter()
        record["requests"] = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        record["wave_s"] = time.perf_counter() - wave_start
        record["workers_after_wave"] = await engine.collective_rpc(worker_report)
        record["wave"] = asdict(wave)
    finally:
        engine.shutdown()
    return record


def child_main(args: argparse.Namespace) -> int:
    record = asyncio.run(run_side(args))
    record["launched_at"] = args.launched_at
    Path(args.out).write_text(json.dumps(record))
    return 0


def check_owners(side: runner.Side, reports: list[dict[str, Any]]) -> str | None:
    """Why the side's engine is not what the side claims (None: it is)."""
    for report in reports:
        if side.backend is None:
            ok = not report["owners"]
        elif side.backend == "CUSTOM":  # a registered class, whatever get_name() it answers
            ok = len(report["owners"]) == 1 and report["owners"] != ["vLLM's own"]
        else:
            ok = report["owners"] == [side.backend]
        if not ok:
            return f"its worker reports MLA prefill owned by {report['owners']}"
    return None


def run_sides(args: argparse.Namespace, sides: list[runner.Side], cache_root: Path) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    filled: dict[str, Path] = {}  # backend -> the FlashInfer cache its cold side filled
    for n, side in enumerate(sides):
        home = cache_root / f"{n}-{side.label}"
        if side.warm:
            flashinfer = Path(args.warm_cache) if args.warm_cache else filled[side.backend]
            state = "warm"
        elif args.flashinfer_cache:
            flashinfer, state = Path(args.flashinfer_cache), "given"
        else:
            flashinfer, state = home / "flashinfer", "cold"
        if not side.warm and side.backend is not None:
            filled[side.backend] = flashinfer
        host = None if args.keep_host_caches else home
        # VLLM_ALLOW_INSECURE_SERIALIZATION: collective_rpc with worker_report.
        env = runner.process_env(side, flashinfer, host, VLLM_ALLOW_INSECURE_SERIALIZATION="1")
        out = cache_root / f"{n}-{side.label}.json"
        log = Path(args.logs) / f"{side.label}.log" if args.logs else cache_root / f"{side.label}.log"
        # The side's process runs this module again (``--child``), from the same checkout.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(common.ROOT), env.get("PYTHONPATH")]))
        command = [sys.executable, "-m", "scripts.bench", "first_request", "--child", side.label]
        command += ["--out", str(out), "--gpu-mem", str(args.gpu_mem)]
        command += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        command += ["--quick"] * args.quick + ["--eager"] * args.eager
        command += ["--requests", str(args.requests)] if args.requests else []
        raw: dict[str, Any] = {"side": side.label, "backend": side.backend, "flashinfer_cache_state": state}
        raw.update(flashinfer_cache=str(flashinfer), cache_before=runner.modules_in_cache(flashinfer))
        limit, skipped = runner.time_for_side(args, MIN_SIDE_S)
        if skipped is not None:
            raw.update(ok=False, returncode=None, error=skipped)
            results.append(raw)
            common.stamp(f"{side.label}: {raw['error']}")
            continue
        common.stamp(f"{side.label}: starting (FlashInfer cache {state})")
        raw["returncode"] = runner.run_child([*command, "--launched-at", repr(time.time())], env, log, limit)
        if raw["returncode"] is None:
            raw["error"] = f"no result within {limit:.0f} s"
        raw.update(cache_after=runner.modules_in_cache(flashinfer), log=str(log))
        if out.exists():
            raw.update(json.loads(out.read_text()))
            raw["ok"] = raw["returncode"] == 0
            problem = check_owners(side, raw["workers_ready"])
            if problem is not None:
                raw["ok"], raw["error"] = False, f"not the side it claims to be: {problem}"
        else:
            raw["ok"] = False
            raw.setdefault("error", f"exit status {raw['returncode']}; see {log}")
        results.append(raw)
        # Raw, before any arithmetic: what ran so far survives a later failure.
        common.write_json(args.json, {**header(args, sides), "sides": results})
        common.stamp(f"{side.label}: " + ("done" if raw["ok"] else f"FAILED ({raw.get('error')})"))
    return results


def header(args: argparse.Namespace, sides: list[runner.Side]) -> dict[str, Any]:
    return common.record(args=vars(args), sides_asked=[asdict(s) for s in sides])


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(__doc__)
    parser.add_argument("--sides", default=DEFAULT_SIDES, help="stock, backend names, NAME-warm")
    parser.add_argument("--quick", action="store_true", help="a smaller first wave (16 requests, shorter)")
    parser.add_argument("--requests", type=int, help="first-wave requests (default 64, --quick 16)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    runner.add_side_arguments(parser, side_timeout=480.0, what_logs="engine")
    parser.add_argument("--warm-cache", help="FlashInfer cache (a FLASHINFER_WORKSPACE_BASE) for -warm sides")
    parser.add_argument("--flashinfer-cache", help="one FlashInfer cache for every other side")
    parser.add_argument("--keep-host-caches", action="store_true", help="the host's vLLM and Triton caches")
    parser.add_argument("--child", metavar="SIDE", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--launched-at", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child_main(args)
    try:
        sides = runner.parse_sides(args.sides, warm_cache_given=bool(args.warm_cache))
    except ValueError as e:
        parser.error(str(e))
    if args.logs:
        Path(args.logs).mkdir(parents=True, exist_ok=True)
    temporary = args.cache_root is None
    cache_root = Path(tempfile.mkdtemp(prefix="bench-first-request-")) if temporary else Path(args.cache_root)
    cache_root.mkdir(parents=True, exist_ok=True)
    try:
        results = run_sides(args, sides, cache_root)
    finally:
        if temporary and not args.logs:
            print(f"caches and logs kept in {cache_root} (give --logs to keep only the logs)", flush=True)
        elif temporary:
            shutil.rmtree(cache_root, ignore_errors=True)
    rows = summarize(results)
    common.write_json(args.json, {**header(args, sides), "sides": results, "table": rows})
    print("\n".join(markdown(rows)), flush=True)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
