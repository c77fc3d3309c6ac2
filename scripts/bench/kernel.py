"""Kernel level: each backend's TFLOP/s next to the same kernel called directly, and the fastest per shape.

    python -m scripts.bench kernel [--json out.json] [--plot out.png] [--quick] [--rounds 5]
        [--backends FLASH_ATTN,FLASHINFER,TORCH_SDPA] [--dims r1|non-r1|all] [--device auto|cuda|cpu]
        [--shapes 1x1024,8x2048] [--heads 16] [--with-lse]

Each backend's ops after prepare_metadata next to its own kernel called with the arguments it
prepared, timed as ``mla-prefill-ext bench`` times (``mla_prefill_ext.bench.timing``), the two
interleaved round by round, median of the rounds; then per shape the fastest backend and automatic
selection's pick. On a CPU: one smoke-sized case (the script, not the numbers). ``--shapes`` /
``--heads`` replace the grid's (SEQSxNEW, one context chunk as long as the new tokens each);
``--with-lse`` adds ``new_tokens_lse``, the new tokens with their LSE as a step with context calls
them. Tables and plot from a run's log: kernel_report. Results: docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from typing import Any

from mla_prefill_ext.bench import timing

from . import common
from .kernel_tables import NON_R1, R1, fastest_per_shape, plot

KERNEL_BACKENDS = "FLASH_ATTN,FLASHINFER,TORCH_SDPA"


def parse_grid_shapes(text: str) -> list[list[int]]:
    """--shapes: ``SEQSxNEW`` items, comma-separated, as each case's new-token lengths."""
    out = []
    for item in text.split(","):
        seqs, _, new = item.strip().partition("x")
        if not (seqs.isdigit() and new.isdigit()) or min(int(seqs), int(new)) < 1:
            raise ValueError(f"{item!r}: expected SEQSxNEW, e.g. 8x2048")
        out.append([int(new)] * int(seqs))
    return out


def kernel_grid(quick: bool, device: str, dims_choice="all", shapes=None, heads_choice=(16, 128)) -> list:
    """The cases: each of ``singles`` one sequence, each of ``batches`` one step, per dims and heads."""
    if device == "cpu":  # a smoke-sized case: the script itself, not the numbers
        return [{"dims": R1, "heads": 2, "new": [64], "ctx": [64]}]
    singles = [512, 1024, 2048, 4096, 8192, 16384, 32768]
    batches = [[128] * 64, [512] * 32, [2048] * 8]
    if quick:
        singles, batches = [512, 4096, 16384], [[128] * 64]
    if shapes is not None:
        singles, batches = [], shapes
    dims = {"r1": (R1,), "non-r1": (NON_R1,), "all": (R1, NON_R1)}[dims_choice]
    steps = [[n] for n in singles] + list(batches)
    # One case: sequences of ``new`` new tokens, each with one context chunk as long as them.
    return [
        {"dims": d, "heads": heads, "new": list(new), "ctx": list(new)}
        for d in dims
        for heads in heads_choice
        for new in steps
    ]


def case_fields(case: dict[str, Any]) -> dict[str, Any]:
    """A case as its rows name it: dims, heads and shape (``SEQSxNEW``)."""
    return {
        "dims": list(case["dims"]),
        "heads": case["heads"],
        "shape": f"{len(case['new'])}x{case['new'][0]}",
    }


def bare_kernels(name: str, backend: Any, p: Any, chunk_q_k_v: tuple) -> dict[str, Any]:
    """The backend's kernel called directly with the arguments the prepared backend holds (its kernel
    kwargs, its planned FlashInfer wrappers): the backend's call against its own kernel call."""
    import copy
    import functools

    import torch

    if name == "FLASH_ATTN":
        from vllm.vllm_flash_attn import flash_attn_varlen_func

        fa = functools.partial(flash_attn_varlen_func, fa_version=backend.fa_version)
        if backend.requires_v_padding:  # the kernel needs V at the qk head dim here
            pad = p.q.shape[-1] - p.v.shape[-1]
            p = copy.copy(p)
            p.v = torch.nn.functional.pad(p.v, [0, pad])
            chunk_q_k_v = (*chunk_q_k_v[:2], torch.nn.functional.pad(chunk_q_k_v[2], [0, pad]))
        # The backend's own per-step kwargs (built in prepare_metadata): the same arguments.
        new_kw, ctx_kw = backend._new_tokens_kwargs, backend._context_chunk_kwargs(0)
        return {
            "new_tokens": lambda: fa(q=p.q, k=p.k, v=p.v, **new_kw, return_softmax_lse=False),
            "new_tokens_lse": lambda: fa(q=p.q, k=p.k, v=p.v, **new_kw, return_softmax_lse=True),
            "context_chunk": lambda: fa(
                q=chunk_q_k_v[0], k=chunk_q_k_v[1], v=chunk_q_k_v[2], **ctx_kw, return_softmax_lse=True
            ),
        }
    if name == "FLASHINFER":
        # The wrappers the backend planned (its own instances): run them directly.
        return {
            "new_tokens": lambda: backend._main.run(p.q, p.k, p.v, return_lse=False),
            "new_tokens_lse": lambda: backend._main.run(p.q, p.k, p.v, return_lse=True),
            "context_chunk": lambda: backend._chunks[0].run(*chunk_q_k_v, return_lse=True),
        }
    return {}


def measure_backend(
    name, cls, case, p, chunk, new_flops, ctx_flops, rounds, device, with_lse=False
) -> list[dict]:
    """Both ops (three with ``with_lse``) of one backend on one shape, next to its bare kernel if any."""
    import torch

    from mla_prefill_ext.testing.problem import deepseek_yarn_scale

    rows = []
    backend = cls(case["heads"], deepseek_yarn_scale(), 512, *case["dims"], None)
    backend.prepare_metadata(p.metadata)
    ours = {  # each op as a call of no arguments
        "new_tokens": lambda: backend.run_prefill_new_tokens(p.q, p.k, p.v, False),
        "context_chunk": lambda: backend.run_prefill_context_chunk(0, *chunk),
        "new_tokens_lse": lambda: backend.run_prefill_new_tokens(p.q, p.k, p.v, True),
    }
    bare = bare_kernels(name, backend, p, chunk)
    # What waits for the device's queued work: CUDA's synchronize, nothing on the CPU.
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    ops = [("new_tokens", new_flops), ("context_chunk", ctx_flops)]
    if with_lse:
        ops.append(("new_tokens_lse", new_flops))
    for op, flops in ops:
        fns = {"backend": ours[op], **({"bare": bare[op]} if op in bare else {})}
        for fn in fns.values():  # every side warmed up (and JIT-built) before the backend's sizes a round
            fn()
        n = timing.size_repetition(fns["backend"], sync=sync, warmup=0)
        samples: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(rounds):  # interleave the sides round by round
            for k, fn in fns.items():
                samples[k].append(timing.time_repetition(fn, sync=sync, calls=n))
        row = {"backend": name, "op": op, **case_fields(case), "tokens": sum(case["new"])}
        row.update(seqs=len(case["new"]), launches_per_round=n)
        for k, s in samples.items():  # each round's time too, in order: drift shows there
            t = statistics.median(s)
            row.update({f"{k}_ms": t * 1e3, f"{k}_tflops": flops / t / 1e12})
            row[f"{k}_rounds_ms"] = [x * 1e3 for x in s]
        if "bare_ms" in row:
            row["ratio"] = row["bare_ms"] / row["backend_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def bench_kernels(
    names: list[str], device: str, capability: Any, grid: list[dict], rounds: int, with_lse: bool = False
) -> list[dict]:
    """Every valid backend of ``names`` on each case of ``grid``; a shape a kernel refuses is a row too."""
    import torch

    from mla_prefill_ext.registry import MLAPrefillBackendEnum
    from mla_prefill_ext.selector import MLAPrefillSelectorConfig
    from mla_prefill_ext.testing.problem import make_problem

    rows = []
    for case in grid:
        config = MLAPrefillSelectorConfig.from_dims(torch.bfloat16, *case["dims"])
        p = make_problem(case["new"], case["ctx"], 1, case["heads"], *case["dims"], device=device, seed=0)
        chunk = (p.q, p.chunk_k[0], p.chunk_v[0])  # the context chunk's (q, k, v)
        new_flops, ctx_flops = p.flops(context=False), p.flops(new_tokens=False)
        for name in names:
            cls = MLAPrefillBackendEnum[name].get_class()
            if cls.validate_configuration(capability, config):
                continue
            try:
                rows += measure_backend(
                    name, cls, case, p, chunk, new_flops, ctx_flops, rounds, device, with_lse
                )
            except RuntimeError as e:  # a kernel that refuses this shape is a result too
                rows.append({"backend": name, **case_fields(case), "error": str(e)})
                print(json.dumps(rows[-1]), flush=True)
        p = chunk = None  # free this shape's tensors before the next one
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(__doc__)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--plot", help="write the plot (PNG) here")
    parser.add_argument("--quick", action="store_true", help="a smaller grid")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per shape (median taken)")
    parser.add_argument("--backends", default=KERNEL_BACKENDS, help="comma-separated backends to time")
    parser.add_argument("--dims", choices=["r1", "non-r1", "all"], default="all", help="grid shapes")
    parser.add_argument("--shapes", help="SEQSxNEW,... instead of the grid's shapes (context: NEW each)")
    parser.add_argument("--heads", default="16,128", help="head counts, comma-separated")
    parser.add_argument("--with-lse", action="store_true", help="also time new_tokens_lse (see above)")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="a GPU if any")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    common.use_this_checkout()
    import torch

    from mla_prefill_ext.registry import MLAPrefillBackendEnum
    from mla_prefill_ext.selector import current_device_capability

    names = args.backends.split(",")
    unknown = [n for n in names if n not in MLAPrefillBackendEnum.__members__]
    if unknown:
        raise SystemExit(f"unknown backend(s) {unknown}; known: {list(MLAPrefillBackendEnum.__members__)}")
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    capability = current_device_capability() if device == "cuda" else None
    out = common.record()
    try:
        shapes = parse_grid_shapes(args.shapes) if args.shapes else None
        heads = tuple(int(h) for h in args.heads.split(","))
    except ValueError as e:
        raise SystemExit(f"--shapes/--heads: {e}") from None
    grid = kernel_grid(args.quick, device, args.dims, shapes, heads)
    out["kernel"] = bench_kernels(names, device, capability, grid, args.rounds, args.with_lse)
    out["selection"] = fastest_per_shape(out["kernel"], capability)
    if args.plot:
        plot(out["kernel"], args.plot)
    common.write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
