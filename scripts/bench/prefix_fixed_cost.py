"""Where a ``generate`` call of requests over a cached prefix spends its time, on a GPU, by function.

    python -m scripts.bench prefix_fixed_cost [--requests 16] [--prefix 32768]
        [--new 1] [--reps 5] [--eager] [--top 40] [--gpu-mem 0.5] [--side stock|NAME] [--kernels]
        [--trace DIR] [--json out.json]

The engine benchmark (``shared_prefix_engine``) finds that 16 requests over a cached 32k prefix cost
about 0.17 s per call more than 16 fresh prompts even with one new token each, on stock vLLM and the
add-on alike. This run attributes that time, on stock vLLM by default (the add-on disabled) or on the
add-on (``--side``). One engine (the R1 slice, dummy weights, prefix caching
on, ``max_num_batched_tokens=8192``), with vLLM's engine core in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so that one profiler sees the driver's input processing, the
core's request creation and block hashing, the scheduler, the model runner and the waits on the GPU.
Two cases with the same request count and new tokens: ``shared`` (``--prefix`` tokens cached and
shared, then ``--new`` tokens of each request's own, new every repetition) and ``fresh`` (the new
tokens alone). Per case: ``--reps`` timed calls (``time.perf_counter`` around ``LLM.generate``, after
one untimed), then one call under ``cProfile``; printed and in the JSON: the timed seconds, the
profiled call's total, its ``--top`` functions by own time, and the cumulative time of the functions
named in ``WATCH`` (what the request's path through vLLM is known to do per token or per block).

``--side FLASH_ATTN`` (any backend name) runs the add-on instead, its shared-prefix path as set (the
engine core in this process: the switches are this process's, set before vLLM loads its plugins);
``--kernels`` profiles one more call per case with ``torch.profiler`` and lists the CUDA kernels by
total time, next to that call's wall time (how much of it the GPU was busy, and with what);
``--trace DIR`` also writes that call's Chrome trace (``DIR/CASE.json.gz``) and prints where the
GPU sat idle and what the host did meanwhile (``gpu_timeline``).

The profiler slows Python code several times over, more than the GPU's waits; the profiled shares
point at where the time goes, the timed calls (without it) say how much there is. In-process is not
how ``LLM`` runs by default (its engine core is a separate process, which overlaps request creation
with the driver's input processing), so these totals are an upper bound on the default's host part.
"""

from __future__ import annotations

import cProfile
import gzip
import io
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from . import common, engine, gpu_timeline

# Functions whose cumulative time the run reports by name (a substring of "file:line(function)"):
# the per-request work that grows with the prompt's length.
WATCH = (
    "process_inputs",  # driver: the prompt's rendering and validation
    "add_request",  # driver and core: every add_request on the way
    "encode",  # msgpack of the requests and outputs
    "decode",
    "from_engine_core_request",  # core: the Request with its block hashes
    "request_block_hasher",
    "hash_block_tokens",
    "get_computed_blocks",  # scheduler: the prefix-cache lookup
    "allocate_slots",
    "schedule",
    "update_from_output",
    "free",
    "execute_model",  # runner: inputs, the forward pass, sampling
    "_update_states",
    "_prepare_inputs",
    "sample_tokens",
    "synchronize",
    "tolist",
    "process_outputs",
)


def make_parser():
    parser = common.parser(__doc__)
    parser.add_argument("--model", type=Path, default=engine.MODEL_DIR, help="model folder (config.json)")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prefix", type=int, default=32768, help="the shared cached prefix's tokens")
    parser.add_argument("--new", type=int, default=1, help="each request's own new tokens")
    parser.add_argument("--reps", type=int, default=5, help="timed calls per case (one untimed first)")
    parser.add_argument("--eager", action="store_true", help="no torch.compile, no CUDA graphs")
    parser.add_argument("--top", type=int, default=40, help="functions listed by own time")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-model-len", type=int, default=40960)
    parser.add_argument("--gpu-mem", type=float, default=0.5, help="gpu_memory_utilization")
    parser.add_argument("--side", default="stock", help="stock, or the add-on with this backend")
    parser.add_argument("--kernels", action="store_true", help="one more call per case under torch.profiler")
    parser.add_argument(
        "--trace",
        type=Path,
        help="with --kernels: write each case's profiler trace here (CASE.json.gz) and summarize its "
        "GPU idle gaps (gpu_timeline)",
    )
    parser.add_argument("--json", help="write the results here")
    return parser


def kernel_rows(events: Any, top: int) -> tuple[float, list[dict[str, Any]]]:
    """(total CUDA kernel seconds, the ``top`` kernels by total time) of ``torch.profiler``'s averages.

    Only device-side events (kernels, memcpy, memset) count: a CPU op also carries the device time of
    the kernels it launched (``aten::mm`` and its GEMM kernel), which would count them twice."""
    rows = []
    for e in events:
        if str(getattr(e, "device_type", "")).endswith("CPU"):
            continue
        field = "self_device_time_total" if hasattr(e, "self_device_time_total") else "self_cuda_time_total"
        seconds = getattr(e, field, 0.0) / 1e6  # kernels, memcpy and memset alike: device time
        if seconds > 0:
            rows.append({"kernel": e.key[:120], "calls": e.count, "seconds": seconds})
    rows.sort(key=lambda r: r["seconds"], reverse=True)
    return sum(r["seconds"] for r in rows), rows[:top]


def profile_rows(stats: pstats.Stats, top: int) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """The ``top`` functions by own time, and the cumulative seconds of each ``WATCH`` name (the
    largest entry whose description holds it, so that recursion and wrappers are not added twice).
    The watched entries nest (``add_request`` holds the block hasher): they overlap, they do not add up."""
    entries = []
    for (filename, line, name), (_, calls, own, cumulative, _) in stats.stats.items():
        where = f"{Path(filename).name}:{line}({name})"
        entries.append({"function": where, "calls": calls, "own_s": own, "cumulative_s": cumulative})
    by_own = sorted(entries, key=lambda e: e["own_s"], reverse=True)[:top]
    watched = {}
    for key in WATCH:
        # "file:line(name)" for Python functions, "~:0(<method 'name' of ...>)" for C methods.
        names = (f"({key}", f"{key})", f"'{key}'")
        hits = [e["cumulative_s"] for e in entries if any(n in e["function"] for n in names)]
        watched[key] = max(hits, default=0.0)
    return by_own, watched


def write_trace(prof: Any, path: Path) -> dict[str, Any]:
    """Export ``prof``'s Chrome trace to ``path`` (gzipped) and summarize its GPU idle gaps."""
    import tempfile

    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(plain))
        raw = plain.read_bytes()
    path.write_bytes(gzip.compress(raw, 6))
    return gpu_timeline.summarize(gpu_timeline.load(path))


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.trace is not None and not args.kernels:
        parser.error("--trace writes the --kernels call's trace: give --kernels too")
    args.trees = {}
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    engine.prepare_driver()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # one process: one profiler sees it all
    if args.side != "stock":  # the engine core is this process: the add-on's switches stay set here
        os.environ.update(engine.side_env(args.side))
        os.environ.pop("MLA_PREFILL_EXT_DISABLE", None)
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm, info = engine.start_engine(args.side, args, enable_prefix_caching=True)
    params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    prefix = common.seeded_tokens("prefix-fixed-cost/prefix", args.prefix, vocab)
    llm.generate([TokensPrompt(prompt_token_ids=prefix)], params, use_tqdm=False)  # cached from here on

    def prompts(case: str, rep: int) -> list[Any]:
        head = prefix if case == "shared" else []
        return [
            TokensPrompt(
                prompt_token_ids=[*head, *common.seeded_tokens(f"{case}/{rep}/{i}", args.new, vocab)]
            )
            for i in range(args.requests)
        ]

    results: dict[str, Any] = {}
    for case in ("shared", "fresh"):
        seconds, cached = [], []
        for rep in range(args.reps + 1):
            batch = prompts(case, rep)
            t = time.perf_counter()
            outputs = llm.generate(batch, params, use_tqdm=False)
            if rep:
                seconds.append(time.perf_counter() - t)
                cached.append(sum(o.num_cached_tokens or 0 for o in outputs))
        batch = prompts(case, args.reps + 1)
        profiler = cProfile.Profile()
        t = time.perf_counter()
        profiler.enable()
        llm.generate(batch, params, use_tqdm=False)
        profiler.disable()
        profiled = time.perf_counter() - t
        stats = pstats.Stats(profiler, stream=io.StringIO())
        by_own, watched = profile_rows(stats, args.top)
        kernels = None
        if args.kernels:
            import torch
            from torch.profiler import ProfilerActivity, profile

            batch = prompts(case, args.reps + 2)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                t = time.perf_counter()
                llm.generate(batch, params, use_tqdm=False)
                torch.cuda.synchronize()
                wall = time.perf_counter() - t
            busy, rows = kernel_rows(prof.key_averages(), args.top)
            kernels = {"wall_s": wall, "kernel_s": busy, "top": rows}
            if args.trace is not None:
                kernels["timeline"] = write_trace(prof, args.trace / f"{case}.json.gz")
        results[case] = {
            "seconds": seconds,
            "median_s": statistics.median(seconds),
            "cached_tokens": cached,
            "profiled_s": profiled,
            "top_by_own_time": by_own,
            "watched_cumulative_s": watched,
            "kernels": kernels,
        }
        print(
            f"{case}: {args.requests} x ({args.prefix if case == 'shared' else 0} cached + {args.new} new): "
            f"median {statistics.median(seconds):.3f} s [{min(seconds):.3f}-{max(seconds):.3f}], "
            f"cached tokens {cached}; profiled call {profiled:.3f} s",
            flush=True,
        )
        for e in by_own[:25]:
            print(
                f"  own {e['own_s']:.4f} s  cum {e['cumulative_s']:.4f} s  x{e['calls']:<6} {e['function']}"
            )
        print(
            "  watched (cumulative s): " + ", ".join(f"{k} {v:.4f}" for k, v in watched.items()), flush=True
        )
        if kernels is not None:
            print(
                f"  kernels (torch.profiler call, {kernels['wall_s']:.3f} s wall): CUDA kernels "
                f"{kernels['kernel_s']:.4f} s in all",
                flush=True,
            )
            for r in kernels["top"][:20]:
                print(f"    {r['seconds']:.4f} s  x{r['calls']:<6} {r['kernel']}")
            if "timeline" in kernels:
                print("\n".join("  " + line for line in gpu_timeline.lines(kernels["timeline"])), flush=True)
    common.write_json(
        args.json,
        common.record(
            args={**vars(args), "model": str(args.model), "trace": args.trace and str(args.trace)},
            engine=info,
            **results,
        ),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
