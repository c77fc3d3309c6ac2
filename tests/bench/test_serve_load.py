"""The serve-load benchmark's parts that run without a GPU: the server's command line (read by vLLM's own
``vllm serve`` parser), the load generator (against a loopback HTTP server, since vLLM's server cannot
start on this machine), the figures, and a side whose server cannot start.

Its numbers come from the GPU host (docs/benchmarks.md, "Load on a real `vllm serve`").
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.bench import serve_load as bench
from scripts.bench import sides as side_runner

ROOT = Path(__file__).resolve().parents[2]
BENCH = [sys.executable, "-m", "scripts.bench", "serve_load"]  # run from ROOT


def options(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"gpu_mem": 0.5, "max_num_batched_tokens": None, "eager": False, **kw})


def test_vllms_own_serve_parser_reads_the_command(monkeypatch):
    """Every flag exists in the installed vLLM's ``vllm serve`` and means what the docstring says."""
    from vllm.entrypoints.cli.serve import make_arg_parser  # the parser `vllm serve` itself builds
    from vllm.platforms import current_platform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    # vLLM's parser builds its config defaults, which ask the platform for a device type: this
    # machine's platform has none (the one lookup it lacks).
    monkeypatch.setattr(type(current_platform), "device_type", "cuda")
    parser = make_arg_parser(FlexibleArgumentParser())
    command = bench.serve_command(options(eager=True, max_num_batched_tokens=4096), 8731)
    assert command[1:4] == ["-m", "vllm.entrypoints.cli.main", "serve"]
    args = parser.parse_args(command[5:])  # after the model folder, the positional argument
    assert command[4] == str(bench.MODEL_DIR)
    assert (args.port, args.host, args.served_model_name) == (8731, "127.0.0.1", [bench.SERVED_NAME])
    assert (args.load_format, args.skip_tokenizer_init, args.enable_prefix_caching) == ("dummy", True, True)
    assert (args.moe_backend, args.enforce_eager, args.max_num_batched_tokens) == ("triton", True, 4096)
    compiled = parser.parse_args(bench.serve_command(options(), 8731)[5:])
    assert not compiled.enforce_eager and compiled.max_num_batched_tokens is None  # vLLM's own default


def test_the_warmup_lines_are_the_addons_own():
    """The pattern finds both lines the add-on's warm-up logs, as its source words them."""
    source = (ROOT / "mla_prefill_ext" / "backends" / "warmup.py").read_text()
    formats = [
        f for f in re.findall(r'"(%s: [^"]*)"', source) if "building or loading" in f or "ready in" in f
    ]
    assert len(formats) == 2, formats  # the line before the build and the one after it
    log = "\n".join(
        [
            "INFO 12-01 10:00:00 [core.py:1] Initializing engine",
            "(EngineCore pid=7) INFO [warmup.py:186] " + formats[0].replace("%s", "FLASHINFER"),
            "(EngineCore pid=7) INFO [warmup.py:221] " + formats[1].replace("%s", "FLASHINFER"),
            "INFO 12-01 10:00:02 [api_server.py:1] Starting vLLM API server",
        ]
    )
    assert [line.split("] ")[1][:27] for line in bench.warmup_lines(log)] == [
        "FLASHINFER: building or loa",
        "FLASHINFER: MLA prefill ker",
    ]


def request(i: int, latency: float, status: int = 200, first: bool = False, sent: float = 0.0) -> dict:
    record = {"index": i, "first_of_client": first, "status": status, "sent_s": sent, "latency_s": latency}
    if status == 200:
        record.update(prompt_tokens=1000, completion_tokens=8)
    return record


def raw_side(side: str, latencies: list[float], **kw) -> dict:
    return {
        "side": side,
        "ok": kw.get("ok", True),
        "launched_at": 100.0,
        "ready_wall": 100.0 + kw.get("up", 70.0),
        "flashinfer_cache_state": "cold",
        "cache_at_ready": kw.get("at_ready", []),
        "cache_after_load": kw.get("after", []),
        "requests": [request(i, t, first=i < 2, sent=float(i)) for i, t in enumerate(latencies)]
        + kw.get("extra", []),
    }


def test_the_figures_of_each_side_and_beside_stock():
    stock = raw_side("stock", [1.0, 2.0, 1.0, 2.0])
    slow = raw_side(
        "FLASHINFER",
        [60.0, 2.0, 1.0, 2.0],
        up=170.0,
        at_ready=["batch_prefill_a"],
        after=["batch_prefill_a", "batch_prefill_b"],
        extra=[request(4, 0.5, status=500)],
        ok=False,
    )
    rows = bench.summarize([stock, slow])
    assert rows[0]["errors"] == 0 and rows[0]["p99_vs_stock"] == 1.0
    assert rows[0]["load_s"] == 5.0  # first sent at 0, last answered at 3 + 2
    assert rows[0]["prompt_tokens_per_s"] == 4000 / 5.0
    fi = rows[1]
    assert (fi["errors"], fi["requests"], fi["up_after_s"]) == (1, 5, 170.0)
    assert fi["max_s"] == 60.0 and fi["first_wave_p99_s"] == pytest.approx(59.42)  # clients' first two
    assert fi["p99_vs_stock"] == pytest.approx(fi["p99_s"] / rows[0]["p99_s"])
    assert fi["modules_built_after_ready"] == ["batch_prefill_b"]  # built on a request's time
    table = "\n".join(bench.markdown(rows))
    assert "| FLASHINFER | cold | 170 s | 1 of 5 |" in table and "| batch_prefill_b |" in table
    failed = bench.summarize([{"side": "FLASH_ATTN", "ok": False, "error": "server exit status 1"}])
    assert "| FLASH_ATTN | failed: server exit status 1 |" in "\n".join(bench.markdown(failed))


def test_the_load_keeps_its_clients_busy_and_counts_errors():
    """64 clients over 200 requests on a loopback server: each request once, in flight at most 64 at a
    time, each client's first request marked, a refused request counted as an error."""
    from aiohttp import web

    seen: list[int] = []
    in_flight = peak = 0

    async def completions(request: web.Request) -> web.Response:
        nonlocal in_flight, peak
        body = await request.json()
        assert body["max_tokens"] == 8 and body["temperature"] == 0.0 and body["model"] == bench.SERVED_NAME
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        seen.append(len(body["prompt"]))
        if len(body["prompt"]) == 7:  # the one request this server refuses
            return web.json_response({"error": "no"}, status=400)
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
        return web.json_response({"choices": [{"text": ""}], "usage": usage})

    prompts = [[1] * (10 + i) for i in range(200)]
    prompts[5] = [1] * 7

    async def main() -> list[dict]:
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            return await bench.send_load(f"http://127.0.0.1:{port}/v1/completions", prompts, bench.Load(), 60)
        finally:
            await runner.cleanup()

    records = asyncio.run(main())
    assert sorted(r["index"] for r in records) == list(range(200))
    assert sorted(seen) == sorted(len(p) for p in prompts)
    assert 1 < peak <= 64
    assert sum(r["first_of_client"] for r in records) == 64
    assert [r["index"] for r in records if r["status"] != 200] == [5]
    assert all(r["prompt_tokens"] == r["prompt_len"] for r in records if r["status"] == 200)


@pytest.mark.vllm_patch  # vLLM 0.20.2's server is the one started (and refused) here
def test_a_server_that_cannot_start_is_a_failed_side_with_its_log(tmp_path):
    """On this machine vLLM's server exits at start: the side says so, the next still runs, rc 1."""
    out = tmp_path / "load.json"
    proc = subprocess.run(
        [
            *(*BENCH, "--sides", "stock,TORCH_SDPA", "--eager", "--requests", "4"),
            *("--json", str(out), "--logs", str(tmp_path / "logs"), "--side-timeout", "300"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=700,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [s["side"] for s in data["sides"]] == ["stock", "TORCH_SDPA"]
    assert all(not s["ok"] and "server exit status" in s["error"] for s in data["sides"])
    assert data["environment"]["vllm"] == "0.20.2"
    assert (tmp_path / "logs" / "stock.log").read_text()  # the server's own words, for the reader
    assert "| stock | failed: server exit status" in proc.stdout


def test_sides_past_the_deadline_are_skipped_and_warm_sides_refused(tmp_path):
    out = tmp_path / "load.json"
    proc = subprocess.run(
        [*BENCH, "--sides", "stock,FLASHINFER", "--deadline", "1", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    sides = json.loads(out.read_text())["sides"]
    assert [(s["side"], s["error"]) for s in sides] == [
        ("stock", "skipped: 0 s left before the deadline"),
        ("FLASHINFER", "skipped: 0 s left before the deadline"),
    ]
    refused = subprocess.run(
        [*BENCH, "--sides", "stock,FLASHINFER-warm"], cwd=ROOT, capture_output=True, text=True
    )
    assert refused.returncode == 2 and "every side here starts with cold caches" in refused.stderr


def test_a_side_is_what_its_server_log_shows():
    patch = "INFO [selector.py:190] Using FLASHINFER MLA prefill backend (from MLA_PREFILL_BACKEND; ...)."
    bridge = "INFO [selection.py:9] Using FLASH_ATTN MLA prefill backend (mla-prefill-ext, from ..."
    native = "(EngineCore pid=1) INFO [mla_attention.py:2267] Using FlashAttention prefill for MLA"
    auto = "INFO [selector.py:190] Using FLASH_ATTN MLA prefill backend (auto-selected; ...)."
    stock, fi, fa = side_runner.parse_sides("stock,FLASHINFER,FLASH_ATTN")
    assert bench.claim_problem(stock, native) is None
    assert bench.claim_problem(fi, patch) is None and bench.claim_problem(fa, bridge) is None
    assert "selecting ['FLASHINFER']" in bench.claim_problem(stock, patch)
    assert "not FLASH_ATTN" in bench.claim_problem(fa, patch)
    assert "selecting nothing" in bench.claim_problem(fi, native)
    assert bench.claim_problem(fa, auto) is None and "selecting" in bench.claim_problem(stock, auto)
    # The record of the H200 run passes the check it was not yet made with.
    servers = ROOT / "docs" / "results" / "h200-2026-12-01-serve-load" / "servers"  # logs kept gzipped

    def log(side: str) -> str:
        return gzip.decompress((servers / f"{side}.log.gz").read_bytes()).decode()

    assert bench.claim_problem(stock, log("stock")) is None
    assert bench.claim_problem(fi, log("FLASHINFER")) is None
