"""One MLA layer's host time in a fresh-prefill step, stock vLLM 0.20 and the add-on (CPU).

    python -m scripts.bench layer_host_cost [--requests 16] [--new 2] [--heads 2] [--rounds 30]
        [--calls 50] [--json out.json]

An eager engine is host-bound (61 layers, each launching its kernels from Python): a few µs more per
layer and step would show in the engine benchmark's fresh points, where the shared-prefix path has
nothing to do. What the add-on still does there: per layer, its prefill hook and backend inside
vLLM's ``forward_mha`` (the new tokens' attention); per step, its wrapper around the metadata
builder's ``build()``. (The engine benchmark's private points, 16 short extends over contexts of their
own, take vLLM's decode path on both sides: no add-on code per layer, and ``build()`` returns at once
for a step without prefills.)

Times, on vLLM 0.20.2's real objects (:mod:`mla_prefill_ext.testing.vllm_host`: its DeepSeek-V2 MLA
layer and metadata builder with the R1 head dims, a GPU's device facts, FlashAttention 3 as on
Hopper), for one step of ``--requests`` prompts of ``--new`` tokens each:

  forward_mha  one layer's ``MLACommonImpl.forward_mha`` over the step's new tokens
  build        the builder's ``build()`` of the step

``stock``: the add-on deactivated (vLLM's own ``_run_prefill_new_tokens_fa``); ``stock:2``: a second
stock layer and builder, what two instances of the same code differ by (the floor); ``add-on``:
activated, FLASH_ATTN selected. The three layers share one seeded ``kv_b_proj`` weight.
FlashAttention's varlen kernel is replaced, for every side alike, by a stand-in that allocates its
outputs; every other op runs on the CPU (``kv_b_proj``, the concat of k, the output
copy), kept small by ``--heads`` and ``--new`` (the host work does not depend on them). Before timing,
one step per side checks which code ran (the add-on's step preparation and backend on its side only).
The sides take turns in blocks of ``--calls`` forward calls and five builds, ``--rounds`` times, each
side first in turn; per side the median, p10 and p90 (µs), and the median over rounds of the paired
differences (add-on minus stock, stock:2 minus stock, one block each).

Not measured here: the add-on's other per-step code (the model runner's batch-reorder wrapper, the
block table's device-view wrapper, the engine core's hasher, prefix-hit reuse and arrival wrappers),
and vLLM 0.23+, whose own FLASH_ATTN prefill backend does not import on a CPU wheel.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

from . import common

BUILDS_PER_ROUND = 5
HEAD_DIMS = {"kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}


def fa_stand_in(q: Any, k: Any, v: Any, return_softmax_lse: bool = False, **kwargs: Any) -> Any:
    """FlashAttention's varlen call as far as the host sees it: outputs of the right shapes."""
    import torch

    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    if return_softmax_lse:
        return out, q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)
    return out


@contextlib.contextmanager
def fa3_stand_in(mla_module: Any) -> Iterator[None]:
    """While layers are built: the stand-in is the kernel both sides take, and FA3 is available."""
    from vllm.vllm_flash_attn import flash_attn_interface

    from mla_prefill_ext.backends import flash_attn as addon_fa

    with (
        mock.patch.object(mla_module, "flash_attn_varlen_func", fa_stand_in),
        mock.patch.object(addon_fa, "_varlen_kernel", lambda: (fa_stand_in, True)),
        mock.patch.object(flash_attn_interface, "is_fa_version_supported", lambda v, *a, **k: v == 3),
    ):
        yield


def _stats(ns: list[int]) -> dict[str, float]:
    s = sorted(ns)
    return {
        "median_us": statistics.median(s) / 1e3,
        "p10_us": s[len(s) // 10] / 1e3,
        "p90_us": s[len(s) * 9 // 10] / 1e3,
    }


class Side:
    """One side's layer and builder, built with the add-on active or not, and its step's inputs."""

    def __init__(self, name: str, cfg: Any, mla_module: Any, prefix: str, batch: Any) -> None:
        import torch
        from vllm.config import set_current_vllm_config

        from mla_prefill_ext.testing import vllm_host as host

        self.name, self.cfg, self.batch = name, cfg, batch
        with host.gpu_view((9, 0)), set_current_vllm_config(cfg), fa3_stand_in(mla_module):
            torch.set_default_dtype(torch.bfloat16)  # the weights in the model's dtype, as vLLM loads them
            try:
                self.layer = host.mla_layer(host.build_deepseek_attention(cfg, prefix=prefix))
            finally:
                torch.set_default_dtype(torch.float32)
            builder_cls = self.layer.attn_backend.get_builder_cls()
            self.builder = builder_cls(
                self.layer.get_kv_cache_spec(cfg), [self.layer.layer_name], cfg, torch.device("cpu")
            )
        self.impl = self.layer.impl
        self.impl.dcp_world_size = 1  # what MLAAttention.forward_impl sets before forward_mha

    def build(self, times: int = 1) -> tuple[Any, list[int]]:
        """The step's metadata, built ``times`` times (each timed); the last one's."""
        from vllm.config import set_current_vllm_config

        from mla_prefill_ext.testing import vllm_host as host

        took = []
        with host.gpu_view((9, 0)), set_current_vllm_config(self.cfg):
            for _ in range(times):
                t = time.perf_counter_ns()
                metadata = self.builder.build(0, self.batch)
                took.append(time.perf_counter_ns() - t)
        return metadata, took


def inputs(tokens: int, heads: int) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(0)
    d = HEAD_DIMS

    def randn(*shape: int) -> Any:
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    return {
        "q": randn(tokens, heads, d["qk_nope_head_dim"] + d["qk_rope_head_dim"]),
        "kv_c": randn(tokens, d["kv_lora_rank"]),
        "k_pe": randn(tokens, 1, d["qk_rope_head_dim"]),
        "cache": torch.zeros(8, 16, d["kv_lora_rank"] + d["qk_rope_head_dim"], dtype=torch.bfloat16),
        "out": torch.empty(tokens, heads * d["v_head_dim"], dtype=torch.bfloat16),
    }


def forward(side: Side, metadata: Any, x: dict[str, Any]) -> None:
    import torch

    side.impl.forward_mha(x["q"], x["kv_c"], x["k_pe"], x["cache"], metadata, torch.ones(()), output=x["out"])


def backend_calls(side: Side, metadata: Any, x: dict[str, Any]) -> int:
    """How often one call of ``side``'s forward ran the add-on's FLASH_ATTN backend."""
    from mla_prefill_ext.backends.flash_attn import FlashAttnPrefillBackend

    calls = []
    run = FlashAttnPrefillBackend._run

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(self)
        return run(self, *args, **kwargs)

    with mock.patch.object(FlashAttnPrefillBackend, "_run", counted):
        forward(side, metadata, x)
    return len(calls)


def make_parser():
    parser = common.parser(__doc__)
    parser.add_argument("--requests", type=int, default=16, help="prefill requests in the step")
    parser.add_argument("--new", type=int, default=2, help="new tokens per request (at least 2: a prefill)")
    parser.add_argument("--heads", type=int, default=2, help="attention heads of the layer")
    parser.add_argument("--rounds", type=int, default=30, help="turns of the two sides")
    parser.add_argument("--calls", type=int, default=50, help="forward_mha calls per side and turn")
    parser.add_argument("--json", help="write the results here")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.new < 2:
        parser.error("--new must be at least 2 (one new token is a decode)")
    import torch

    import mla_prefill_ext
    from mla_prefill_ext import activation, versions

    decision = versions.decide()
    if decision.mode != versions.PATCH:
        print(f"layer_host_cost: vLLM {decision.vllm_version} is not the 0.20 patch's host", file=sys.stderr)
        return 2
    # Run in-process (the tests do): what this changes is put back as it was.
    was_active, dtype = activation.is_active(), torch.get_default_dtype()
    with (
        tempfile.TemporaryDirectory(prefix="layer-host-cost-") as tmp,
        mock.patch.dict(os.environ, {"MLA_PREFILL_BACKEND": "FLASH_ATTN"}),
    ):
        try:
            out = measure(args, Path(tmp) / "model", decision.vllm_version)
        finally:
            torch.set_default_dtype(dtype)
            (mla_prefill_ext.activate if was_active else mla_prefill_ext.deactivate)()
    print("\n".join(out["markdown"]))
    common.write_json(args.json, common.record(args=vars(args), **out))
    return 0


def _check_sides(sides: dict[str, tuple[Side, Any]], x: dict[str, Any]) -> dict[str, Any]:
    """Which code each side ran, once before timing: the add-on's step preparation and backend on
    its side only. A side that runs the other's code stops the run."""
    ran = {}
    for name, (side, switch) in sides.items():
        switch()
        metadata, _ = side.build()
        prepared = getattr(metadata.prefill, "mla_prefill_runners", None) is not None
        ran[name] = {"prepared_by_addon": prepared, "addon_backend_calls": backend_calls(side, metadata, x)}
    expected = {
        name: {"prepared_by_addon": name == "add-on", "addon_backend_calls": int(name == "add-on")}
        for name in sides
    }
    if ran != expected:
        raise SystemExit(f"the sides did not run the code they name: {ran}")
    return ran


def measure(args: Any, model_dir: Path, vllm_version: str) -> dict[str, Any]:
    """Build the sides (the add-on's while active, the stock ones while not), check them, time them."""
    import torch

    import mla_prefill_ext
    from mla_prefill_ext.hosts import vllm_0_20 as patches
    from mla_prefill_ext.testing import vllm_host as host

    model = host.write_model_dir(
        model_dir,
        rope_scaling=host.YARN_ROPE_SCALING,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        **HEAD_DIMS,
    )
    cfg = host.make_vllm_config(model)
    host.ensure_distributed(cfg)
    mla_prefill_ext.activate()
    mla_module = importlib.import_module(patches.MLA_MODULE)
    if not patches.is_instrumented():
        raise SystemExit(f"the add-on did not patch vLLM here: {patches.state().skipped_reason}")
    batch = host.prefill_batch([args.new] * args.requests)
    addon = Side("add-on", cfg, mla_module, "model.layers.0.self_attn", batch)
    mla_prefill_ext.deactivate()
    stock = Side("stock", cfg, mla_module, "model.layers.1.self_attn", batch)
    # A second stock layer: what two instances of the same code differ by in this run (the floor).
    stock2 = Side("stock:2", cfg, mla_module, "model.layers.2.self_attn", batch)
    weight = torch.randn(addon.layer.kv_b_proj.weight.shape, generator=torch.Generator().manual_seed(1))
    for side in (addon, stock, stock2):  # the same weights everywhere (they were left uninitialized)
        side.layer.kv_b_proj.weight.data = (weight * 0.05).to(torch.bfloat16)
    x = inputs(args.new * args.requests, args.heads)

    sides = {
        "stock": (stock, mla_prefill_ext.deactivate),
        "stock:2": (stock2, mla_prefill_ext.deactivate),
        "add-on": (addon, mla_prefill_ext.activate),
    }
    ran = _check_sides(sides, x)
    names = list(sides)
    samples: dict[str, dict[str, list[int]]] = {n: {"forward_mha": [], "build": []} for n in names}
    paired: dict[str, list[float]] = {"add-on": [], "stock:2": []}
    for r in range(args.rounds + 1):  # the first round warms up, untimed
        medians = {}
        for name in names[r % 3 :] + names[: r % 3]:  # each side first, second and last in turn
            side, switch = sides[name]
            switch()
            metadata, built = side.build(BUILDS_PER_ROUND)
            times = []
            for _ in range(args.calls):
                t = time.perf_counter_ns()
                forward(side, metadata, x)
                times.append(time.perf_counter_ns() - t)
            if r:
                samples[name]["forward_mha"] += times
                samples[name]["build"] += built
                medians[name] = statistics.median(times)
        if r:
            for name, diffs in paired.items():
                diffs.append((medians[name] - medians["stock"]) / 1e3)

    results = {name: {part: _stats(ns) for part, ns in parts.items()} for name, parts in samples.items()}
    differences = {
        name: {"median_us": statistics.median(d), "min_us": min(d), "max_us": max(d)}
        for name, d in paired.items()
    }
    lines = [
        f"one fresh-prefill step: {args.requests} requests x {args.new} new tokens, {args.heads} heads "
        f"(vLLM {vllm_version}, FLASH_ATTN, FA3 stand-in)",
        "| side | forward_mha median us [p10-p90] | build median us [p10-p90] |",
        "| --- | --- | --- |",
    ]
    for name, parts in results.items():
        f, b = parts["forward_mha"], parts["build"]
        lines.append(
            f"| {name} | {f['median_us']:.1f} [{f['p10_us']:.1f}-{f['p90_us']:.1f}] | "
            f"{b['median_us']:.1f} [{b['p10_us']:.1f}-{b['p90_us']:.1f}] |"
        )
    for name, d in differences.items():
        lines.append(
            f"forward_mha, {name} minus stock per round (median [min-max] of {args.rounds}): "
            f"{d['median_us']:+.1f} us [{d['min_us']:+.1f} to {d['max_us']:+.1f}]"
        )
    return {
        "results": results,
        "forward_mha_paired_difference": differences,
        "checked": ran,
        "markdown": lines,
    }


if __name__ == "__main__":
    sys.exit(main())
