"""FLASHINFER's warm-up on the GPU: it loads what a real step needs and leaves nothing behind.

Each case runs in a fresh process (FlashInfer keeps the modules it loaded for the life of the
process), against FlashInfer's cache (``FLASHINFER_WORKSPACE_BASE`` when set). The signal is the
cache misses of FlashInfer's module getters: each one built or loaded a JIT module.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

STEP = textwrap.dedent(
    """
    import hashlib, json, sys
    import torch
    import flashinfer.prefill as fi
    from mla_prefill_ext.backends.base import context_chunks, host_query_start_loc
    from mla_prefill_ext.backends.flashinfer import FlashInferPrefillBackend
    from mla_prefill_ext.testing.problem import make_problem

    def misses():
        getters = [getattr(fi, n) for n in dir(fi) if n.startswith("get_") and n.endswith("_module")]
        return sum(g.cache_info().misses for g in getters if hasattr(g, "cache_info"))

    def digest(t):
        return hashlib.sha256(t.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()

    dev = torch.device("cuda")
    torch.cuda.init()
    backend = FlashInferPrefillBackend(16, 0.1147, 512, 128, 64, 128, None)
    report = {"misses_start": misses(), "memory_start": torch.cuda.memory_allocated()}
    if sys.argv[1] == "warm":
        report["seconds"] = backend.warm_up(dev, torch.bfloat16, torch.bfloat16)
        report["again"] = backend.warm_up(dev, torch.bfloat16, torch.bfloat16)
    report.update(misses_warm=misses(), memory_warm=torch.cuda.memory_allocated())
    # What the patched builder does next, and then a real step with two context chunks.
    runner = backend.clone()
    runner.reserve_workspace(dev)
    p = make_problem([300, 17, 1024], [700, 0, 2048], num_chunks=2, device="cuda", seed=3)
    host_query_start_loc(p.metadata)
    context_chunks(p.metadata)
    runner.prepare_metadata(p.metadata)
    outs = [runner.run_prefill_new_tokens(p.q, p.k, p.v, False)]
    outs += list(runner.run_prefill_new_tokens(p.q, p.k, p.v, True))
    for i in range(len(p.chunk_k)):
        outs += list(runner.run_prefill_context_chunk(i, p.q, p.chunk_k[i], p.chunk_v[i]))
    torch.cuda.synchronize()
    report.update(misses_step=misses(), digests=[digest(t) for t in outs])
    print("REPORT " + json.dumps(report))
    """
)


def run_step(mode: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", STEP, mode], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
    return json.loads(line.removeprefix("REPORT "))


@pytest.fixture(scope="module")
def reports() -> dict[str, dict]:
    return {mode: run_step(mode) for mode in ("warm", "cold")}


def test_warmup_loads_what_the_first_step_needs(reports):
    warm = reports["warm"]
    assert warm["seconds"] is not None and warm["again"] is None  # once per process and configuration
    assert warm["misses_warm"] > warm["misses_start"], "the warm-up loaded no FlashInfer module"
    assert warm["misses_step"] == warm["misses_warm"], "the first step still had to build or load a module"


def test_the_check_sees_a_step_without_warmup_load_modules(reports):
    cold = reports["cold"]
    assert cold["misses_step"] > cold["misses_warm"]


def test_warmup_leaves_no_memory_and_changes_no_result(reports):
    warm, cold = reports["warm"], reports["cold"]
    # Its clone's workspace (VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE, 394 MiB) and wrappers are gone.
    assert warm["memory_warm"] - warm["memory_start"] < 8 * 1024 * 1024, warm
    assert warm["digests"] == cold["digests"]  # bit for bit: outputs and LSEs of every variant
