"""A FLASHINFER engine builds or loads its prefill kernels before it reports ready, none at its first steps.

Two engine lifetimes of ``python -m scripts.bench first_request`` (``--quick --eager``): FLASHINFER, and
the same backend with no warm-up declared (``mutant_backends.FlashInferWithoutWarmup`` as CUSTOM),
which must fail the same check. The signal is FlashInfer's own: the JIT modules mapped in the
engine's worker process (``/proc/self/maps``, under FlashInfer's JIT and AOT folders) and the cache
misses of its module getters (each miss builds or loads a module), read once the engine is ready
and again after the first wave, whose long prompts prefill in chunks over their own context (the
context-chunk path: non-causal, with LSE) and partly hit the prefix cache. No timing is involved.

FlashInfer's cache is ``FLASHINFER_WORKSPACE_BASE`` when set (the GPU suite passes a pre-built
one), else a fresh folder: then the first engine compiles the kernels (about a minute on an H200).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parent.parent.parent
DOUBLES = ROOT / "scripts" / "gpu_harness" / "doubles"  # mutant_backends, by class path


def prefill_modules(report: dict) -> set[str]:
    return {m for m in report["flashinfer_modules"] if "prefill" in m}


@pytest.fixture(scope="module")
def first_wave(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("first-request")
    cache = os.environ.get("FLASHINFER_WORKSPACE_BASE") or str(tmp / "flashinfer")
    env = dict(os.environ)
    env["MLA_PREFILL_BACKEND_OVERRIDES"] = json.dumps({"CUSTOM": "mutant_backends.FlashInferWithoutWarmup"})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(DOUBLES), env.get("PYTHONPATH")]))
    out = tmp / "first-request.json"
    logs = Path(os.environ.get("MLA_FIRST_REQUEST_LOGS") or tmp / "logs")
    command = [sys.executable, "-m", "scripts.bench", "first_request", "--sides", "FLASHINFER,CUSTOM"]
    command += ["--quick", "--eager", "--flashinfer-cache", cache, "--json", str(out), "--logs", str(logs)]
    command += ["--keep-host-caches"]  # vLLM's own caches play no part in what is checked here
    proc = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    print(proc.stdout[-4000:], proc.stderr[-4000:])
    data = json.loads(out.read_text())
    sides = {side["side"]: side for side in data["sides"]}
    for name, side in sides.items():
        assert side["ok"], f"{name}: {side.get('error')} (log: {side.get('log')})"
    return sides


def test_flashinfer_engine_loads_its_prefill_kernels_before_it_is_ready(first_wave):
    side = first_wave["FLASHINFER"]
    (ready,) = side["workers_ready"]
    assert ready["owners"] == ["FLASHINFER"]
    (warmup,) = ready["warmups"]
    assert warmup["variants"] == ["new_tokens", "new_tokens_lse", "context_chunk"]
    assert (warmup["num_heads"], warmup["q_data_type"]) == (16, "bfloat16")
    assert prefill_modules(ready), (
        f"no FlashInfer prefill module mapped once ready: {ready['flashinfer_modules']}"
    )
    assert all(n == 0 for n in ready["context_chunk_wrappers"])  # no step has run yet


def test_first_context_chunk_steps_build_or_load_nothing(first_wave):
    side = first_wave["FLASHINFER"]
    (ready,), (after,) = side["workers_ready"], side["workers_after_wave"]
    assert max(after["context_chunk_wrappers"]) >= 1, "the wave ran no step with context chunks"
    assert sum(r["num_cached_tokens"] or 0 for r in side["requests"]) > 0  # and hit the prefix cache
    assert after["flashinfer_modules"] == ready["flashinfer_modules"]
    assert after["flashinfer_getter_misses"] == ready["flashinfer_getter_misses"]


def test_the_check_sees_a_backend_that_does_not_warm_up(first_wave):
    """The same backend without its warm-up: FlashInfer loads the module during the first wave."""
    side = first_wave["CUSTOM"]
    (ready,), (after,) = side["workers_ready"], side["workers_after_wave"]
    assert ready["owners"] == ["MUTANT_NO_WARMUP"] and ready["warmups"] == []
    assert not prefill_modules(ready)
    assert prefill_modules(after) - prefill_modules(ready)
    misses_before = sum(ready["flashinfer_getter_misses"].values())
    assert sum(after["flashinfer_getter_misses"].values()) > misses_before
