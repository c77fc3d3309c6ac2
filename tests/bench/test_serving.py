"""The serving benchmark's parts on the CPU: its tokenizer, the real `vllm bench serve` reading its
workloads and writing the result JSON the report reads, vLLM's own /metrics text, the paired ratios.

No GPU here, so no `vllm serve`: the client is pointed at a small streaming endpoint that answers in the
OpenAI completions format and records the prompts it gets (what a server's prefix cache would see)."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import socket
import statistics
import threading
import time
from pathlib import Path

import pytest
import torch

from scripts.bench import serving_report as report
from scripts.bench import serving_workloads as workloads
from scripts.bench.engine import MODEL_DIR
from scripts.bench.sides import run_child

VOCAB = json.loads((MODEL_DIR / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return workloads.build_tokenizer(tmp_path_factory.mktemp("tokenizer"), MODEL_DIR)


def test_the_tokenizer_loads_from_its_folder_and_round_trips_the_model_vocabulary(tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    assert len(tokenizer) == tokenizer.vocab_size == VOCAB
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1)  # the model's config's
    ids = list(range(len(workloads.SPECIAL), VOCAB))
    random.Random(0).shuffle(ids)
    # What the client does to make a prompt of N tokens, and what the server does with it: N tokens back.
    assert tokenizer(tokenizer.decode(ids)).input_ids == ids


def write_trace(path: Path) -> None:
    """A real torch profiler trace (CPU) of two worker steps annotated as vLLM annotates them."""
    import gzip

    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for name in ("execute_context_6(600)_generation_0(0)", "execute_context_0(0)_generation_6(6)"):
            with record_function(name):
                torch.ones(8) * 2
    path.parent.mkdir(parents=True, exist_ok=True)
    plain = path.with_suffix("")
    prof.export_chrome_trace(str(plain))
    path.write_bytes(gzip.compress(plain.read_bytes()))
    plain.unlink()


class Endpoint:
    """OpenAI completions, streamed: ``max_tokens`` chunks, then the usage; each prompt kept."""

    def __init__(self, tokenizer_dir: Path) -> None:
        from transformers import AutoTokenizer

        self.tokenizer_dir, self.prompts, self.profiling = tokenizer_dir, [], []
        self.traces: Path | None = None  # where /stop_profile writes a worker's trace, as vLLM's would
        self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        threading.Thread(target=self._serve, args=(started,), daemon=True).start()
        assert started.wait(30)

    def _serve(self, started: threading.Event) -> None:
        from aiohttp import web

        async def completions(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            self.prompts.append(body["prompt"])
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for _ in range(body["max_tokens"]):
                await response.write(b'data: {"choices": [{"text": "t7 "}]}\n\n')
            usage = {"prompt_tokens": len(self.tokenizer(body["prompt"]).input_ids)}
            usage["completion_tokens"] = body["max_tokens"]
            await response.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
            return response

        async def profile(request: web.Request) -> web.Response:  # vLLM's /start_profile, /stop_profile
            self.profiling.append(request.path)
            if request.path == "/stop_profile" and self.traces is not None:
                write_trace(self.traces / f"worker.{len(self.profiling)}.pt.trace.json.gz")
            return web.Response()

        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        app.router.add_post("/start_profile", profile)
        app.router.add_post("/stop_profile", profile)
        runner = web.AppRunner(app)
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(runner.setup())
        self.loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        started.set()
        self.loop.run_forever()


# A burst: 6 requests on a 96-token shared prefix, 8 tokens of their own, 3 out.
BURST = workloads.shared("burst-test", 96, 8, 3, 6)


@pytest.fixture(scope="module")
def endpoint(tokenizer_dir) -> Endpoint:
    return Endpoint(tokenizer_dir)


def run_client(endpoint: Endpoint, folder: Path, name: str, flags: tuple[str, ...]) -> dict:
    """The real client with the benchmark's command line: the prompts the endpoint got, the result JSON."""
    endpoint.prompts.clear()
    out, log = folder / f"{name}.json", folder / f"{name}.log"
    command = workloads.client_command(endpoint.port, "m", endpoint.tokenizer_dir, 7, flags, out)
    assert run_child(command, {**os.environ, "HF_HUB_OFFLINE": "1"}, log, 300) == 0, log.read_text()[-3000:]
    # No ready check (its default): every prompt is one of the workload's.
    prompts = [endpoint.tokenizer(p).input_ids for p in endpoint.prompts]
    return {"prompts": prompts, "json": json.loads(out.read_text())}


@pytest.fixture(scope="module")
def client_runs(endpoint, tmp_path_factory) -> dict:
    """The untimed run, then the timed one, as the benchmark runs them."""
    folder = tmp_path_factory.mktemp("client")
    runs = (("warm", BURST.warm_flags), ("timed", BURST.flags))  # in serving.run_workload's order
    return {name: run_client(endpoint, folder, name, flags) for name, flags in runs}


def test_the_client_sends_the_burst_and_the_untimed_run_caches_its_prefix(client_runs):
    warm, timed = client_runs["warm"]["prompts"], client_runs["timed"]["prompts"]
    prefixes = {tuple(p[:96]) for p in timed}
    assert len(prefixes) == 1  # one prefix shared by every request
    assert {tuple(p[:96]) for p in warm} == prefixes  # and the untimed run's is the same: cached beforehand
    assert len(timed) == len(warm) == 6
    assert {len(p) for p in timed} == {96 + 8} and {len(p) for p in warm} == {96 + 1}
    assert len({tuple(p[96:]) for p in timed}) == 6  # the rest each request's own


def test_the_mix_sends_each_prefix_to_its_share_of_the_requests(endpoint, tmp_path):
    mix = workloads.mix("mix-test", 2, 40, 6, 8)
    timed = run_client(endpoint, tmp_path, "mix", mix.flags)["prompts"]
    assert len(timed) == 8 and {len(p) for p in timed} == {40 + 6}
    prefixes = [tuple(p[:40]) for p in timed]
    assert sorted(prefixes.count(p) for p in set(prefixes)) == [4, 4]


def test_the_figures_come_from_the_clients_result_json_and_the_metrics_deltas(client_runs):
    result = client_runs["timed"]["json"]
    assert (result["completed"], result["failed"], result["total_output_tokens"]) == (6, 0, 18)
    before = dict.fromkeys(report.SAMPLES, 1.0)
    after = {k: 1.0 + (6 if k.endswith("_count") else 0.6) for k in report.SAMPLES}
    after |= {report.HITS: 1.0 + 480, report.QUERIES: 1.0 + 600}
    fig = report.lifetime_figures({"client": result, "metrics_before": before, "metrics_after": after})
    assert fig["ttft_p50_ms"] == result["median_ttft_ms"] and fig["ttft_p99_ms"] == result["p99_ttft_ms"]
    assert fig["tpot_mean_ms"] == result["mean_tpot_ms"] > 0
    assert fig["requests_per_s"] == pytest.approx(6 / result["duration"])
    assert fig["engine_requests"] == 6 and fig["engine_queue_ms"] == pytest.approx(100.0)
    assert fig["prefix_hits"] == pytest.approx(0.8)
    assert fig["front_end_ttft_ms"] == pytest.approx(result["mean_ttft_ms"] - 100.0)


def test_metrics_totals_and_deltas_read_vllms_own_exposition():
    """vLLM's Prometheus logger, two engines: the totals sum over labels; the delta is the second wave's."""
    from prometheus_client import REGISTRY, generate_latest
    from vllm.v1.engine import FinishReason
    from vllm.v1.metrics import loggers, stats

    from mla_prefill_ext.testing import vllm_host

    logger = loggers.PrometheusStatLogger(vllm_host.make_vllm_config(MODEL_DIR), engine_indexes=[0, 1])

    def wave(engine: int, queued: float, ttft: float, hits: int, prefill: float = 0.5) -> None:
        done = stats.FinishedRequestStats(
            FinishReason.LENGTH, "r", e2e_latency=2.0, queued_time=queued, prefill_time=prefill
        )
        iteration = stats.IterationStats()
        iteration.finished_requests.append(done)
        iteration.time_to_first_tokens_iter.append(ttft)
        cache = stats.PrefixCacheStats(requests=1, queries=100, hits=hits)
        logger.record(stats.SchedulerStats(prefix_cache_stats=cache), iteration, engine_idx=engine)

    wave(0, queued=9.0, ttft=9.0, hits=0)  # before the workload: not in its delta
    before = report.totals(generate_latest(REGISTRY).decode())
    wave(0, queued=0.25, ttft=1.0, hits=50, prefill=0.25)
    wave(1, queued=0.75, ttft=2.0, hits=100, prefill=0.5)
    after = report.totals(generate_latest(REGISTRY).decode())
    fig = report.lifetime_figures({"client": CLIENT_JSON, "metrics_before": before, "metrics_after": after})
    assert fig["engine_requests"] == 2
    assert fig["engine_queue_ms"] == pytest.approx(500.0) and fig["engine_ttft_ms"] == pytest.approx(1500.0)
    assert fig["prefix_hits"] == pytest.approx(0.75)
    assert fig["front_end_ttft_ms"] == pytest.approx(CLIENT_JSON["mean_ttft_ms"] - 1500.0)
    # vLLM's TTFT (1.5 s) less its queue (0.5 s) and prefill (0.375 s) timers: the way in and back
    assert fig["engine_prefill_ms"] == pytest.approx(375.0) and fig["handover_ms"] == pytest.approx(625.0)


# The keys `vllm bench serve --save-result` writes that the report reads (vllm/benchmarks/serve.py,
# 0.20.2 and 0.34.0), as the client fixture's run writes them.
CLIENT_JSON = {
    "duration": 4.0,
    "completed": 64,
    "failed": 0,
    "request_throughput": 16.0,
    "output_throughput": 16.0,
    "mean_ttft_ms": 3000.0,
    "median_ttft_ms": 2900.0,
    "p99_ttft_ms": 3900.0,
    "mean_tpot_ms": 0.0,
}


def test_the_client_json_holds_every_key_the_report_reads(client_runs):
    for key in [*report.CLIENT.values(), *CLIENT_JSON]:
        assert key in client_runs["timed"]["json"], key


def lifetime(side: str, ttft: float, duration: float) -> dict:
    client = CLIENT_JSON | {"mean_ttft_ms": ttft, "duration": duration, "request_throughput": 64 / duration}
    metrics = dict.fromkeys(report.SAMPLES, 0.0)
    return {
        "side": side,
        "workloads": {"w": {"client": client, "metrics_before": metrics, "metrics_after": metrics}},
    }


def test_the_paired_ratio_is_stock_over_side_with_its_spread_over_every_pair_of_lifetimes():
    lives = [lifetime("stock", 3000, 4.0), lifetime("FLASH_ATTN", 2000, 2.0)]
    lives += [lifetime("stock", 3300, 5.0), lifetime("FLASH_ATTN", 2500, 2.5)]
    lives.append({"side": "FLASH_ATTN", "workloads": {"w": {"error": "client out of time"}}})  # not counted
    failed = lifetime("FLASH_ATTN", 100, 0.1)
    lives.append({**failed, "workloads": {"w": {**failed["workloads"]["w"], "error": "3 requests failed"}}})
    rows = {r["side"]: r for r in report.summarize(lives, ["w"])}
    side, stock = rows["FLASH_ATTN"], rows["stock"]
    assert (side["lifetimes"], stock["lifetimes"]) == (2, 2)
    assert side["ttft_mean_ms"] == 2250 and stock["duration_s"] == 4.5  # medians over lifetimes
    ttft = [3000 / 2000, 3000 / 2500, 3300 / 2000, 3300 / 2500]  # every stock lifetime against every side's
    assert side["stock/side ttft_mean_ms"] == dict(median=statistics.median(ttft), min=1.2, max=1.65)
    duration = side["stock/side duration_s"]
    assert (duration["min"], duration["max"]) == (4.0 / 2.5, 5.0 / 2.0)
    # Stock against itself: what lifetimes of one configuration differ by.
    assert stock["stock/side duration_s"] == dict(median=1.025, min=4.0 / 5.0, max=5.0 / 4.0)
    table = "\n".join(report.markdown(list(rows.values())))
    assert "| w | FLASH_ATTN | 2 |" in table and "1.410 (1.200..1.650)" in table


def test_a_side_without_stock_lifetimes_has_no_ratio():
    rows = report.summarize([lifetime("FLASH_ATTN", 2000, 2.0)], ["w"])
    assert not any(k.startswith("stock/side") for k in rows[0])


def test_the_presets_cover_the_issues_workloads():
    def flag(w: workloads.Workload, name: str) -> str:
        return w.flags[w.flags.index(name) + 1]

    bursts = workloads.select("bursts-8k,bursts-32k")
    assert {(flag(w, "--random-prefix-len"), flag(w, "--random-input-len")) for w in bursts} == {
        (p, n) for p in ("8192", "32768") for n in ("32", "128", "512")
    }
    assert [w.rate for w in workloads.select("sweep")] == [2, 4, 8, 16, 32, 64]
    assert all(flag(w, "--dataset-name") == "prefix_repetition" for w in workloads.select("mix"))
    assert {flag(w, "--random-prefix-len") for w in workloads.select("free")} == {"0"}
    assert int(flag(workloads.select("decode")[0], "--random-output-len")) >= 256
    named = [w.name for w in workloads.select("sweep-32k-4rps,sweep-low")]  # once each, first mention first
    assert named == ["sweep-32k-4rps", "sweep-32k-2rps", "sweep-32k-8rps"]
    with pytest.raises(ValueError, match="unknown workloads"):
        workloads.select("bursts-16k")


def test_the_sweep_plot_draws_the_ratio_against_the_rate(tmp_path):
    pytest.importorskip("matplotlib")
    lives = [{"side": side, "workloads": {}} for side in ("stock", "FLASH_ATTN")]
    for life, rate in itertools.product(lives, (2, 16)):
        ttft = 2000 if (life["side"], rate) == ("FLASH_ATTN", 2) else 3000
        life["workloads"][f"sweep-{rate}"] = lifetime(life["side"], ttft, 4.0)["workloads"]["w"]
    rows = report.summarize(lives, ["sweep-2", "sweep-16"])
    rates = {"sweep-2": 2, "sweep-16": 16}
    assert report.plot_sweep(rows, rates, tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    assert not report.plot_sweep([r for r in rows if r["side"] == "stock"], rates, tmp_path / "none.png")


def test_a_profiled_run_asks_the_server_to_profile_around_the_workload(endpoint, tmp_path):
    endpoint.profiling.clear()
    run = run_client(endpoint, tmp_path, "profiled", (*BURST.flags, "--profile"))
    assert endpoint.profiling == ["/start_profile", "/stop_profile"]
    assert len(run["prompts"]) == 6


def test_the_server_profiles_with_vllms_own_profiler_config(tmp_path):
    from types import SimpleNamespace

    from vllm.config import ProfilerConfig

    from scripts.bench import serving

    args = SimpleNamespace(tokenizer=tmp_path, port=1, gpu_mem=0.5, max_num_batched_tokens=8192, eager=False)
    assert "--profiler-config" not in serving.serve_command(args)
    command = serving.serve_command(args, tmp_path / "traces")
    config = ProfilerConfig(**json.loads(command[command.index("--profiler-config") + 1]))
    assert config.profiler == "torch" and config.torch_profiler_dir == str((tmp_path / "traces").resolve())
    assert config.ignore_frontend


def test_a_workload_is_profiled_at_a_seed_of_its_own_after_its_own_untimed_run(endpoint, tmp_path):
    from types import SimpleNamespace

    from scripts.bench import serving

    args = SimpleNamespace(port=endpoint.port, tokenizer=endpoint.tokenizer_dir)
    endpoint.profiling.clear()
    endpoint.prompts.clear()
    endpoint.traces = tmp_path / "traces"
    try:
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        summary = serving.profile_workload(
            args, BURST, 7 + serving.PROFILED_SEED, tmp_path, env, time.time() + 300
        )
    finally:
        endpoint.traces = None
    assert endpoint.profiling == ["/start_profile", "/stop_profile"]  # around the second run only
    warm, profiled = endpoint.prompts[:6], endpoint.prompts[6:]
    assert len(warm) == len(profiled) == 6  # its own untimed run came first
    assert profiled[0].startswith(warm[0][: len(warm[0]) // 2])  # and cached the profiled run's prefix
    assert summary["prefill"]["steps"] == 1 and summary["decode"]["steps"] == 1
    run_client(endpoint, tmp_path, "timed-again", BURST.flags)  # the figures' seed (7): other prompts
    assert not set(endpoint.prompts) & set(profiled)
