#!/usr/bin/env python3
"""MLA prefill benchmarks: kernel overhead, backend choice, engine throughput, start-up cost.

    python scripts/bench_prefill.py kernel  [--json out.json] [--plot out.png] [--quick]
    python scripts/bench_prefill.py engine  [--json out.json] [--reuse RESULTS_DIR] [--gpus 0,1]
    python scripts/bench_prefill.py startup [--json out.json]
    python scripts/bench_prefill.py all     --json out.json --plot out.png   # the three, one command

Kernel: TFLOP/s of each backend's run_prefill_new_tokens / run_prefill_context_chunk next to
the same kernel called directly (vllm_flash_attn, FlashInfer's wrapper), CUDA events over
repeated launches after warm-up, the two sides interleaved round by round.
Engine: prompt tokens/s with max_tokens=1 for stock vLLM vs the add-on (FLASH_ATTN, FLASHINFER),
one engine lifetime per side, several repetitions (tests/gpu/scenarios.py, engine_runner.py).
Start-up: ``import vllm`` + vLLM's plugin loading with and without the add-on's entry point.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

R1 = (128, 64, 128)
NON_R1 = (64, 32, 64)


def kernel_grid(quick: bool, device: str, dims_choice: str = "all") -> list[dict[str, Any]]:
    if device == "cpu":  # a smoke-sized case: the script itself, not the numbers
        return [{"dims": R1, "heads": 2, "new": [64], "ctx": [64]}]
    singles = [512, 1024, 2048, 4096, 8192, 16384, 32768]
    batches = [[128] * 64, [512] * 32, [2048] * 8]
    if quick:
        singles, batches = [512, 4096, 16384], [[128] * 64]
    grid = []
    for dims in {"r1": (R1,), "non-r1": (NON_R1,), "all": (R1, NON_R1)}[dims_choice]:
        for heads in (16, 128):
            for n in singles:
                grid.append({"dims": dims, "heads": heads, "new": [n], "ctx": [n]})
            for b in batches:
                grid.append({"dims": dims, "heads": heads, "new": b, "ctx": list(b)})
    return grid


def _timer(device: str):
    import torch

    if device == "cuda":

        def measure(fn, n: int) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(n):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / n

    else:

        def measure(fn, n: int) -> float:
            t = time.perf_counter()
            for _ in range(n):
                fn()
            return (time.perf_counter() - t) / n

    return measure


def bare_kernels(name: str, backend: Any, p: Any, chunk_q_k_v: tuple) -> dict[str, Any]:
    """The same kernel as the backend, called directly with the same arguments."""
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
            "context_chunk": lambda: fa(
                q=chunk_q_k_v[0], k=chunk_q_k_v[1], v=chunk_q_k_v[2], **ctx_kw, return_softmax_lse=True
            ),
        }
    if name == "FLASHINFER":
        shared = backend._shared  # the wrappers the backend planned: run them directly
        return {
            "new_tokens": lambda: shared.main.run(p.q, p.k, p.v, return_lse=False),
            "context_chunk": lambda: shared.chunks[0].run(*chunk_q_k_v, return_lse=True),
        }
    return {}


def measure_backend(name, cls, case, p, chunk, new_flops, ctx_flops, measure, args, device) -> list[dict]:
    """Both ops of one backend on one shape, next to the bare kernel where there is one."""
    import torch

    from mla_prefill_ext.problem import deepseek_yarn_scale

    dims, heads = case["dims"], case["heads"]
    rows = []
    backend = cls(heads, deepseek_yarn_scale(), 512, *dims, None)
    backend.prepare_metadata(p.metadata)
    ours = {
        "new_tokens": lambda b=backend, q=p.q, k=p.k, v=p.v: b.run_prefill_new_tokens(q, k, v, False),
        "context_chunk": lambda b=backend, c=chunk: b.run_prefill_context_chunk(0, *c),
    }
    bare = bare_kernels(name, backend, p, chunk)
    for op, flops in (("new_tokens", new_flops), ("context_chunk", ctx_flops)):
        fns = {"backend": ours[op], **({"bare": bare[op]} if op in bare else {})}
        for fn in fns.values():  # warm-up (and JIT)
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
        once = measure(fns["backend"], 1)
        n = max(1, min(200, int(0.02 / max(once, 1e-6))))
        samples: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(args.rounds):  # interleave the sides round by round
            for k, fn in fns.items():
                samples[k].append(measure(fn, n))
        row = {
            "backend": name,
            "op": op,
            "dims": list(dims),
            "heads": heads,
            "seqs": len(case["new"]),
            "tokens": sum(case["new"]),
            "shape": f"{len(case['new'])}x{case['new'][0]}",
            "launches_per_round": n,
        }
        for k, s in samples.items():
            t = statistics.median(s)
            row[f"{k}_ms"] = t * 1e3
            row[f"{k}_tflops"] = flops / t / 1e12
        if "bare_ms" in row:
            row["ratio"] = row["bare_ms"] / row["backend_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def bench_kernels(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    from mla_prefill_ext.problem import make_problem
    from mla_prefill_ext.registry import MLAPrefillBackendEnum
    from mla_prefill_ext.selector import MLAPrefillSelectorConfig, current_device_capability

    device = "cuda" if torch.cuda.is_available() else "cpu"
    measure = _timer(device)
    cap = current_device_capability() if device == "cuda" else None
    names = args.backends.split(",")
    unknown = [n for n in names if n not in MLAPrefillBackendEnum.__members__]
    if unknown:
        raise SystemExit(f"unknown backend(s) {unknown}; known: {list(MLAPrefillBackendEnum.__members__)}")
    rows = []
    for case in kernel_grid(args.quick, device, args.dims):
        dims, heads = case["dims"], case["heads"]
        config = MLAPrefillSelectorConfig.from_dims(torch.bfloat16, *dims)
        p = make_problem(case["new"], case["ctx"], 1, heads, *dims, device=device, seed=0)
        chunk = (p.q, p.chunk_k[0], p.chunk_v[0])
        new_flops, ctx_flops = p.flops(context=False), p.flops(new_tokens=False)
        for name in names:
            cls = MLAPrefillBackendEnum[name].get_class()
            if cls.validate_configuration(cap, config):
                continue
            try:
                rows += measure_backend(
                    name, cls, case, p, chunk, new_flops, ctx_flops, measure, args, device
                )
            except RuntimeError as e:  # a kernel that refuses this shape is a result too
                rows.append(
                    {
                        "backend": name,
                        "dims": list(dims),
                        "heads": heads,
                        "shape": f"{len(case['new'])}x{case['new'][0]}",
                        "error": str(e),
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
        p = chunk = None  # free this shape's tensors before the next one
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def fastest_per_shape(
    rows: list[dict[str, Any]], assume_capability: tuple[int, int] | None = None
) -> list[dict[str, Any]]:
    """Per shape: the fastest backend measured, and what automatic selection picks here."""
    import torch

    from mla_prefill_ext.selector import (
        MLAPrefillSelectorConfig,
        check_backend,
        current_device_capability,
        mla_prefill_backend_priorities,
    )

    cap = current_device_capability() if torch.cuda.is_available() else None
    if assume_capability is not None:
        from vllm.platforms.interface import DeviceCapability

        cap = DeviceCapability(*assume_capability)
    out = []
    rows = [r for r in rows if "error" not in r]
    keys = sorted({(r["op"], tuple(r["dims"]), r["heads"], r["shape"]) for r in rows})
    for op, dims, heads, shape in keys:
        cands = {
            r["backend"]: r["backend_ms"]
            for r in rows
            if (r["op"], tuple(r["dims"]), r["heads"], r["shape"]) == (op, dims, heads, shape)
        }
        config = MLAPrefillSelectorConfig.from_dims(torch.bfloat16, *dims)
        auto = next(
            m.name for m in mla_prefill_backend_priorities(cap) if not check_backend(m, cap, config)[1]
        )
        best = min(cands, key=cands.get)
        out.append(
            {
                "op": op,
                "dims": list(dims),
                "heads": heads,
                "shape": shape,
                "fastest": best,
                "automatic": auto,
                "auto_vs_fastest": cands[best] / cands[auto] if auto in cands else None,
                "ms": cands,
            }
        )
    return out


def bench_engine(args: argparse.Namespace) -> dict[str, Any]:
    from tests.gpu import scenarios

    results = Path(args.reuse) if args.reuse else Path(args.results)
    names = ["stock", "shim-fa", "shim-fi"]
    if not args.reuse:
        scenarios.run_all(names, results, args.gpus.split(","), bench=True)
    table = []
    data = {n: scenarios.load(results, n) for n in names}
    for n, d in data.items():
        if d is None or not d.get("ok") or not d.get("bench"):
            raise SystemExit(f"engine scenario {n} has no benchmark results in {results}")
    for i, point in enumerate(data["stock"]["bench"]):
        row = {"prompt_len": point["prompt_len"], "batch": point["batch"]}
        for n in names:
            tps = data[n]["bench"][i]["tokens_per_s"]
            row[n] = {"median": statistics.median(tps), "min": min(tps), "max": max(tps), "all": tps}
        for n in ("shim-fa", "shim-fi"):
            row[f"{n}/stock"] = row[n]["median"] / row["stock"]["median"]
        table.append(row)
        print(
            json.dumps(
                {k: v for k, v in row.items() if not isinstance(v, dict)}
                | {n: round(row[n]["median"]) for n in names}
            ),
            flush=True,
        )
    return {"results_dir": str(results), "ready_s": {n: data[n]["ready_s"] for n in names}, "table": table}


def bench_startup(args: argparse.Namespace) -> dict[str, Any]:
    py = sys.executable
    base = (
        "import time; t=time.perf_counter(); import vllm, vllm.plugins; vllm.plugins.load_general_plugins(); "
    )
    load = base + "print(time.perf_counter()-t)"
    only_import = "import time; t=time.perf_counter(); import vllm; print(time.perf_counter()-t)"
    activate_only = (
        "import vllm, time; t=time.perf_counter(); import mla_prefill_ext; mla_prefill_ext.activate(); "
        "print(time.perf_counter()-t)"
    )
    # The whole add-on cost in a process that builds an MLA model: activate(), then the patch
    # applied by the post-import hook when vLLM's MLA module is imported (timed inside the hook).
    with_patch = (
        "import time, vllm; t=time.perf_counter(); import mla_prefill_ext;"
        " from mla_prefill_ext import activation as a; inner=a._on_mla_module_imported; spent=[]\n"
        "def timed(m):\n s=time.perf_counter(); inner(m); spent.append(time.perf_counter()-s)\n"
        "a._on_mla_module_imported=timed; mla_prefill_ext.activate(); act=time.perf_counter()-t\n"
        "import importlib; importlib.import_module('vllm.model_executor.layers.attention.mla_attention')\n"
        "from mla_prefill_ext import patches; assert patches.is_instrumented() and len(spent) == 1\n"
        "print(act + spent[0])"
    )
    others = "lora_filesystem_resolver,lora_hf_hub_resolver"
    variants = {
        "import vllm": (only_import, {}),
        "import vllm + plugins, without add-on": (load, {"VLLM_PLUGINS": others}),
        "import vllm + plugins, with add-on": (load, {"VLLM_PLUGINS": others + ",mla_prefill_ext"}),
        "activate() alone (MLA module not yet imported)": (activate_only, {}),
        "activate() + patch at the MLA module's import": (with_patch, {}),
    }
    if args.activation_only:  # skip the whole-process variants (seconds each, and noisy)
        variants = {k: v for k, v in variants.items() if k.startswith("activate()")}
    samples: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.startup_reps):  # interleaved
        for k, (code, env) in variants.items():
            out = subprocess.run(
                [py, "-c", code],
                capture_output=True,
                text=True,
                env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", **env},
                check=True,
            )
            samples[k].append(float(out.stdout.strip().splitlines()[-1]))
    res = {
        k: {"median_ms": statistics.median(v) * 1e3, "min_ms": min(v) * 1e3, "max_ms": max(v) * 1e3}
        for k, v in samples.items()
    }
    if not args.activation_only:
        res["added_by_add_on_ms"] = (
            res["import vllm + plugins, with add-on"]["median_ms"]
            - res["import vllm + plugins, without add-on"]["median_ms"]
        )
    for k, v in res.items():
        print(k, v, flush=True)
    return res


def plot(kernel_rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    kernel_rows = [r for r in kernel_rows if "error" not in r]

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(op, heads) for op in ("new_tokens", "context_chunk") for heads in (16, 128)]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), sharey=True)
    for ax, (op, heads) in zip(axes, panels, strict=True):
        for name in ("FLASH_ATTN", "FLASHINFER", "TORCH_SDPA"):
            rows = [
                r
                for r in kernel_rows
                if r["op"] == op
                and r["heads"] == heads
                and r["backend"] == name
                and r["seqs"] == 1
                and r["dims"] == list(R1)
            ]
            if not rows:
                continue
            xs = [r["tokens"] for r in rows]
            ax.plot(xs, [r["backend_tflops"] for r in rows], marker="o", label=f"{name} (backend)")
            if "bare_tflops" in rows[0]:
                ax.plot(xs, [r["bare_tflops"] for r in rows], linestyle="--", label=f"{name} (bare kernel)")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{op}, {heads} heads, qk 192 / v 128")
        ax.set_xlabel("tokens (one sequence)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("TFLOP/s (bf16)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def markdown(out: dict[str, Any]) -> str:
    """The result tables as Markdown (for docs/benchmarks.md)."""
    lines: list[str] = []
    rows = [r for r in out.get("kernel", []) if "error" not in r]
    if rows:
        lines += [
            "| op | dims (nope,rope,v) | heads | seqs x tokens | FLASH_ATTN backend / bare TFLOP/s (ratio) "
            "| FLASHINFER backend / bare TFLOP/s (ratio) | TORCH_SDPA TFLOP/s |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        keys = sorted(
            {(r["op"], tuple(r["dims"]), r["heads"], r["seqs"], r["shape"]) for r in rows},
            key=lambda k: (k[0] != "new_tokens", k[1] != R1, k[2], k[3] > 1, int(k[4].split("x")[1])),
        )
        for op, dims, heads, _seqs, shape in keys:
            cell = {}
            for r in rows:
                if (r["op"], tuple(r["dims"]), r["heads"], r["shape"]) == (op, dims, heads, shape):
                    if "bare_tflops" in r:
                        cell[r["backend"]] = (
                            f"{r['backend_tflops']:.0f} / {r['bare_tflops']:.0f} ({r['ratio']:.3f})"
                        )
                    else:
                        cell[r["backend"]] = f"{r['backend_tflops']:.1f}"
            lines.append(
                f"| {op} | {','.join(map(str, dims))} | {heads} | {shape} | {cell.get('FLASH_ATTN', '-')} "
                f"| {cell.get('FLASHINFER', '-')} | {cell.get('TORCH_SDPA', '-')} |"
            )
        lines.append("")
    for err in [r for r in out.get("kernel", []) if "error" in r][:1]:
        n = sum("error" in r for r in out["kernel"])
        lines += [f"{n} cases failed to run; the first: {err['backend']} {err['dims']}: {err['error']}", ""]
    if out.get("selection"):
        lines += [
            "| op | dims | heads | seqs x tokens | fastest | automatic (SM90) | auto time / fastest |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for sel in out["selection"]:
            if sel["auto_vs_fastest"] is None:
                continue
            ratio = 1 / sel["auto_vs_fastest"]
            lines.append(
                f"| {sel['op']} | {','.join(map(str, sel['dims']))} | {sel['heads']} | {sel['shape']} "
                f"| {sel['fastest']} | {sel['automatic']} | {ratio:.2f}x |"
            )
        lines.append("")
    return "\n".join(lines)


def environment() -> dict[str, Any]:
    import torch
    import vllm

    info = {"python": sys.version.split()[0], "torch": torch.__version__, "vllm": vllm.__version__}
    try:
        import flashinfer

        info["flashinfer"] = flashinfer.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        try:
            info["driver"] = (
                subprocess.run(
                    ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                    capture_output=True,
                    text=True,
                )
                .stdout.strip()
                .splitlines()[0]
            )
        except (OSError, IndexError):
            pass
    return info


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["kernel", "engine", "startup", "all", "report"])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--plot", help="write the kernel plot (PNG) here")
    parser.add_argument("--quick", action="store_true", help="a smaller kernel grid")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--backends",
        default="FLASH_ATTN,FLASHINFER,TORCH_SDPA",
        help="kernel: comma-separated backends to time",
    )
    parser.add_argument("--dims", choices=["r1", "non-r1", "all"], default="all", help="kernel grid shapes")
    parser.add_argument("--startup-reps", type=int, default=7)
    parser.add_argument(
        "--activation-only", action="store_true", help="startup: time only the add-on's own activation"
    )
    parser.add_argument("--results", default="/tmp/mla-bench-engine", help="engine scenario folder")
    parser.add_argument("--reuse", help="take engine results from this scenario folder")
    parser.add_argument("--gpus", default="0")
    parser.add_argument("--kernel-log", help="report: rebuild the kernel results from a kernel run's log")
    parser.add_argument("--markdown", help="report: write the tables as Markdown here")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    out: dict[str, Any] = {"command": " ".join(sys.argv), "environment": environment()}
    if args.mode == "report":  # tables and plot from the rows a kernel run printed
        out["environment"] = {"note": "rows measured by the run that printed them; see its log"}
        text = Path(args.kernel_log).read_text().splitlines()
        out["kernel"] = [json.loads(line) for line in text if line.startswith('{"backend"')]
        out["selection"] = fastest_per_shape(out["kernel"], assume_capability=(9, 0))
        if args.plot:
            plot(out["kernel"], args.plot)
        if args.markdown:
            Path(args.markdown).write_text(markdown(out))
    if args.mode in ("kernel", "all"):
        out["kernel"] = bench_kernels(args)
        out["selection"] = fastest_per_shape(out["kernel"])
        if args.plot:
            plot(out["kernel"], args.plot)
    if args.mode in ("engine", "all"):
        out["engine"] = bench_engine(args)
    if args.mode in ("startup", "all"):
        out["startup"] = bench_startup(args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
