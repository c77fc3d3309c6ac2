"""A Ray cluster started beforehand, from an environment with none of the add-on's variables.

This is how a multi-node deployment looks to vLLM: ``ray start`` ran on each node
(here: one head on this host, owning both GPUs) long before the user's process, so
Ray's workers do not inherit the driver's environment. The driver joins through
``RAY_ADDRESS``; only what vLLM copies to its Ray workers reaches them.

    python -m scripts.gpu_harness.ray_cluster start [--pythonpath EXTRA]   # prints the address
    python -m scripts.gpu_harness.ray_cluster stop
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PORT = 6379
ADDRESS = f"127.0.0.1:{PORT}"
# What a node's own environment has: the Python installation, CUDA, a home. Nothing of ours.
KEEP = ("PATH", "HOME", "LANG", "LC_ALL", "CUDA_HOME", "MAX_JOBS", "TMPDIR", "CUDA_VISIBLE_DEVICES")


def clean_env(pythonpath: list[str]) -> dict[str, str]:
    env = {k: os.environ[k] for k in KEEP if k in os.environ}
    env["PYTHONPATH"] = os.pathsep.join(pythonpath)
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    assert not any(k.startswith("MLA_PREFILL") for k in env), env
    return env


def ray_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    # The bundle has no `ray` console script: run Ray's CLI module.
    code = "import sys; from ray.scripts.scripts import main; sys.argv = ['ray', *sys.argv[1:]]; main()"
    return subprocess.run([sys.executable, "-c", code, *args], env=env, text=True, capture_output=True)


def start(pythonpath: list[str], num_gpus: int = 2) -> str:
    flags = (f"--port={PORT}", f"--num-gpus={num_gpus}", "--disable-usage-stats", "--include-dashboard=false")
    result = ray_cli("start", "--head", *flags, env=clean_env(pythonpath))
    print(result.stdout[-2000:], result.stderr[-2000:], sep="\n", flush=True)
    if result.returncode != 0:
        raise SystemExit(f"ray start failed ({result.returncode})")
    return ADDRESS


def stop() -> None:
    result = ray_cli("stop", "--force", env=clean_env([os.environ.get("PYTHONPATH", "")]))
    print(result.stdout[-500:], result.stderr[-500:], sep="\n", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("start")
    s.add_argument("--pythonpath", action="append", default=[], help="extra entries, before the site")
    s.add_argument("--num-gpus", type=int, default=2)
    sub.add_parser("stop")
    args = parser.parse_args()
    if args.command == "stop":
        stop()
        return 0
    site = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    print(start([*args.pythonpath, *site, str(ROOT / "examples"), str(ROOT)], args.num_gpus))
    return 0


if __name__ == "__main__":
    sys.exit(main())
