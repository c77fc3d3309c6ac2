"""Load on a real ``vllm serve`` after a fresh start: up-time, errors, throughput, latency per side.

    python -m scripts.bench serve_load [--sides stock,FLASHINFER,FLASH_ATTN] [--requests 2000]
        [--clients 64] [--eager] [--json out.json] [--logs DIR] [--cache-root DIR] [--port 8731]
        [--max-num-batched-tokens N] [--gpu-mem 0.5] [--side-timeout S] [--deadline EPOCH]

``--clients`` concurrent clients share ``--requests`` completions over loopback HTTP, each sending its
next request when its previous one is answered: first_request's prompt mix (token ids), 8 tokens out,
greedy, the same on every side. Each side is one server lifetime (``vllm serve`` on the tiny
DeepSeek-V2, dummy weights, Triton MoE), one after the other, alone on the GPU, with fresh caches of
its own; ``stock`` runs with the add-on disabled, ``NAME`` with ``MLA_PREFILL_BACKEND=NAME``. "Up after":
launch to ``/health`` answering 200. Per side: errors, prompt tokens/s, latency p50/p99/max, the first
wave's p99 (each client's first request), FlashInfer modules built after ready; the server's log must
show the side's backend. Raw results go to ``--json`` after each side. Results: docs/benchmarks.md.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from . import common
from . import sides as runner
from .workload import MAX_TOKENS, MODEL_DIR, Wave, make_wave

DEFAULT_SIDES = "stock,FLASHINFER,FLASH_ATTN"
SERVED_NAME = "tiny-deepseek-v2"
MIN_SIDE_S = 60.0  # a side given less than this before --deadline is skipped, not started
WARMUP_LINE = re.compile(r"MLA prefill kernels|building or loading the MLA prefill")


@dataclass(frozen=True)
class Load:
    """The load's shape: the issue's (2,000 requests from 64 clients, prompts as the first wave's)."""

    requests: int = 2000
    clients: int = 64
    max_tokens: int = MAX_TOKENS


# --- pure parts (unit-tested on the CPU) -----------------------------------------------------


def serve_command(args: Any, port: int) -> list[str]:
    """The server's command line for one side (the environment selects the side)."""
    command = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(MODEL_DIR)]
    command += ["--served-model-name", SERVED_NAME, "--port", str(port), "--host", "127.0.0.1"]
    command += ["--load-format", "dummy", "--skip-tokenizer-init", "--max-model-len", "16384"]
    command += ["--enable-prefix-caching", "--seed", "0", "--moe-backend", "triton"]
    command += ["--gpu-memory-utilization", str(args.gpu_mem), "--disable-log-stats"]
    if args.max_num_batched_tokens:
        command += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.eager:
        command.append("--enforce-eager")
    return command


def request_body(prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One completion: token ids in, greedy, exactly ``max_tokens`` out."""
    return dict(model=SERVED_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def side_summary(raw: dict[str, Any]) -> dict[str, Any]:
    """One side's figures from its raw record."""
    row: dict[str, Any] = {"side": raw["side"], "ok": raw.get("ok", False)}
    if "requests" not in raw:
        row["error"] = raw.get("error", "no result")
        return row
    done = [r for r in raw["requests"] if r["status"] == 200]
    latencies = [r["latency_s"] for r in done]
    first_wave = [r["latency_s"] for r in done if r["first_of_client"]]
    start = min(r["sent_s"] for r in raw["requests"])
    end = max(r["sent_s"] + r["latency_s"] for r in raw["requests"])
    row.update(
        up_after_s=raw["ready_wall"] - raw["launched_at"],
        errors=len(raw["requests"]) - len(done),
        requests=len(raw["requests"]),
        load_s=end - start,
        prompt_tokens_per_s=sum(r["prompt_tokens"] for r in done) / (end - start),
        p50_s=runner.percentile(latencies, 50) if latencies else float("nan"),
        p99_s=runner.percentile(latencies, 99) if latencies else float("nan"),
        max_s=max(latencies, default=float("nan")),
        first_wave_p99_s=runner.percentile(first_wave, 99) if first_wave else float("nan"),
        modules_at_ready=raw["cache_at_ready"],
        modules_built_after_ready=sorted(set(raw["cache_after_load"]) - set(raw["cache_at_ready"])),
        flashinfer_cache=raw["flashinfer_cache_state"],
        warmup_lines=raw.get("warmup_lines", []),
    )
    if not row["ok"]:
        row["error"] = raw.get("error", "")
    return row


def summarize(sides: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every side's figures, with its p99 and up-time next to stock's where stock ran."""
    return runner.against_stock([side_summary(raw) for raw in sides], "p99_s", ["p99_s", "first_wave_p99_s"])


COLUMNS = ["side", "FlashInfer cache", "up after", "errors", "prompt tokens/s", "latency p50", "p99", "max"]
COLUMNS += ["first wave p99", "p99 / stock", "FlashInfer modules built after ready"]


def cells(r: dict[str, Any]) -> list[str]:
    """One side's row of the table."""
    if "p99_s" not in r:
        return runner.failed_cells(r)
    up, errors = f"{r['up_after_s']:.0f} s", f"{r['errors']} of {r['requests']}"
    rate = f"{r['prompt_tokens_per_s']:,.0f}"
    times = [f"{r[k]:.2f} s" for k in ("p50_s", "p99_s", "max_s", "first_wave_p99_s")]
    ratio = f"{r['p99_vs_stock']:.2f}" if "p99_vs_stock" in r else "-"
    modules = ", ".join(r["modules_built_after_ready"]) or "none"
    return [r["side"], r["flashinfer_cache"], up, errors, rate, *times, ratio, modules]


def markdown(rows: list[dict[str, Any]]) -> list[str]:
    return runner.markdown_table(COLUMNS, map(cells, rows))


def claim_problem(side: runner.Side, log_text: str) -> str | None:
    """Why the server's log shows another prefill than the side's (None: it shows the side's).

    A backend side needs the add-on's selection line for that backend (patch and bridge both log
    ``Using NAME MLA prefill backend (``); stock needs none of the add-on's selection lines."""
    chosen = re.findall(r"Using (\S+) MLA prefill backend \((?:from|auto-selected|mla-prefill-ext)", log_text)
    if side.backend is None:
        return f"stock's log shows the add-on selecting {sorted(set(chosen))}" if chosen else None
    if set(chosen) != {side.backend}:
        return f"its log shows the add-on selecting {sorted(set(chosen)) or 'nothing'}, not {side.backend}"
    return None


def warmup_lines(log_text: str) -> list[str]:
    """The add-on's warm-up lines in a server's log (what it built, and how long that took)."""
    return [line.strip() for line in log_text.splitlines() if WARMUP_LINE.search(line)]


# --- the load ------------------------------------------------------------------------------


async def send_load(url: str, prompts: list[list[int]], load: Load, limit_s: float) -> list[dict[str, Any]]:
    """``load.clients`` clients share the prompts in order; one record per request."""
    import aiohttp  # comes with vLLM

    results: list[dict[str, Any] | None] = [None] * len(prompts)
    next_index = iter(range(len(prompts)))
    origin = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=limit_s)

    async def client(session: aiohttp.ClientSession) -> None:
        first = True
        for i in next_index:
            sent = time.perf_counter()
            record: dict[str, Any] = {"index": i, "first_of_client": first, "prompt_len": len(prompts[i])}
            first = False
            try:
                async with session.post(url, json=request_body(prompts[i], load.max_tokens)) as response:
                    body = await response.json(content_type=None)
                    record["status"] = response.status
                    if response.status == 200:
                        tokens = ("prompt_tokens", "completion_tokens")
                        record.update({k: body["usage"][k] for k in tokens})
                    else:
                        record["error"] = str(body)[:300]
            except Exception as e:  # a refused or dropped connection, a timeout: an error, counted
                record.update(status=None, error=f"{type(e).__name__}: {e}"[:300])
            results[i] = {**record, "sent_s": sent - origin, "latency_s": time.perf_counter() - sent}

    connector = aiohttp.TCPConnector(limit=load.clients)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await asyncio.gather(*(client(session) for _ in range(load.clients)))
    return [r for r in results if r is not None]


# --- one side -----------------------------------------------------------------------------


def wait_healthy(base: str, proc: subprocess.Popen, limit_s: float) -> float | None:
    """Poll ``/health`` until it answers 200: the wall time then, or None (server gone or too slow)."""
    deadline = time.time() + limit_s
    while time.time() < deadline:
        if proc.poll() is not None:
            return None
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as response:
                if response.status == 200:
                    return time.time()
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(0.25)
    return None


def run_side(
    args: Any, side: runner.Side, n: int, cache_root: Path, prompts: list[list[int]]
) -> dict[str, Any]:
    home = cache_root / f"{n}-{side.label}"
    flashinfer = home / "flashinfer"
    raw: dict[str, Any] = {"side": side.label, "backend": side.backend, "flashinfer_cache_state": "cold"}
    limit, skipped = runner.time_for_side(args, MIN_SIDE_S)
    if skipped is not None:
        raw.update(ok=False, error=skipped)
        return raw
    env = runner.process_env(side, flashinfer, home)
    log = Path(args.logs) / f"{side.label}.log" if args.logs else home / "server.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    base = f"http://127.0.0.1:{args.port}"
    started = time.time()
    raw.update(command=serve_command(args, args.port), log=str(log), launched_at=started)
    with open(log, "w") as log_file:
        proc = subprocess.Popen(raw["command"], env=env, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            ready = wait_healthy(base, proc, limit)
            if ready is None:
                gone = proc.poll() is not None
                why = f"exit status {proc.returncode}" if gone else f"not ready in {limit:.0f} s"
                raw.update(ok=False, error=f"server {why}; see {log}")
                return raw
            raw["ready_wall"] = ready
            raw["cache_at_ready"] = runner.modules_in_cache(flashinfer)
            left = limit - (time.time() - started)
            load = Load(requests=len(prompts), clients=args.clients)
            raw["requests"] = asyncio.run(send_load(f"{base}/v1/completions", prompts, load, max(left, 1.0)))
            raw.update(cache_after_load=runner.modules_in_cache(flashinfer), load=asdict(load))
            errors = sum(r["status"] != 200 for r in raw["requests"])
            raw["ok"] = errors == 0
            if errors:
                first = next(r for r in raw["requests"] if r["status"] != 200)
                raw["error"] = f"{errors} requests failed; the first: {first}"
        finally:
            runner.stop_server(proc)
    text = log.read_text(errors="replace")
    raw["warmup_lines"] = warmup_lines(text)
    problem = claim_problem(side, text)
    if problem is not None:
        raw.update(ok=False, error=f"not the side it claims to be: {problem}")
    return raw


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(__doc__)
    parser.add_argument("--sides", default=DEFAULT_SIDES, help="stock and backend names, in order")
    parser.add_argument("--requests", type=int, default=Load.requests)
    parser.add_argument("--clients", type=int, default=Load.clients)
    parser.add_argument("--max-num-batched-tokens", type=int, help="default: vLLM's own")
    parser.add_argument("--port", type=int, default=8731)
    runner.add_side_arguments(parser, side_timeout=540.0, what_logs="server")
    args = parser.parse_args(argv)
    try:
        sides = runner.parse_sides(args.sides, warm_cache_given=True)  # warm sides are refused just below
    except ValueError as e:
        parser.error(str(e))
    if any(s.warm for s in sides):
        parser.error("warm sides are first_request's: every side here starts with cold caches")
    prompts = make_wave(Wave(requests=args.requests))
    temporary = args.cache_root is None
    cache_root = Path(tempfile.mkdtemp(prefix="bench-serve-load-")) if temporary else Path(args.cache_root)
    results: list[dict[str, Any]] = []
    out: dict[str, Any] = {}
    try:
        for n, side in enumerate(sides):
            common.stamp(f"{side.label}: starting")
            raw = run_side(args, side, n, cache_root, prompts)
            results.append(raw)
            out = common.record(sides=results)
            common.write_json(args.json, out)  # raw, before any arithmetic
            state = "done" if raw.get("ok") else f"FAILED ({raw.get('error')})"
            common.stamp(f"{side.label}: {state}")
    finally:
        if temporary:
            shutil.rmtree(cache_root, ignore_errors=True)
    rows = summarize(results)
    common.write_json(args.json, {**out, "table": rows})
    print("\n".join(markdown(rows)), flush=True)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
