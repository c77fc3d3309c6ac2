"""The engine scenarios of the GPU suite, and a driver that runs them across GPUs.

    python -m scripts.gpu_harness.scenarios --results DIR [--gpus 0,1] [--only a,b] [--bench]
        [--model-dir CKPT]

Each scenario is one engine lifetime in its own process (engine_runner.py), on the sharp checkpoint
(make_sharp_checkpoint.py, generated once into ``--model-dir``, default ``DIR/sharp-checkpoint``)
but for ``invalid-explicit``. Single-GPU scenarios run in parallel, each on the next free GPU; then
multi-GPU ones, one at a time. ``*-chunks`` and ``mutant-*``: the ``chunks`` prompt set with context
chunks of ``CONTEXT_CHUNK_TOKENS``, against ``stock-chunks`` (the mutants must fail). ``*-shared*``:
the ``shared`` prompt set (tests/gpu/test_shared_prefix.py): stock lifetimes, stock with short
extends on its prefill path (``--decode-threshold 1``), the path on, off, in chunks, compiled, and
wrong shared paths (``--shared-mutant``) that must fail. ``*-shared-decode*``: the ``shared_decode`` set,
eager (tests/gpu/test_shared_prefix_decode.py): stock lifetimes, decode rows on, wrong decode rows.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scripts.bench.common import stamp

HERE = Path(__file__).resolve().parent
RUNNER = HERE / "engine_runner.py"
MAKE_CHECKPOINT = HERE / "make_sharp_checkpoint.py"
SHARP_SEED = 0
CONTEXT_CHUNK_TOKENS = 2048
CHUNKS = ("--prompts", "chunks", "--context-chunk-tokens", str(CONTEXT_CHUNK_TOKENS), "--eager")
SHARED = ("--prompts", "shared")
SHARED_ADDON = (*SHARED, "--backend-env", "FLASH_ATTN", "--shared-evidence")
SHARED_CHUNKS = ("--context-chunk-tokens", str(CONTEXT_CHUNK_TOKENS))
SHARED_OFF = (("MLA_PREFILL_SHARED_PREFIX", "0"),)
SHARED_MUTANT = (*SHARED, "--backend-env", "FLASH_ATTN", "--shared-mutant")  # then the mutant's name
MUTANT = ("--backend-env", "CUSTOM", *CHUNKS, "--custom-class")  # then the mutant backend's class path
# Stock vLLM with short extends on its prefill path (only one-token queries are decodes), as the
# path routes them: the reference for a candidate that routes (vLLM's absorbed decode path and its
# prefill path are two computations; on the sharp checkpoint they differ beyond bf16 noise).
STOCK_PREFILL = ("--stock", *SHARED, "--decode-threshold", "1")
# The stock lifetimes whose spread a shared-prefix candidate is held to: vLLM's decode path for short
# extends (as shipped), and its prefill path (where the path on routes them).
SHARED_STOCK = ("stock-shared", "stock-shared-2")
SHARED_STOCK_PREFILL = ("stock-shared-prefill", "stock-shared-prefill-2", "stock-shared-prefill-3")
TP2 = ("--tp", "2", "--eager")
SHARED_DECODE = ("--prompts", "shared_decode", "--eager")
DECODE_ADDON = (*SHARED_DECODE, "--backend-env", "FLASH_ATTN")
DECODE_MUTANT = (*DECODE_ADDON, "--shared-decode-mutant")  # then the mutant's name
SHARED_DECODE_STOCK = ("stock-shared-decode", "stock-shared-decode-2")
# vLLM's own other decode kernel on the same rows: stock's decode is bit-identical across lifetimes, so
# their spread cannot say how far a reordered sum of the same attention lands; FlashMLA's distance can.
SHARED_DECODE_OTHER_KERNEL = "stock-shared-decode-flashmla"


@dataclass(frozen=True)
class Scenario:
    name: str
    flags: tuple[str, ...]
    gpus: int = 1
    env: tuple[tuple[str, str], ...] = ()  # extra environment of the runner

    @property
    def sharp(self) -> bool:
        """Runs on the sharp checkpoint (every scenario but those asking for dummy weights)."""
        return "dummy" not in self.flags


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
        Scenario("invalid-explicit", ("--backend-env", "TRTLLM_RAGGED", "--eager", "--weights", "dummy")),
        Scenario("stock-chunks", ("--stock", *CHUNKS)),
        Scenario("shim-fa-chunks", ("--backend-env", "FLASH_ATTN", *CHUNKS)),
        Scenario("shim-fi-chunks", ("--backend-env", "FLASHINFER", *CHUNKS)),
        Scenario("mutant-scale", (*MUTANT, "mutant_backends.ScaleOffBackend")),
        Scenario("mutant-lse2", (*MUTANT, "mutant_backends.Base2LseBackend")),
        Scenario("stock-tp2", ("--stock", "--tp", "2"), gpus=2),
        Scenario("shim-fa-tp2", ("--backend-env", "FLASH_ATTN", "--tp", "2"), gpus=2),
        Scenario("shim-fi-tp2", ("--backend-env", "FLASHINFER", "--tp", "2"), gpus=2),
        Scenario("custom-tp2", ("--custom", "--backend-env", "CUSTOM", "--tp", "2"), gpus=2),
        # The portable backend (used by the bridge's run on vLLM 0.25.1, scripts/gpu_bridge_suite.sh).
        Scenario("shim-sdpa", ("--backend-env", "TORCH_SDPA")),
        Scenario("shim-sdpa-eager", ("--backend-env", "TORCH_SDPA", "--eager")),
        # Calibration: vLLM's own prefill on FlashAttention 2 (the algorithm PyTorch's flash SDPA
        # kernel implements) against its FA3: how far two equally exact kernels of vLLM's own part.
        # Needs vLLM's FA2 library (vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so) in the GPU host's vLLM.
        Scenario("stock-fa2-eager", ("--stock", "--eager", "--flash-attn-version", "2")),
        # Shared-prefix parity (issue 27): eager but for the compiled pair.
        Scenario("stock-shared", ("--stock", *SHARED, "--eager")),
        Scenario("stock-shared-2", ("--stock", *SHARED, "--eager")),
        Scenario("stock-shared-prefill", (*STOCK_PREFILL, "--eager")),
        Scenario("stock-shared-prefill-2", (*STOCK_PREFILL, "--eager")),
        Scenario("stock-shared-prefill-3", (*STOCK_PREFILL, "--eager")),
        Scenario("stock-shared-prefill-chunks", (*STOCK_PREFILL, *SHARED_CHUNKS, "--eager")),
        Scenario("shim-fa-shared", (*SHARED_ADDON, "--eager")),
        Scenario("shim-fa-shared-2", (*SHARED_ADDON, "--eager")),
        Scenario("shim-fa-shared-off", (*SHARED_ADDON, "--eager"), env=SHARED_OFF),
        Scenario("shim-fa-shared-chunks", (*SHARED_ADDON, *SHARED_CHUNKS, "--eager")),
        Scenario("mutant-shared-other-prefix", (*SHARED_MUTANT, "other-prefix", "--eager")),
        Scenario("mutant-shared-drop-lse", (*SHARED_MUTANT, "drop-segment-lse", "--eager")),
        Scenario("mutant-shared-segment-scale", (*SHARED_MUTANT, "segment-scale", "--eager")),
        Scenario("stock-shared-prefill-compiled", STOCK_PREFILL),
        Scenario("shim-fa-shared-compiled", SHARED_ADDON),
        # Shared-prefix parity at TP=2 with vLLM's multiprocessing executor (eager; the Ray ones need a
        # cluster started beforehand: scripts/gpu_harness/session.py). Three prefill-path stock lifetimes
        # calibrate the path on (as on one GPU; two left the bound on one pair, 2026-12-04); the plain
        # stock one and its Ray twin the path off.
        Scenario("stock-shared-tp2", ("--stock", *SHARED, *TP2), gpus=2),
        Scenario("stock-shared-prefill-tp2", (*STOCK_PREFILL, *TP2), gpus=2),
        Scenario("stock-shared-prefill-tp2-2", (*STOCK_PREFILL, *TP2), gpus=2),
        Scenario("stock-shared-prefill-tp2-3", (*STOCK_PREFILL, *TP2), gpus=2),
        Scenario("shim-fa-shared-tp2", (*SHARED_ADDON, *TP2), gpus=2),
        Scenario("shim-fa-shared-off-tp2", (*SHARED_ADDON, *TP2), gpus=2, env=SHARED_OFF),
        Scenario("mutant-shared-segment-scale-tp2", (*SHARED_MUTANT, "segment-scale", *TP2), gpus=2),
        # Shared-prefix decode rows (issue 51), served only where attention runs in Python: eager.
        *[Scenario(name, ("--stock", *SHARED_DECODE)) for name in SHARED_DECODE_STOCK],
        Scenario(SHARED_DECODE_OTHER_KERNEL, ("--stock", *SHARED_DECODE, "--attention-backend", "FLASHMLA")),
        Scenario("shim-fa-shared-decode", (*DECODE_ADDON, "--shared-decode")),
        Scenario("mutant-shared-decode-other-prefix", (*DECODE_MUTANT, "other-prefix")),
        Scenario("mutant-shared-decode-drop-lse", (*DECODE_MUTANT, "drop-segment-lse")),
        Scenario("mutant-shared-decode-segment-scale", (*DECODE_MUTANT, "segment-scale")),
    ]
}
BENCH_SCENARIOS = {"stock", "shim-fa", "shim-fi"}
DECODE_SCENARIOS = [n for n in SCENARIOS if "-shared-decode" in n]
SHARED_SCENARIOS = [n for n in SCENARIOS if "-shared" in n and "-decode" not in n and SCENARIOS[n].gpus == 1]
SHARED_TP2_SCENARIOS = [n for n in SCENARIOS if "-shared" in n and SCENARIOS[n].gpus == 2]


def default_model_dir(results: Path) -> Path:
    return results / "sharp-checkpoint"


def ensure_checkpoint(model_dir: Path) -> None:
    """Generate the sharp checkpoint once (idempotent; a few seconds when already there)."""
    from . import make_sharp_checkpoint

    if make_sharp_checkpoint.is_complete(model_dir, SHARP_SEED, make_sharp_checkpoint.DEFAULT_CONFIG):
        return
    stamp(f"generating the sharp checkpoint in {model_dir}")
    subprocess.run([sys.executable, MAKE_CHECKPOINT, model_dir, "--seed", str(SHARP_SEED)], check=True)


def command(s: Scenario, results: Path, bench: bool, model_dir: Path | None = None) -> list[str]:
    cmd = [sys.executable, str(RUNNER), "--name", s.name, "--out", str(results / f"{s.name}.json"), *s.flags]
    if s.sharp:
        cmd += ["--model-dir", str(model_dir or default_model_dir(results))]
    if bench and s.name in BENCH_SCENARIOS:
        cmd.append("--bench")
    return cmd


def run_one(s: Scenario, cmd: list[str], results: Path, devices: str, pythonpath: str | None = None) -> int:
    """Run ``cmd`` (scenario ``s``) on ``devices``, its output in ``results/NAME.log``; a ``PYTHONPATH``
    of the scenario's, then ``pythonpath``, goes before the inherited one. Its exit status."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": devices, "PYTHONUNBUFFERED": "1"}
    for key, value in [*s.env, *([("PYTHONPATH", pythonpath)] if pythonpath else [])]:
        env[key] = f"{value}{os.pathsep}{env[key]}" if key == "PYTHONPATH" and env.get(key) else value
    stamp(f"start {s.name} on GPU {devices}")
    with open(results / f"{s.name}.log", "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    stamp(f"done {s.name}: rc={rc}")
    return rc


def lane(run: Callable[[str], Any], names: list[str], shared: list[str] | None = None) -> None:
    """``run`` each of ``names``, then scenarios from ``shared`` (a queue other lanes take from too) until
    it is empty."""
    for name in names:
        run(name)
    while shared:
        try:
            name = shared.pop(0)
        except IndexError:  # another lane took the last one
            return
        run(name)


def in_lanes(targets: list[tuple], stagger: float) -> None:
    """Each ``(function, *args)`` in a thread of its own, started ``stagger`` seconds apart; all joined."""
    threads = [threading.Thread(target=t[0], args=t[1:]) for t in targets]
    for t in threads:
        t.start()
        time.sleep(stagger)  # staggered starts: less contention while engines load
    for t in threads:
        t.join()


def run_all(
    names: list[str], results: Path, gpus: list[str], bench: bool, model_dir: Path | None = None
) -> None:
    """Single-GPU scenarios in parallel (each GPU runs the next one waiting), then multi-GPU ones in turn."""
    results.mkdir(parents=True, exist_ok=True)
    model_dir = model_dir or default_model_dir(results)
    if any(SCENARIOS[n].sharp for n in names):
        ensure_checkpoint(model_dir)

    def run(name: str, devices: str) -> int:
        s = SCENARIOS[name]
        return run_one(s, command(s, results, bench, model_dir), results, devices)

    queue = [n for n in names if SCENARIOS[n].gpus == 1]
    in_lanes([(lane, functools.partial(run, devices=g), [], queue) for g in gpus], stagger=0)
    for name in (n for n in names if SCENARIOS[n].gpus > 1):
        if SCENARIOS[name].gpus > len(gpus):
            stamp(f"skip {name}: needs {SCENARIOS[name].gpus} GPUs")
        else:
            run(name, ",".join(gpus[: SCENARIOS[name].gpus]))


def recorded_text(path: Path) -> str | None:
    """A recorded file's text, from ``path`` or from ``path.gz`` (how docs/results keeps raw records);
    None if there is neither."""
    if path.exists():
        return path.read_text(errors="replace")
    packed = path.with_name(path.name + ".gz")
    if packed.exists():
        return gzip.decompress(packed.read_bytes()).decode(errors="replace")
    return None


def load(results: Path, name: str) -> dict | None:
    """A scenario's result in ``results``, or None where it was not run."""
    text = recorded_text(results / f"{name}.json")
    return json.loads(text) if text is not None else None


def log_text(results: Path, name: str) -> str:
    """A scenario's engine log in ``results``."""
    text = recorded_text(results / f"{name}.log")
    if text is None:
        raise FileNotFoundError(results / f"{name}.log")
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, required=True)
    parser.add_argument("--gpus", default="0")
    parser.add_argument("--only", help="comma-separated scenario names (default: all that fit)")
    parser.add_argument("--bench", action="store_true", help="also measure prefill throughput")
    parser.add_argument(
        "--model-dir", type=Path, help="the sharp checkpoint (default: RESULTS/sharp-checkpoint)"
    )
    args = parser.parse_args()
    gpus = args.gpus.split(",")
    # The TP=2 shared-prefix set goes with its Ray half and its verdicts: session.py shared-multi.
    default = [n for n, s in SCENARIOS.items() if s.gpus <= len(gpus) and n not in SHARED_TP2_SCENARIOS]
    names = args.only.split(",") if args.only else default
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenarios {unknown}; known: {', '.join(SCENARIOS)}")
    run_all(names, args.results, gpus, args.bench, args.model_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
