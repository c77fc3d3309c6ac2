"""Host time of one step's preparation (``prepare_metadata``) per backend, on a CUDA device.

    python -m scripts.bench plan [--steps 200] [--busy-ms 2] [--json out.json]

What each backend does once per step and per metadata builder before the layers run
(FlashInfer plans its wrappers, TRT-LLM copies the chunk lengths, FLASH_ATTN builds its
kernel arguments), timed on the host with ``time.perf_counter``, in two GPU states:

* ``idle``: nothing queued on the GPU;
* ``busy``: ``--busy-ms`` of GPU work queued just before (``torch.cuda._sleep``), as under
  vLLM's async scheduling, where step N+1 is prepared while step N runs. A preparation
  that waits for the GPU anywhere shows here as about ``--busy-ms`` instead of microseconds.

and with the step's host offsets in two kinds of memory: ``pageable`` (what the add-on
attaches) and ``pinned`` (page-locked, as vLLM keeps its own host buffers). Two step shapes:
four prefills of 1024 new tokens, and the same with 4096 tokens of cached context each
in 4 chunks. Medians and 90th percentiles over ``--steps`` steps, the variants taking
turns step by step.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

from mla_prefill_ext.backends.base import context_chunks, host_query_start_loc
from mla_prefill_ext.registry import MLAPrefillBackendEnum
from mla_prefill_ext.selector import MLAPrefillSelectorConfig, current_device_capability
from mla_prefill_ext.testing.problem import make_problem

from . import common

BACKENDS = ["FLASH_ATTN", "FLASHINFER", "TRTLLM_RAGGED", "TORCH_SDPA"]
SHAPES = {"4x1024 new": ([1024] * 4, None), "4x1024 new + 4x4096 context, 4 chunks": ([1024] * 4, [4096] * 4)}


def with_host_copies(problem, memory: str):
    """A fresh metadata object per step, with the host copies the patched builder attaches."""
    import copy

    md = copy.copy(problem.metadata)
    for attr in ("query_start_loc_cpu", "mla_prefill_context_chunks"):
        md.__dict__.pop(attr, None)
    host_query_start_loc(md)
    chunks = context_chunks(md)
    if memory == "pinned":
        md.query_start_loc_cpu = md.query_start_loc_cpu.pin_memory()
        md.mla_prefill_context_chunks = [
            c._replace(cu_seq_lens_cpu=c.cu_seq_lens_cpu.pin_memory(), seq_lens=c.seq_lens.pin_memory())
            for c in chunks
        ]
    assert md.query_start_loc_cpu.is_pinned() == (memory == "pinned")
    return md


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(__doc__)
    parser.add_argument("--steps", type=int, default=200, help="timed steps per backend, shape and variant")
    parser.add_argument("--busy-ms", type=float, default=2.0, help="GPU work queued before a busy step")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("plan.py needs a CUDA device")
    # Cycles for --busy-ms, from one calibration run of torch.cuda._sleep.
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    cycles = int(10_000_000 * args.busy_ms / start.elapsed_time(end))

    capability = current_device_capability()
    config = MLAPrefillSelectorConfig.from_dims(torch.bfloat16, 128, 64, 128)
    results = []
    for name in BACKENDS:
        cls = MLAPrefillBackendEnum[name].get_class()
        reasons = cls.validate_configuration(capability, config)
        if reasons:
            print(f"{name}: skipped ({'; '.join(reasons)})", flush=True)
            continue
        backend = cls(16, 0.1147, 512, 128, 64, 128, None)
        backend.reserve_workspace(torch.device("cuda"))
        for shape, (new, ctx) in SHAPES.items():
            problem = make_problem(new, ctx, num_chunks=4 if ctx else 2, device="cuda", seed=0)
            variants = [(gpu, mem) for gpu in ("idle", "busy") for mem in ("pinned", "pageable")]
            samples: dict[tuple[str, str], list[float]] = {v: [] for v in variants}
            for step in range(args.steps + 10):
                for gpu, mem in variants:
                    md = with_host_copies(problem, mem)
                    torch.cuda.synchronize()
                    if gpu == "busy":
                        torch.cuda._sleep(cycles)
                    t = time.perf_counter()
                    backend.prepare_metadata(md)
                    spent = time.perf_counter() - t
                    if step >= 10:  # the first steps build wrappers and warm caches
                        samples[(gpu, mem)].append(spent * 1e6)
            torch.cuda.synchronize()
            for (gpu, mem), us in samples.items():
                us.sort()
                row = {
                    "backend": name,
                    "shape": shape,
                    "gpu": gpu,
                    "host_offsets": mem,
                    "median_us": statistics.median(us),
                    "p90_us": us[int(0.9 * len(us))],
                    "max_us": us[-1],
                }
                results.append(row)
                print(json.dumps(row), flush=True)
    print("\n| backend | step | GPU | pinned host offsets: median (p90) us | pageable: median (p90) us |")
    print("| --- | --- | --- | --- | --- |")
    for r in results:
        if r["host_offsets"] != "pinned":
            continue
        key = (r["backend"], r["shape"], r["gpu"], "pageable")
        other = next(o for o in results if (o["backend"], o["shape"], o["gpu"], o["host_offsets"]) == key)
        print(
            f"| {r['backend']} | {r['shape']} | {r['gpu']} (busy {args.busy_ms} ms) | "
            f"{r['median_us']:.0f} ({r['p90_us']:.0f}) | {other['median_us']:.0f} ({other['p90_us']:.0f}) |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"busy_ms": args.busy_ms, "rows": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
