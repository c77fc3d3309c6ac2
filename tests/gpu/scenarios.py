"""The engine scenarios of the GPU suite, and a driver that runs them across GPUs.

    python -m tests.gpu.scenarios --results DIR [--gpus 0,1] [--only a,b] [--bench]

Each scenario is one engine lifetime in its own process (tests/gpu/engine_runner.py);
single-GPU scenarios are spread over the listed GPUs, TP=2 ones take two.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

RUNNER = Path(__file__).resolve().parent / "engine_runner.py"


@dataclass(frozen=True)
class Scenario:
    name: str
    flags: tuple[str, ...]
    gpus: int = 1


SCENARIOS = {
    s.name: s
    for s in [
        Scenario("stock", ("--stock",)),
        Scenario("shim-fa", ("--backend-env", "FLASH_ATTN")),
        Scenario("shim-fi", ("--additional", "FLASHINFER")),
        Scenario("stock-eager", ("--stock", "--eager")),
        Scenario("shim-fa-eager", ("--backend-env", "FLASH_ATTN", "--eager")),
        Scenario("shim-fi-eager", ("--backend-env", "FLASHINFER", "--eager")),
        Scenario("custom-spawn", ("--custom", "--spawn", "--backend-env", "CUSTOM", "--eager")),
        Scenario("invalid-explicit", ("--backend-env", "TRTLLM_RAGGED", "--eager")),
        Scenario("stock-tp2", ("--stock", "--tp", "2"), gpus=2),
        Scenario("shim-fa-tp2", ("--backend-env", "FLASH_ATTN", "--tp", "2"), gpus=2),
        Scenario("shim-fi-tp2", ("--backend-env", "FLASHINFER", "--tp", "2"), gpus=2),
        Scenario("custom-tp2", ("--custom", "--backend-env", "CUSTOM", "--tp", "2"), gpus=2),
    ]
}
BENCH_SCENARIOS = {"stock", "shim-fa", "shim-fi"}


def command(s: Scenario, results: Path, bench: bool) -> list[str]:
    cmd = [sys.executable, str(RUNNER), "--name", s.name, "--out", str(results / f"{s.name}.json"), *s.flags]
    if bench and s.name in BENCH_SCENARIOS:
        cmd.append("--bench")
    return cmd


def run_all(names: list[str], results: Path, gpus: list[str], bench: bool) -> None:
    """Single-GPU scenarios in parallel (one per GPU), then multi-GPU ones in turn."""
    results.mkdir(parents=True, exist_ok=True)
    single = [SCENARIOS[n] for n in names if SCENARIOS[n].gpus == 1]
    multi = [SCENARIOS[n] for n in names if SCENARIOS[n].gpus > 1]
    queues = {g: [s for i, s in enumerate(single) if i % len(gpus) == k] for k, g in enumerate(gpus)}
    running: dict[str, subprocess.Popen] = {}

    def start(s: Scenario, devices: str) -> subprocess.Popen:
        log = open(results / f"{s.name}.log", "w")
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": devices, "PYTHONUNBUFFERED": "1"}
        print(f"[{time.strftime('%H:%M:%S')}] start {s.name} on GPU {devices}", flush=True)
        return subprocess.Popen(command(s, results, bench), stdout=log, stderr=subprocess.STDOUT, env=env)

    while any(queues.values()) or running:
        for g in gpus:
            if g not in running and queues[g]:
                running[g] = start(queues[g].pop(0), g)
        for g, proc in list(running.items()):
            if proc.poll() is not None:
                print(f"[{time.strftime('%H:%M:%S')}] done on GPU {g}: rc={proc.returncode}", flush=True)
                del running[g]
        time.sleep(1)
    for s in multi:
        proc = start(s, ",".join(gpus[: s.gpus]))
        proc.wait()
        print(f"[{time.strftime('%H:%M:%S')}] done {s.name}: rc={proc.returncode}", flush=True)


def load(results: Path, name: str) -> dict | None:
    path = results / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, required=True)
    parser.add_argument("--gpus", default="0")
    parser.add_argument("--only", help="comma-separated scenario names (default: all that fit)")
    parser.add_argument("--bench", action="store_true", help="also measure prefill throughput")
    args = parser.parse_args()
    gpus = args.gpus.split(",")
    names = args.only.split(",") if args.only else [n for n, s in SCENARIOS.items() if s.gpus <= len(gpus)]
    run_all(names, args.results, gpus, args.bench)
    return 0


if __name__ == "__main__":
    sys.exit(main())
