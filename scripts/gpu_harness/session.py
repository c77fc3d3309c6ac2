"""The whole GPU verification on a 2-GPU host, in two phases that each fit one sitting.

    python -m scripts.gpu_harness.session single --results DIR     # kernels + single-GPU engines
    python -m scripts.gpu_harness.session multi --results DIR      # Ray (cluster started beforehand) + TP=2
    python -m scripts.gpu_harness.session verdicts --results DIR   # the engine assertions over DIR
    python -m scripts.gpu_harness.session shared-multi --results DIR [--names a,b]
        # the shared-prefix path at TP=2, multiprocessing and Ray, one engine per GPU at a time;
        # verdicts: tests/gpu/test_shared_prefix_tp2.py

Engines run two per GPU (``--gpu-mem 0.3``) on vLLM 0.20.2; ``shared-multi`` and ``only`` one per GPU
(vLLM 0.25.1's memory profiling fails while another process on its GPU allocates). FlashInfer's
kernels JIT-compile in the kernel tests first, then its engines follow in that lane. ``multi``
starts a Ray head from an environment without the add-on's variables (ray_cluster.py), runs the Ray
scenarios against it beside the multiprocessing TP=2 ones, then the CUSTOM Ray scenario with
``--old-addon DIR`` (a previous ``mla_prefill_ext``) to show what it missed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from scripts.bench.common import stamp
from scripts.gpu_harness import ray_cluster
from scripts.gpu_harness.scenarios import (
    SCENARIOS,
    SHARED,
    SHARED_OFF,
    Scenario,
    command,
    default_model_dir,
    ensure_checkpoint,
    in_lanes,
    lane,
    run_one,
)

ROOT = Path(__file__).resolve().parents[2]
GPU_MEM = "0.3"
EXAMPLE_SITE = Path("/tmp/mla-example-site")
RAY_ENV = (("RAY_ADDRESS", ray_cluster.ADDRESS), ("RAY_DEDUP_LOGS", "0"))

SINGLE_QUEUE = (
    "stock-eager stock-chunks mutant-scale mutant-lse2 shim-fa-chunks shim-fa-eager custom-spawn "
    "example-auto stock shim-fa invalid-explicit"
).split()
FLASHINFER_LANE = ["shim-fi-eager", "shim-fi-chunks", "shim-fi"]
RAY_QUEUE = ["stock-ray", "custom-ray", "fi-ray"]
TP2_QUEUE = ["stock-tp2", "custom-tp2", "shim-fi-tp2", "shim-fa-tp2"]
# Shared-prefix parity at TP=2 (issue 27). The runner's test-only wrappers (shared-path evidence,
# vLLM's decode threshold lowered) reach forked workers only, not Ray's: the Ray runs are judged
# against the multiprocessing prefill-path lifetimes, and their workers' own log lines say which
# path they took.
SHARED_RAY_QUEUE = ["stock-shared-ray", "shim-fa-shared-ray", "shim-fa-shared-off-ray"]
SHARED_TP2_QUEUE = (
    "stock-shared-tp2 shim-fa-shared-tp2 stock-shared-prefill-tp2 shim-fa-shared-off-tp2 "
    "stock-shared-prefill-tp2-2 mutant-shared-segment-scale-tp2 stock-shared-prefill-tp2-3"
).split()

RAY = ("--executor", "ray", "--tp", "2", "--eager")
SHARED_FA = (*SHARED, "--backend-env", "FLASH_ATTN")
EXTRA = {
    s.name: s
    for s in [
        Scenario("example-auto", ("--example", "--eager"), env=(("PYTHONPATH", str(EXAMPLE_SITE)),)),
        Scenario("stock-ray", ("--stock", *RAY), gpus=2, env=RAY_ENV),
        Scenario("custom-ray", ("--custom", "--backend-env", "CUSTOM", *RAY), gpus=2, env=RAY_ENV),
        Scenario("fi-ray", ("--backend-env", "FLASHINFER", *RAY), gpus=2, env=RAY_ENV),
        Scenario("ray-old-custom", ("--custom", "--backend-env", "CUSTOM", *RAY), gpus=2, env=RAY_ENV),
        Scenario("stock-shared-ray", ("--stock", *SHARED, *RAY), gpus=2, env=RAY_ENV),
        Scenario("shim-fa-shared-ray", (*SHARED_FA, *RAY), gpus=2, env=RAY_ENV),
        Scenario("shim-fa-shared-off-ray", (*SHARED_FA, *RAY), gpus=2, env=(*RAY_ENV, *SHARED_OFF)),
    ]
}
ALL = {**SCENARIOS, **EXTRA}


def run_scenario(name: str, results: Path, devices: str, extra_pythonpath: str | None = None) -> int:
    cmd = [*command(ALL[name], results, False, default_model_dir(results)), "--gpu-mem", GPU_MEM]
    if name in TP2_QUEUE and "--eager" not in cmd:
        cmd.append("--eager")  # start-up time: the compiled path is covered on one GPU
    return run_one(ALL[name], cmd, results, devices, extra_pythonpath)


def on(devices: str, results: Path) -> Callable[[str], int]:
    """A lane's runner: each scenario by name on ``devices``."""
    return lambda name: run_scenario(name, results, devices)


def in_ray_cluster(names: list[str], results: Path, old_addon: Path | None = None) -> None:
    """``names`` against a Ray head started for them (``old_addon`` first on its path), stopped after."""
    site = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    first = [str(old_addon)] if old_addon else []
    ray_cluster.stop()
    ray_cluster.start([*first, *site, str(ROOT / "examples"), str(ROOT)])
    try:
        for name in names:
            run_scenario(name, results, "0,1", *([str(old_addon)] if old_addon else []))
    finally:
        ray_cluster.stop()


def shell(cmd: str, log: Path, devices: str) -> int:
    stamp(f"start {cmd} on GPU {devices}")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": devices, "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as f:
        rc = subprocess.call(cmd, shell=True, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    stamp(f"done {log.name}: rc={rc}")
    return rc


def single(results: Path) -> None:
    ensure_checkpoint(default_model_dir(results))
    pip = f"{sys.executable} -m pip install -q --no-deps --no-build-isolation --no-index"
    pip += f" --target {EXAMPLE_SITE}"
    shell(f"{pip} examples/mla_prefill_example_backend", results / "example-install.log", "0")
    shared = list(SINGLE_QUEUE)
    warm = threading.Event()
    pytest = f"{sys.executable} -m pytest -q -rs"

    def kernels() -> None:
        # FlashInfer's fa3 prefill JIT (about a minute) happens here, once, before any engine uses it.
        shell(f"{pytest} tests/gpu/test_kernels.py -k bitwise", results / "flashinfer-warmup.log", "1")
        warm.set()
        tests = "tests/gpu/test_kernels.py tests/gpu/test_no_sync.py tests/testing/test_conformance.py"
        tests += "::test_builtin_backends_conform_on_gpu"
        shell(f"{pytest} {tests} --junitxml={results}/kernels.xml", results / "kernels.log", "1")

    def flashinfer_lane() -> None:
        warm.wait()
        lane(on("1", results), FLASHINFER_LANE, shared)

    lanes = [(lane, on(g, results), [], shared) for g in ("0", "0", "1")]
    in_lanes([(kernels,), *lanes, (flashinfer_lane,)], stagger=3)


def multi(results: Path, old_addon: Path | None) -> None:
    def ray_lane() -> None:
        in_ray_cluster(RAY_QUEUE, results)
        if old_addon is not None:
            in_ray_cluster(["ray-old-custom"], results, old_addon)

    in_lanes([(ray_lane,), (lane, on("0,1", results), TP2_QUEUE)], stagger=5)


def only(results: Path, names: list[str]) -> None:
    """Run scenarios one engine per GPU: single-GPU ones side by side, then multi-GPU ones alone, then
    the Ray ones against a cluster started for them (vLLM 0.25.1's memory profiling fails while another
    process on its GPU allocates or frees: "Error in memory profiling", "No available memory")."""
    ensure_checkpoint(default_model_dir(results))
    shared = [n for n in names if ALL[n].gpus == 1]
    in_lanes([(lane, on(g, results), [], shared) for g in ("0", "1")], stagger=3)
    ray = [n for n in names if "RAY_ADDRESS" in dict(ALL[n].env)]
    for name in (n for n in names if ALL[n].gpus > 1 and n not in ray):
        run_scenario(name, results, "0,1")
    if ray:
        in_ray_cluster(ray, results)


def verdicts(results: Path) -> int:
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-s", "tests/gpu/test_engine.py"]
    command.append(f"--junitxml={results}/engine.xml")
    return subprocess.call(command, env={**os.environ, "MLA_GPU_RESULTS": str(results)}, cwd=ROOT)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=["single", "multi", "only", "verdicts", "shared-multi"])
    parser.add_argument(
        "--names", default="", help="for 'only' and 'shared-multi': comma-separated scenario names"
    )
    parser.add_argument("--results", type=Path, required=True)
    parser.add_argument("--old-addon", type=Path, help="folder holding the previous mla_prefill_ext")
    args = parser.parse_args()
    args.results.mkdir(parents=True, exist_ok=True)
    names = [n for n in args.names.split(",") if n]
    if args.phase == "single":
        single(args.results)
    elif args.phase == "multi":
        multi(args.results, args.old_addon)
    elif args.phase in ("only", "shared-multi"):  # shared-multi: the shared-prefix path at TP=2 by default
        default = [*SHARED_TP2_QUEUE, *SHARED_RAY_QUEUE] if args.phase == "shared-multi" else []
        only(args.results, names or default)
    else:
        return verdicts(args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
