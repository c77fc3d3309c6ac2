"""A Ray cluster started beforehand, from an environment with none of the add-on's variables.

This is how a multi-node deployment looks to vLLM: ``ray start`` ran on each node
(here: one head on this host, owning both GPUs) long before the user's process, so
Ray's workers do not inherit the driver's environment. The driver joins through
``RAY_ADDRESS``; only what vLLM copies to its Ray workers reaches them. session.py starts and stops it.
"""

from __future__ import annotations

import os
import subprocess
import sys

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
