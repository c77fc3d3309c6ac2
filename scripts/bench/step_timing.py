"""The per-step host cost of one backend on real vLLM objects: its layers, its builders, the timed steps.

Used by step.py. The layers and builders are vLLM 0.20's own (mla_prefill_ext.testing.vllm_host);
the prepared instances' kernel calls are stubs, so only host work is timed.
"""

from __future__ import annotations

import functools
import statistics
import sys
from pathlib import Path
from time import perf_counter_ns
from typing import Any

from . import common

# The device each backend is built for: the CPU itself for the portable backend, else only the
# device facts of a GPU that runs it (vllm_host.gpu_view), every vLLM object staying real.
STEP_CAPABILITY: dict[str, tuple[int, int] | None] = {
    "TORCH_SDPA": None,
    "FLASH_ATTN": (9, 0),
    "FLASHINFER": (9, 0),
    "TRTLLM_RAGGED": (10, 0),
}
STEP_PREFILLS = [512, 256, 128, 64]  # new tokens of the step's requests (prefill only, no context)
# The hooks alone in a step with cached context: per layer, forward_mha calls the new-tokens hook
# once, then the context-chunk hook once per chunk (4 chunks per step, as in the GPU verification).
STEP_CONTEXT_CHUNKS = 4
SAMPLES = (
    "addon",
    "build",
    "stock",
    "dispatch",
    "plain",
    "per_layer",
    "hook_per_layer",
    "hook_context_per_layer",
)


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
    import torch
    from vllm.config import set_current_vllm_config

    from mla_prefill_ext import selector
    from mla_prefill_ext.testing import vllm_host

    selector.clear_cache()
    cfg = vllm_host.make_vllm_config(model_dir, additional_config={"mla_prefill_backend": name})
    cap = STEP_CAPABILITY[name]
    with vllm_host.gpu_view(cap):
        layers = [
            vllm_host.mla_layer(vllm_host.build_deepseek_attention(cfg, prefix=f"model.layers.{i}.self_attn"))
            for i in range(max(layer_counts))
        ]
    owned = {type(layer.prefill_backend).get_name() for layer in layers}
    if owned != {name}:
        raise SystemExit(f"{name}: the layers own {sorted(owned)}")
    builders = {}
    with vllm_host.gpu_view(cap), set_current_vllm_config(cfg):
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


def addon_block(builders: dict[int, Any], layers: list[Any], batch: Any, args: Any, samples: dict) -> None:
    """Warm-up, then timed steps with the add-on active, the layer counts taking turns step by step.

    ``batch``: vLLM's per-step metadata the builders build from. Samples (ns) go to
    ``samples[n]``. Turns step by step, not block by block, so that what
    else runs on the machine weighs on every layer count alike.
    """
    from mla_prefill_ext.hosts.vllm_0_20 import MLA_MODULE
    from mla_prefill_ext.hosts.vllm_0_20.hooks import builder as builder_hooks

    stock_build = vars(sys.modules[MLA_MODULE].MLACommonMetadataBuilder)["build"].__wrapped__  # vLLM's own
    inner: list[int] = []

    def timed_stock(builder: Any, *a: Any, **k: Any) -> Any:
        t = perf_counter_ns()
        m = stock_build(builder, *a, **k)
        inner.append(perf_counter_ns() - t)
        return m

    # vLLM's forward_mha calls the impl's _run_prefill_* hooks: those are what a step costs per layer.
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
            builder_hooks.builder_build(wrapped, builder, (0, batch), {})
            t1 = perf_counter_ns()
            # 2. The same step through the installed patch (what vLLM's model runner calls).
            metadata = builder.build(0, batch)
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
            prefill = builder.build(0, batch).prefill
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


def stock_block(builders: dict[int, Any], batch: Any, args: Any, samples: dict) -> None:
    """The same builders' build() with the add-on deactivated (vLLM as shipped), taking turns."""
    import mla_prefill_ext
    from mla_prefill_ext.hosts.vllm_0_20 import MLA_MODULE

    mla = sys.modules[MLA_MODULE]
    mla_prefill_ext.deactivate()
    try:
        if hasattr(vars(mla.MLACommonMetadataBuilder)["build"], "__wrapped__"):
            raise SystemExit("deactivate() left MLACommonMetadataBuilder.build wrapped")
        order = list(builders)
        for i in range(args.warmup + args.steps // args.step_rounds):
            for n in order if i % 2 else order[::-1]:
                t0 = perf_counter_ns()
                metadata = builders[n].build(0, batch)
                t1 = perf_counter_ns()
                if i >= args.warmup:
                    samples[n]["stock"].append(t1 - t0)
                if hasattr(metadata.prefill, "mla_prefill_runners"):
                    raise SystemExit("the deactivated build still ran the add-on")
    finally:
        mla_prefill_ext.activate()


def step_one_backend(name: str, layer_counts: list[int], args: Any, model_dir: Path) -> dict:
    """One backend: its layers and builders, then the layer counts and both sides interleaved."""
    from vllm.config import set_current_vllm_config

    from mla_prefill_ext.testing import vllm_host

    cap = STEP_CAPABILITY[name]
    res: dict[str, Any] = {
        "backend": name,
        "device_view": "CPU" if cap is None else f"CPU with SM{cap[0]}{cap[1]} device facts",
    }
    try:
        cfg, layers, builders = step_setup(name, layer_counts, model_dir)
    except Exception as e:  # the backend cannot even be built here
        res["not_measurable"] = f"building its layers failed: {common.failure(e)}"
        return res
    batch = vllm_host.prefill_batch(STEP_PREFILLS, table_width=64)
    samples = {n: {k: [] for k in SAMPLES} for n in builders}
    with vllm_host.gpu_view(cap), set_current_vllm_config(cfg):
        try:  # one step each, untimed: what cannot run on a CPU (FlashInfer's plan()) fails here
            # The instances each builder prepared, as the step's metadata carries them to the layers.
            prefills = {n: b.build(0, batch).prefill for n, b in builders.items()}
        except Exception as e:
            res["not_measurable"] = (
                f"its prepare_metadata cannot run on this CPU machine: {common.failure(e)}"
            )
            return res
        runners = {n: getattr(prefill, "mla_prefill_runners", None) for n, prefill in prefills.items()}
        if not all(runners.values()):
            raise SystemExit(f"{name}: the add-on prepared no instance in build(): {runners}")
        for prepared in runners.values():
            for runner in prepared.values():
                runner.run_prefill_new_tokens = _stub_kernel  # on the builder's instances only
                runner.run_prefill_context_chunk = _stub_chunk_kernel
        for _ in range(args.step_rounds):  # the two sides alternate in blocks (deactivate() unpatches)
            addon_block(builders, layers, batch, args, samples)
            stock_block(builders, batch, args, samples)
    rows = []
    for n in builders:
        spread = {k: _us(v) for k, v in samples[n].items()}
        med = {k: v["median"] for k, v in spread.items()}
        rows.append(
            {
                "layers": n,
                "prepared_instances": len(runners[n]),
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
    return res
