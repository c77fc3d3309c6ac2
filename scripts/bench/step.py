"""Per-step host cost of the add-on's preparation and prefill hooks, for 1 and for 61 MLA layers (CPU).

    python -m scripts.bench step [--json out.json] [--markdown tables.md] [--layers 1,61]
        [--steps 200] [--step-rounds 20] [--warmup 5] [--backends TORCH_SDPA,FLASH_ATTN,...]

Runs on a CPU, on real vLLM objects (mla_prefill_ext.testing.vllm_host): vLLM's DeepseekV2
MLA attention layers and MLA metadata builder. Times build() with and without the add-on, the
add-on's own work inside it, and the layers' prefill hooks (also alone, per layer, as a step
with context chunks calls them). FLASH_ATTN, FLASHINFER and TRTLLM_RAGGED get a GPU's device
facts only: no kernel runs, and a backend whose preparation needs a GPU is reported as not
measurable, with the reason. The layer counts take turns step by step; the add-on and stock
vLLM alternate in blocks (--step-rounds).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from . import common
from .step_timing import STEP_CAPABILITY, STEP_CONTEXT_CHUNKS, STEP_PREFILLS, step_one_backend

STEP_BACKENDS = "TORCH_SDPA,FLASH_ATTN,FLASHINFER,TRTLLM_RAGGED"
STEP_TARGET_RATIO = 1.2  # the add-on's preparation for the most layers vs for the fewest

DEFINITIONS = {
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
}

STEP_COLUMNS = (
    ("addon_prepare_us", "add-on preparation in build()"),
    ("stock_build_us", "stock build()"),
    ("build_with_addon_us", "build() with add-on"),
    ("hook_dispatch_us", "prefill hooks, all layers"),
    ("plain_calls_us", "plain calls, all layers"),
    ("per_layer_prepare_us", "every layer preparing (old scheme)"),
)


def note(tiny: dict[str, Any]) -> str:
    return (
        "Host cost of one prefill step on this machine's CPU with real vLLM objects: "
        "DeepseekV2MLAAttention layers and one MLA metadata builder holding them all (one KV-cache "
        f"group). A tiny model ({tiny['num_attention_heads']} heads, hidden {tiny['hidden_size']}, "
        "R1 MLA dims): only host cost is timed. GPU backends are built with a GPU's device facts "
        "patched in (mla_prefill_ext.testing.vllm_host.gpu_view), their tensors on the CPU: no kernel "
        "runs (the prepared instances' kernel call is a stub), and device-tensor arithmetic in a "
        "preparation runs on the CPU instead of being launched."
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


def bench_step(args: Any, names: list[str], layer_counts: list[int]) -> dict[str, Any]:
    """Every backend of ``names``, one after the other, on one model folder with the most layers."""
    import mla_prefill_ext
    from mla_prefill_ext.hosts import vllm_0_20 as patches
    from mla_prefill_ext.testing import vllm_host

    mla_prefill_ext.activate()
    importlib.import_module(patches.MLA_MODULE)
    if not patches.is_instrumented():
        raise SystemExit(f"the add-on did not patch vLLM: {patches.state().skipped_reason}")
    out: dict[str, Any] = {
        "note": note(vllm_host.TINY_DEEPSEEK_V2),
        "definitions": DEFINITIONS,
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
        model_dir = vllm_host.write_model_dir(
            Path(tmp) / "tiny-deepseek", num_hidden_layers=max(layer_counts)
        )
        for name in names:
            res = step_one_backend(name, layer_counts, args, model_dir)
            if "rows" in res:
                res["meets_target"] = res["ratio_prepare"] <= STEP_TARGET_RATIO
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


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(__doc__)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--markdown", help="write the tables as Markdown here")
    parser.add_argument("--backends", default=STEP_BACKENDS, help="comma-separated backends to time")
    parser.add_argument("--layers", default="1,61", help="MLA layer counts to compare")
    parser.add_argument("--steps", type=int, default=200, help="timed steps per layer count")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before each block")
    parser.add_argument(
        "--step-rounds", type=int, default=20, help="blocks the steps are split into (interleaved)"
    )
    args = parser.parse_args(argv)
    layer_counts = sorted({int(n) for n in args.layers.split(",")})
    names = args.backends.split(",")
    unknown = [n for n in names if n not in STEP_CAPABILITY]
    if unknown:
        raise SystemExit(f"unknown backend(s) {unknown}; step.py times: {list(STEP_CAPABILITY)}")
    if args.steps < args.step_rounds:
        raise SystemExit(f"--steps ({args.steps}) must be at least --step-rounds ({args.step_rounds})")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # FlashInfer-family workspaces: reserved once per instance, never touched per step (untimed);
    # small, so every layer's own backend can prepare for the old-scheme column.
    os.environ.setdefault("VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE", str(1 << 20))
    common.use_this_checkout()

    out = common.record()
    out["step"] = bench_step(args, names, layer_counts)
    if args.markdown:
        Path(args.markdown).write_text("\n".join(step_markdown(out["step"])))
    common.write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
