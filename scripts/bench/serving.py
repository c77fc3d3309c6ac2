"""Serving: a `vllm serve` per side and lifetime, loaded by vLLM's own `vllm bench serve`.

    python -m scripts.bench serving [--sides stock,FLASH_ATTN] [--workloads bursts-32k] [--lifetimes 2]
        [--max-num-batched-tokens 8192] [--eager] [--seed 0] [--json X.json] [--cache-root DIR] [--deadline T]
        [--profile]

Per lifetime and workload, an untimed `vllm bench serve` run, then the timed one between two scrapes of
/metrics; the sides' lifetimes interleave. X.json, X.md, X-sweep.png after each. ``--profile``: each server
runs vLLM's torch profiler (``--profiler-config``), and a third run of each workload, with the client's
``--profile``, is recorded and summarized per kind of worker step (``step_profile``: host, engine core
between steps, GPU by kernel group). docs/benchmarks.md: Serving.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from . import common, serving_report, step_profile
from . import sides as runner
from .engine import MODEL_DIR
from .serving_workloads import Workload, build_tokenizer, client_command, select

SERVED_NAME = "r1-slice"
PROFILED_SEED = 1000  # the profiled runs' seeds: the workload's + this (prompts no other run sent)
MIN_LIFETIME_S = 120.0  # a lifetime given less than this before --deadline is skipped, not started
SELECTED = re.compile(r"Using (\S+) MLA prefill backend \((?:from|auto-selected|mla-prefill-ext)")


def serve_command(args: Any, traces: Path | None = None) -> list[str]:
    """The server's command line (the environment selects the side; ``traces``: vLLM's torch profiler
    writes there, when the client asks)."""
    command = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(MODEL_DIR), "--tokenizer"]
    command += [str(args.tokenizer), "--served-model-name", SERVED_NAME, "--port", str(args.port)]
    command += "--host 127.0.0.1 --load-format dummy --enable-prefix-caching --moe-backend triton".split()
    command += ["--max-model-len", "40960", "--gpu-memory-utilization", str(args.gpu_mem)]
    command += ["--max-num-batched-tokens", str(args.max_num_batched_tokens), "--seed", "0"]
    if traces is not None:
        command += ["--profiler-config", json.dumps(step_profile.profiler_config(traces))]
    return command + ["--enforce-eager"] * args.eager


def claim_problem(side: runner.Side, text: str) -> str | None:
    """What the add-on selected by the server's log, where that is not the side's backend (stock: none)."""
    chosen = set(SELECTED.findall(text))
    wanted = {side.backend} - {None}
    return None if chosen == wanted else f"its log shows the add-on selecting {sorted(chosen)}, not {wanted}"


def scrape(base: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as response:
        return serving_report.totals(response.read().decode())


def run_workload(args: Any, w: Workload, seed: int, folder: Path, env: dict, deadline: float) -> dict:
    """The untimed client run, then the timed one between two scrapes of the server's /metrics."""
    out: dict[str, Any] = {"seed": seed}
    for name, flags in ((f"{w.name}-warm", w.warm_flags), (w.name, w.flags)):
        out["metrics_before"] = scrape(args.base)  # the timed run's: the last one taken
        command = client_command(args.port, SERVED_NAME, args.tokenizer, seed, flags, folder / f"{name}.json")
        rc = runner.run_child(command, env, folder / f"{name}.log", max(deadline - time.time(), 1))
        if rc != 0:
            return {**out, "error": f"client {'out of time' if rc is None else rc}, see {folder / name}.log"}
    out.update(metrics_after=scrape(args.base), client=json.loads((folder / f"{w.name}.json").read_text()))
    if out["client"]["failed"]:
        return {**out, "error": f"{out['client']['failed']} requests failed"}
    if args.profile:
        profiled = profile_workload(args, w, seed + PROFILED_SEED, folder, env, deadline)
        out["profile" if isinstance(profiled, dict) else "error"] = profiled
    return out


def profile_workload(
    args: Any, w: Workload, seed: int, folder: Path, env: dict, deadline: float
) -> dict[str, Any] | str:
    """The workload once more, outside the figures, under the server's profiler (the client's --profile),
    at a seed of its own after its own untimed run (the timed run's prompts are cached by now): its worker
    steps summarized (``step_profile``), or what went wrong."""
    traces, before = folder / "traces", set(step_profile.traces_in(folder / "traces"))
    for name, flags in (
        (f"{w.name}-profiled-warm", w.warm_flags),
        (f"{w.name}-profiled", (*w.flags, "--profile")),
    ):
        command = client_command(args.port, SERVED_NAME, args.tokenizer, seed, flags, folder / f"{name}.json")
        rc = runner.run_child(command, env, folder / f"{name}.log", max(deadline - time.time(), 1))
        if rc != 0:
            return f"{name}: client {'out of time' if rc is None else rc}, see {folder / name}.log"
    if not (new := step_profile.new_traces(traces, before)):
        return f"{w.name}-profiled: the server wrote no trace into {traces}"
    return step_profile.summarize_files(new)


def run_lifetime(args: Any, side: runner.Side, n: int, workloads: list[Workload]) -> dict:
    """Start the side's server, wait for /health, run the workloads, stop it; what it did."""
    life: dict[str, Any] = {"side": side.label, "backend": side.backend, "lifetime": n, "workloads": {}}
    limit, skipped = runner.time_for_side(args, MIN_LIFETIME_S)
    if skipped is not None:
        return {**life, "ok": False, "error": skipped}
    (folder := Path(args.logs) / f"{n}-{side.label}").mkdir(parents=True, exist_ok=True)
    env = runner.process_env(side, args.cache_root / "flashinfer", args.cache_root)
    log, started = folder / "server.log", time.time()
    with open(log, "w") as log_file:
        command = serve_command(args, folder / "traces" if args.profile else None)
        proc = subprocess.Popen(command, env=env, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            while proc.poll() is None and time.time() < started + limit and "up_s" not in life:
                with contextlib.suppress(OSError):  # refused, reset, timed out, an error status: not up
                    urllib.request.urlopen(f"{args.base}/health", timeout=2).close()
                    life["up_s"] = time.time() - started
                time.sleep(0.25)
            for i, w in enumerate(workloads if "up_s" in life else []):
                common.stamp(f"lifetime {n} ({side.label}): {w.name}")
                done = run_workload(args, w, args.seed + i, folder, env, started + limit)
                life["workloads"][w.name] = done
                if "error" in done:
                    life["error"] = f"{w.name}: {done['error']}"
                    break
        finally:
            runner.stop_server(proc)
    if "up_s" not in life:
        return {**life, "ok": False, "error": f"server not up (exit status {proc.returncode}), see {log}"}
    if (problem := claim_problem(side, log.read_text(errors="replace"))) is not None:
        life["error"] = f"not the side it claims to be: {problem}"
    return {**life, "ok": "error" not in life}


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(__doc__)
    parser.add_argument("--sides", default="stock,FLASH_ATTN", help="stock and backend names")
    parser.add_argument(
        "--workloads", default="bursts-32k", help="presets, workload names: serving_workloads"
    )
    parser.add_argument("--lifetimes", type=int, default=2, help="server lifetimes per side, interleaved")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0, help="the first workload's --seed (the next: +1, ...)")
    parser.add_argument("--port", type=int, default=8731)
    parser.add_argument("--profile", action="store_true", help="a third run of each workload, profiled")
    runner.add_side_arguments(parser, side_timeout=1800.0, what_logs="server's and clients'")
    args = parser.parse_args(argv)
    try:
        sides, workloads = runner.parse_sides(args.sides, warm_cache_given=True), select(args.workloads)
    except ValueError as e:
        parser.error(str(e))
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as scratch:  # the caches, unless --cache-root
        args.cache_root = Path(args.cache_root or scratch)
        args.logs, args.base = args.logs or str(args.cache_root / "logs"), f"http://127.0.0.1:{args.port}"
        args.tokenizer = build_tokenizer(args.cache_root / "tokenizer", MODEL_DIR)
        order = [side for _ in range(args.lifetimes) for side in sides]
        run = common.record(args={k: str(v) for k, v in vars(args).items()}, order=[s.label for s in order])
        run.update(lifetimes=[], workloads=[{**w._asdict(), "rate": str(w.rate)} for w in workloads])
        out, rows = Path(args.json) if args.json else None, []
        for n, side in enumerate(order):
            run["lifetimes"].append(life := run_lifetime(args, side, n, workloads))
            common.stamp(f"lifetime {n} ({side.label}): {life.get('error', 'done')}")
            rows = serving_report.summarize(run["lifetimes"], [w.name for w in workloads])
            if out is not None:  # after every lifetime: a run cut short keeps what finished
                common.write_json(str(out), {**run, "table": rows})
                out.with_suffix(".md").write_text("\n".join(serving_report.markdown(rows)) + "\n")
                rates = {w.name: w.rate for w in workloads if w.name.startswith("sweep")}
                serving_report.plot_sweep(rows, rates, out.with_name(f"{out.stem}-sweep.png"))
    print("\n".join(serving_report.markdown(rows)), flush=True)
    profiles = {
        f"{life['side']} #{life['lifetime']} {name}": done["profile"]
        for life in run["lifetimes"]
        for name, done in life["workloads"].items()
        if "profile" in done
    }
    if profiles:
        print("\n".join(step_profile.profile_lines(profiles)), flush=True)
    return 0 if all(life["ok"] for life in run["lifetimes"]) else 1


if __name__ == "__main__":
    sys.exit(main())
