#!/usr/bin/env python3
"""MLA prefill benchmarks: kernel overhead, backend choice, engine throughput, start-up and step host cost.

    python scripts/bench_prefill.py kernel  [--json out.json] [--plot out.png] [--quick]
    python scripts/bench_prefill.py engine  [--json out.json] [--reuse RESULTS_DIR] [--gpus 0,1]
    python scripts/bench_prefill.py startup [--json out.json]
    python scripts/bench_prefill.py step    [--json out.json] [--layers 1,61] [--steps 200] [--backends ...]
    python scripts/bench_prefill.py all     --json out.json --plot out.png   # the three, one command

Kernel: TFLOP/s of each backend's run_prefill_new_tokens / run_prefill_context_chunk next to
the same kernel called directly (vllm_flash_attn, FlashInfer's wrapper), CUDA events over
repeated launches after warm-up, the two sides interleaved round by round.
Engine: prompt tokens/s with max_tokens=1 for stock vLLM vs the add-on (FLASH_ATTN, FLASHINFER),
one engine lifetime per side, several repetitions (tests/gpu/scenarios.py, engine_runner.py).
Start-up: ``import vllm`` + vLLM's plugin loading with and without the add-on's entry point.
Step (runs on a CPU): the host cost per prefill step of the add-on's preparation for 1 and for 61 MLA
layers, on real vLLM objects (tests/host.py): vLLM's DeepseekV2 MLA attention layers and MLA metadata
builder; ``build()`` with and without the add-on, the add-on's own work inside it, and the layers'
prefill hooks (also alone, per layer, as a step with context chunks calls them). FLASH_ATTN,
FLASHINFER and TRTLLM_RAGGED get a GPU's device facts only: no kernel runs, and a backend whose
preparation needs a GPU is reported as not measurable, with the reason.
"""

from __future__ import annotations

import argparse
import functools
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
KERNEL_BACKENDS = "FLASH_ATTN,FLASHINFER,TORCH_SDPA"

# Step mode: the per-step host cost of the add-on's preparation for N MLA layers.
STEP_BACKENDS = "TORCH_SDPA,FLASH_ATTN,FLASHINFER,TRTLLM_RAGGED"
# The device each backend is built for: the CPU itself for the portable backend, else only the
# device facts of a GPU that runs it (host.gpu_view), every vLLM object staying real.
STEP_CAPABILITY: dict[str, tuple[int, int] | None] = {
    "TORCH_SDPA": None,
    "FLASH_ATTN": (9, 0),
    "FLASHINFER": (9, 0),
    "TRTLLM_RAGGED": (10, 0),
}
STEP_PREFILLS = [512, 256, 128, 64]  # new tokens of the step's requests (prefill only, no context)
STEP_TARGET_RATIO = 1.2  # the add-on's preparation for the most layers vs for the fewest
# The hooks alone in a step with cached context: per layer, forward_mha calls the new-tokens hook
# once, then the context-chunk hook once per chunk (4 chunks per step, as in the GPU verification).
STEP_CONTEXT_CHUNKS = 4


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
        # The wrappers the backend planned (its own instances): run them directly.
        return {
            "new_tokens": lambda: backend._main.run(p.q, p.k, p.v, return_lse=False),
            "context_chunk": lambda: backend._chunks[0].run(*chunk_q_k_v, return_lse=True),
        }
    return {}


def measure_backend(name, cls, case, p, chunk, new_flops, ctx_flops, measure, args, device) -> list[dict]:
    """Both ops of one backend on one shape, next to the bare kernel where there is one."""
    import torch

    from mla_prefill_ext.testing.problem import deepseek_yarn_scale

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

    from mla_prefill_ext.registry import MLAPrefillBackendEnum
    from mla_prefill_ext.selector import MLAPrefillSelectorConfig, current_device_capability
    from mla_prefill_ext.testing.problem import make_problem

    device = "cuda" if torch.cuda.is_available() else "cpu"
    measure = _timer(device)
    cap = current_device_capability() if device == "cuda" else None
    names = (args.backends or KERNEL_BACKENDS).split(",")
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
    # The same snippet as profile_startup.py's; it prints {"activate_ms", "patch_ms", ...}.
    from profile_startup import TIMED as with_patch

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
            value = json.loads(out.stdout.strip().splitlines()[-1])
            samples[k].append(
                (value["activate_ms"] + value["patch_ms"]) / 1e3 if isinstance(value, dict) else value
            )
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


def _failure(e: BaseException) -> str:
    """The exception's first line, and where it was raised: the innermost frame of a library."""
    import traceback

    text = str(e).strip().splitlines()
    frames = traceback.extract_tb(e.__traceback__)
    where = next(
        (f for f in reversed(frames) if "site-packages" in f.filename), frames[-1] if frames else None
    )
    at = ""
    if where is not None:
        short = where.filename.split("site-packages/")[-1]
        at = f" (raised in {short}:{where.lineno}, {where.name})"
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300] + at


def _us(samples: list[int]) -> dict[str, float]:
    s = sorted(samples)
    return {
        "median": statistics.median(s) / 1e3,
        "p10": s[len(s) // 10] / 1e3,
        "p90": s[(len(s) * 9) // 10] / 1e3,
    }


def step_setup(name: str, layer_counts: list[int], model_dir: Path) -> tuple[Any, list[Any], dict[int, Any]]:
    """The backend's MLA layers (as many as the largest count) and one metadata builder per count.

    Each builder holds the first ``n`` layers, as vLLM's model runner builds one builder per
    KV-cache group holding every MLA layer of the model.
    """
    import host  # tests/host.py: real vLLM objects on a CPU
    import torch
    from vllm.config import set_current_vllm_config

    from mla_prefill_ext import selector

    selector.clear_cache()
    cfg = host.make_vllm_config(model_dir, additional_config={"mla_prefill_backend": name})
    cap = STEP_CAPABILITY[name]
    with host.gpu_view(cap):
        layers = [
            host.mla_layer(host.build_deepseek_attention(cfg, prefix=f"model.layers.{i}.self_attn"))
            for i in range(max(layer_counts))
        ]
    owned = {type(layer.prefill_backend).get_name() for layer in layers}
    if owned != {name}:
        raise SystemExit(f"{name}: the layers own {sorted(owned)}")
    builders = {}
    with host.gpu_view(cap), set_current_vllm_config(cfg):
        for n in layer_counts:
            builders[n] = layers[0].attn_backend.get_builder_cls()(
                layers[0].get_kv_cache_spec(cfg),
                [layer.layer_name for layer in layers[:n]],
                cfg,
                torch.device("cpu"),
            )
    return cfg, layers, builders


STUB_RESULT = object()


def _stub_kernel(q: Any, k: Any, v: Any, return_softmax_lse: bool) -> Any:
    return STUB_RESULT  # no kernel runs: only the host work around it is timed


def _stub_chunk_kernel(chunk_idx: int, q: Any, k: Any, v: Any) -> Any:
    return STUB_RESULT


def addon_block(
    builders: dict[int, Any], layers: list[Any], common: Any, args: argparse.Namespace, samples: dict
) -> None:
    """Warm-up, then timed steps with the add-on active, the layer counts taking turns step by step.

    Samples (ns) go to ``samples[n]``. Turns step by step, not block by block, so that what
    else runs on the machine weighs on every layer count alike.
    """
    from time import perf_counter_ns

    from mla_prefill_ext.patches import MLA_MODULE
    from mla_prefill_ext.patches.hooks import builder as wrappers

    stock_build = vars(sys.modules[MLA_MODULE].MLACommonMetadataBuilder)["build"].__wrapped__  # vLLM's own
    inner: list[int] = []

    def timed_stock(builder: Any, *a: Any, **k: Any) -> Any:
        t = perf_counter_ns()
        m = stock_build(builder, *a, **k)
        inner.append(perf_counter_ns() - t)
        return m

    per_count = {
        n: (
            b,
            functools.partial(timed_stock, b),
            [layer.impl._run_prefill_new_tokens for layer in layers[:n]],
            [layer.prefill_backend for layer in layers[:n]],
            [_stub_kernel] * n,
            [
                (layer.impl._run_prefill_new_tokens, layer.impl._run_prefill_context_chunk)
                for layer in layers[:n]
            ],
            [(_stub_kernel, _stub_chunk_kernel)] * n,
        )
        for n, b in builders.items()
    }
    chunk_ids = range(STEP_CONTEXT_CHUNKS)
    order = list(per_count)
    for i in range(args.warmup + args.steps // args.step_rounds):
        for n in order if i % 2 else order[::-1]:
            builder, wrapped, hooks, own, plain, hook_pairs, plain_pairs = per_count[n]
            inner.clear()
            # 1. The add-on's own work in build(): its wrapper around vLLM's build, minus that build.
            t0 = perf_counter_ns()
            wrappers.builder_build(wrapped, builder, (0, common), {})
            t1 = perf_counter_ns()
            # 2. The same step through the installed patch (what vLLM's model runner calls).
            metadata = builder.build(0, common)
            t2 = perf_counter_ns()
            # 3. Each layer's prefill hook once: the lookup of the prepared instance, then its
            #    kernel call (a stub); and the stub called as often without the hooks (the floor).
            prefill = metadata.prefill
            ran = [hook(prefill, None, None, None, False) for hook in hooks]
            t3 = perf_counter_ns()
            _ = [f(None, None, None, False) for f in plain]
            t4 = perf_counter_ns()
            # 4. For comparison, the scheme the change replaced: every layer prepares its own backend.
            for backend in own:
                backend.prepare_metadata(prefill)
            t5 = perf_counter_ns()
            # 5. The hooks alone, as a step with context calls them, on a step freshly built (untimed) so
            #    that each layer's first call finds its instance as in a real step: per layer the
            #    new-tokens hook, then the context-chunk hook per chunk; then the stubs as often.
            prefill = builder.build(0, common).prefill
            t6 = perf_counter_ns()
            for new_tokens, context_chunk in hook_pairs:
                new_tokens(prefill, None, None, None, False)
                for c in chunk_ids:
                    context_chunk(prefill, c, None, None, None)
            t7 = perf_counter_ns()
            for new_tokens, context_chunk in plain_pairs:
                new_tokens(None, None, None, False)
                for c in chunk_ids:
                    context_chunk(c, None, None, None)
            t8 = perf_counter_ns()
            ran.append(hook_pairs[-1][1](prefill, 0, None, None, None))
            if not all(r is STUB_RESULT for r in ran):
                raise SystemExit("a layer's hook did not run the instance its builder prepared")
            if i >= args.warmup:
                s = samples[n]
                s["addon"].append(t1 - t0 - inner[0])
                s["build"].append(t2 - t1)
                s["dispatch"].append(t3 - t2)
                s["plain"].append(t4 - t3)
                s["per_layer"].append(t5 - t4)
                # Per layer, each step's hooks minus its own stub calls (paired within the step).
                s["hook_per_layer"].append((t3 - t2 - (t4 - t3)) / n)
                s["hook_context_per_layer"].append((t7 - t6 - (t8 - t7)) / n)


def stock_block(builders: dict[int, Any], common: Any, args: argparse.Namespace, samples: dict) -> None:
    """The same builders' build() with the add-on deactivated (vLLM as shipped), taking turns."""
    from time import perf_counter_ns

    import mla_prefill_ext
    from mla_prefill_ext.patches import MLA_MODULE

    mla = sys.modules[MLA_MODULE]
    mla_prefill_ext.deactivate()
    try:
        if hasattr(vars(mla.MLACommonMetadataBuilder)["build"], "__wrapped__"):
            raise SystemExit("deactivate() left MLACommonMetadataBuilder.build wrapped")
        order = list(builders)
        for i in range(args.warmup + args.steps // args.step_rounds):
            for n in order if i % 2 else order[::-1]:
                t0 = perf_counter_ns()
                metadata = builders[n].build(0, common)
                t1 = perf_counter_ns()
                if i >= args.warmup:
                    samples[n]["stock"].append(t1 - t0)
                if hasattr(metadata.prefill, "mla_prefill_runners"):
                    raise SystemExit("the deactivated build still ran the add-on")
    finally:
        mla_prefill_ext.activate()


def step_one_backend(name: str, layer_counts: list[int], args: argparse.Namespace, model_dir: Path) -> dict:
    """One backend: its layers and builders, then the layer counts and both sides interleaved."""
    import host
    from vllm.config import set_current_vllm_config

    cap = STEP_CAPABILITY[name]
    res: dict[str, Any] = {
        "backend": name,
        "device_view": "CPU" if cap is None else f"CPU with SM{cap[0]}{cap[1]} device facts",
    }
    try:
        cfg, layers, builders = step_setup(name, layer_counts, model_dir)
    except Exception as e:  # the backend cannot even be built here
        res["not_measurable"] = f"building its layers failed: {_failure(e)}"
        return res
    common = host.prefill_batch(STEP_PREFILLS, table_width=64)
    samples = {
        n: {
            k: []
            for k in (
                "addon",
                "build",
                "stock",
                "dispatch",
                "plain",
                "per_layer",
                "hook_per_layer",
                "hook_context_per_layer",
            )
        }
        for n in builders
    }
    with host.gpu_view(cap), set_current_vllm_config(cfg):
        try:  # one step each, untimed: what cannot run on a CPU (FlashInfer's plan()) fails here
            for b in builders.values():
                b.build(0, common)
        except Exception as e:
            res["not_measurable"] = f"its prepare_metadata cannot run on this CPU machine: {_failure(e)}"
            return res
        for b in builders.values():
            for runner in b._mla_prefill_runners.values():
                runner.run_prefill_new_tokens = _stub_kernel  # on the builder's instances only
                runner.run_prefill_context_chunk = _stub_chunk_kernel
        for _ in range(args.step_rounds):  # the two sides alternate in blocks (deactivate() unpatches)
            addon_block(builders, layers, common, args, samples)
            stock_block(builders, common, args, samples)
    rows = []
    for n, b in builders.items():
        spread = {k: _us(v) for k, v in samples[n].items()}
        med = {k: v["median"] for k, v in spread.items()}
        rows.append(
            {
                "layers": n,
                "prepared_instances": len(b._mla_prefill_runners),
                "steps": len(samples[n]["addon"]),
                "addon_prepare_us": med["addon"],
                "stock_build_us": med["stock"],
                "build_with_addon_us": med["build"],
                "build_difference_us": med["build"] - med["stock"],
                "hook_dispatch_us": med["dispatch"],
                "plain_calls_us": med["plain"],
                "per_layer_prepare_us": med["per_layer"],
                "hook_per_layer_us": med["hook_per_layer"],
                "hook_context_per_layer_us": med["hook_context_per_layer"],
                "spread_us": spread,
            }
        )
    lo, hi = rows[0], rows[-1]
    res["rows"] = rows
    res["ratio_prepare"] = hi["addon_prepare_us"] / lo["addon_prepare_us"]
    res["ratio_prepare_and_hooks"] = (hi["addon_prepare_us"] + hi["hook_dispatch_us"]) / (
        lo["addon_prepare_us"] + lo["hook_dispatch_us"]
    )
    res["meets_target"] = res["ratio_prepare"] <= STEP_TARGET_RATIO
    return res


STEP_COLUMNS = (
    ("addon_prepare_us", "add-on preparation in build()"),
    ("stock_build_us", "stock build()"),
    ("build_with_addon_us", "build() with add-on"),
    ("hook_dispatch_us", "prefill hooks, all layers"),
    ("plain_calls_us", "plain calls, all layers"),
    ("per_layer_prepare_us", "every layer preparing (old scheme)"),
)


def step_markdown(step: dict[str, Any]) -> list[str]:
    """One table per backend (medians, us) and the verdict on the target, or why it was not measured."""
    lines: list[str] = []
    for res in step["backends"]:
        lines += [f"{res['backend']} ({res['device_view']}), medians in us:", ""]
        if "not_measurable" in res:
            lines += [f"not measurable here: {res['not_measurable']}", ""]
            continue
        lines.append("| layers | " + " | ".join(title for _, title in STEP_COLUMNS) + " |")
        lines.append("| --- " * (len(STEP_COLUMNS) + 1) + "|")
        for row in res["rows"]:
            lines.append(
                f"| {row['layers']} | " + " | ".join(f"{row[k]:.1f}" for k, _ in STEP_COLUMNS) + " |"
            )
        lo, hi = res["rows"][0]["layers"], res["rows"][-1]["layers"]
        verdict = "met" if res["meets_target"] else "NOT met"
        lines += [
            "",
            "prefill hooks alone, per layer and step (minus the stub calls), with "
            + ", ".join(str(row["layers"]) for row in res["rows"])
            + " layers: new tokens only "
            + " / ".join(f"{row['hook_per_layer_us']:.3f}" for row in res["rows"])
            + f" us; new tokens + {step['context_chunks']} context chunks "
            + " / ".join(f"{row['hook_context_per_layer_us']:.3f}" for row in res["rows"])
            + " us",
            "",
            f"add-on preparation, {hi} layers / {lo}: {res['ratio_prepare']:.2f}x (target <= "
            f"{step['target_ratio']}x: {verdict}); with the prefill hooks: "
            f"{res['ratio_prepare_and_hooks']:.2f}x",
            "",
        ]
    return lines


def bench_step(args: argparse.Namespace) -> dict[str, Any]:
    import importlib
    import tempfile

    sys.path.insert(0, str(ROOT / "tests"))  # host.py: real vLLM objects built on a CPU
    import host

    import mla_prefill_ext
    from mla_prefill_ext import patches

    layer_counts = sorted({int(n) for n in args.layers.split(",")})
    names = (args.backends or STEP_BACKENDS).split(",")
    unknown = [n for n in names if n not in STEP_CAPABILITY]
    if unknown:
        raise SystemExit(f"unknown backend(s) {unknown}; step mode times: {list(STEP_CAPABILITY)}")
    if args.steps < args.step_rounds:
        raise SystemExit(f"--steps ({args.steps}) must be at least --step-rounds ({args.step_rounds})")
    mla_prefill_ext.activate()
    importlib.import_module(patches.MLA_MODULE)
    if not patches.is_instrumented():
        raise SystemExit(f"the add-on did not patch vLLM: {patches.state().skipped_reason}")
    tiny = host.TINY_DEEPSEEK_V2
    out: dict[str, Any] = {
        "note": (
            "Host cost of one prefill step on this machine's CPU with real vLLM objects: "
            "DeepseekV2MLAAttention layers and one MLA metadata builder holding them all (one KV-cache "
            f"group). A tiny model ({tiny['num_attention_heads']} heads, hidden {tiny['hidden_size']}, "
            "R1 MLA dims): only host cost is timed. GPU backends are built with a GPU's device facts "
            "patched in (tests/host.py gpu_view), their tensors on the CPU: no kernel runs (the "
            "prepared instances' kernel call is a stub), and device-tensor arithmetic in a "
            "preparation runs on the CPU instead of being launched."
        ),
        "definitions": {
            "addon_prepare_us": "the add-on's wrapper around vLLM's build() minus that build inside "
            "it: attach the host offsets, prepare each distinct backend instance once",
            "stock_build_us": "the same builder's build() with the add-on deactivated (vLLM as shipped)",
            "build_with_addon_us": "build() through the installed patch (what vLLM's model runner calls)",
            "build_difference_us": "build_with_addon_us - stock_build_us (two separate calls: noisier)",
            "hook_dispatch_us": "every layer's impl._run_prefill_new_tokens once: the lookup of the "
            "prepared instance, then its kernel call (a stub)",
            "plain_calls_us": "the stub called once per layer without the hooks (the floor)",
            "per_layer_prepare_us": "prepare_metadata on every layer's own backend: the scheme "
            "before the change, for comparison",
            "hook_per_layer_us": "the prefill hook alone: per step, (hook_dispatch - plain_calls) / layers, "
            "median over steps",
            "hook_context_per_layer_us": "the prefill hooks alone in a step with context chunks: per "
            "layer the new-tokens hook once and the context-chunk hook once per chunk "
            "(context_chunks), on a freshly built step, minus as many stub calls, divided by the "
            "layers; median over steps",
        },
        "prefills": STEP_PREFILLS,
        "layers": layer_counts,
        "steps": args.steps,
        "rounds": args.step_rounds,
        "warmup_steps_per_block": args.warmup,
        "target_ratio": STEP_TARGET_RATIO,
        "context_chunks": STEP_CONTEXT_CHUNKS,
        "flashinfer_workspace_bytes": int(os.environ["VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE"]),
        "backends": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = host.write_model_dir(Path(tmp) / "tiny-deepseek", num_hidden_layers=max(layer_counts))
        for name in names:
            res = step_one_backend(name, layer_counts, args, model_dir)
            out["backends"].append(res)
            for row in res.get("rows", []):
                flat = {
                    k: round(v, 2) if isinstance(v, float) else v for k, v in row.items() if k != "spread_us"
                }
                print(json.dumps({"mode": "step", "backend": name, **flat}), flush=True)
            if "not_measurable" in res:
                print(json.dumps({"mode": "step", "backend": name, "not_measurable": res["not_measurable"]}))
    print("\n".join(["", out["note"], "", *step_markdown(out)]), flush=True)
    return out


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
    if out.get("step"):
        lines += step_markdown(out["step"])
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
    parser.add_argument("mode", choices=["kernel", "engine", "startup", "step", "all", "report"])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--plot", help="write the kernel plot (PNG) here")
    parser.add_argument("--quick", action="store_true", help="a smaller kernel grid")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--backends",
        help=f"kernel, step: comma-separated backends to time (kernel: {KERNEL_BACKENDS}; "
        f"step: {STEP_BACKENDS})",
    )
    parser.add_argument("--dims", choices=["r1", "non-r1", "all"], default="all", help="kernel grid shapes")
    parser.add_argument("--startup-reps", type=int, default=7)
    parser.add_argument(
        "--activation-only", action="store_true", help="startup: time only the add-on's own activation"
    )
    parser.add_argument("--results", default="/tmp/mla-bench-engine", help="engine scenario folder")
    parser.add_argument("--reuse", help="take engine results from this scenario folder")
    parser.add_argument("--gpus", default="0")
    parser.add_argument("--layers", default="1,61", help="step: MLA layer counts to compare")
    parser.add_argument("--steps", type=int, default=200, help="step: timed steps per layer count")
    parser.add_argument("--warmup", type=int, default=5, help="step: untimed steps before each block")
    parser.add_argument(
        "--step-rounds", type=int, default=20, help="step: blocks the steps are split into (interleaved)"
    )
    parser.add_argument("--kernel-log", help="report: rebuild the kernel results from a kernel run's log")
    parser.add_argument("--markdown", help="report, step: write the tables as Markdown here")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if args.mode == "step":
        # FlashInfer-family workspaces: reserved once per instance, never touched per step (untimed);
        # small, so every layer's own backend can prepare for the old-scheme column.
        os.environ.setdefault("VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE", str(1 << 20))

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
    if args.mode == "step":
        out["step"] = bench_step(args)
        if args.markdown:
            Path(args.markdown).write_text(markdown(out))
    if args.mode in ("engine", "all"):
        out["engine"] = bench_engine(args)
    if args.mode in ("startup", "all"):
        out["startup"] = bench_startup(args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
