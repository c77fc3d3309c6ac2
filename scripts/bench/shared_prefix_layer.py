"""One MLA layer's attention over cached context: vLLM's prefill plan, the shared plan, its decode path (GPU).

    python -m scripts.bench shared_prefix_layer [--backend FLASH_ATTN] [--requests 16] [--prefix 32768]
        [--private 0] [--private-only] [--new 32,128,512,1024] [--sides vllm,shared,absorbed,shared_absorbed]
        [--num-splits 0] [--repeats 10] [--json out.json]

DeepSeek-R1's MLA as one GPU of TP=8 sees it, bf16, block size 64. Sides: ``vllm`` and ``shared`` (the two
prefill plans' context part, through ``shared_prefix.execute.compute_context``; ``plan_ms``: the shared
plan's planning, not timed), ``absorbed`` (vLLM's decode path, which also covers the new tokens' own
attention) and ``shared_absorbed`` (the shared-prefix decode candidate; ``--new 1``: a decode step).
CUDA-event medians after warm-up; the outputs compared, and a small case against float64; per point the
router's prediction and decision next to the measurement. What each side runs, and results:
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

from . import common
from .shared_prefix_case import BLOCK_SIZE, R1_TP8, make_case
from .shared_prefix_crossover import SIDES, crossover, crossover_lines, predicted_cost
from .shared_prefix_decode_path import prepare_absorbed, prepare_shared_absorbed

DECODE_SIDES = ("absorbed", "shared_absorbed")  # the decode path and its shared-prefix candidate
WORKSPACE_ROWS = 65536  # vLLM 0.20's cap on the context workspace (min(max(8 x max_model_len, ...), 64k))


def parse_sides(text: str) -> tuple[str, ...]:
    """``--sides``: some of vllm, shared, absorbed, shared_absorbed, each once (run in that order)."""
    sides = tuple(s.strip().lower() for s in text.split(","))
    if unknown := [s for s in sides if s not in (*SIDES, *DECODE_SIDES)]:
        known = ", ".join((*SIDES, DECODE_SIDES[1]))
        raise argparse.ArgumentTypeError(f"unknown side {unknown[0]!r} (sides: {known})")
    if len(set(sides)) != len(sides):
        raise argparse.ArgumentTypeError(f"a side is listed twice in {text!r}")
    return sides


def backend_class(name: str) -> type:
    from mla_prefill_ext.registry import lookup

    base = lookup(name).get_class()
    return type(f"Segment{base.__name__}", (base,), {"accepts_shared_context_segments": True})


def prepare(case: dict, cls: type, shared: bool, device: Any) -> tuple[Any, Any]:
    """The builder's part, once per step: the plan, the prepared step and segment backends."""
    import torch
    from vllm.model_executor.layers.attention.mla_attention import MLACommonPrefillMetadata

    from mla_prefill_ext.shared_prefix.execute import LatentLayout, LayerContext, vllm_merge
    from mla_prefill_ext.shared_prefix.plan import plan_context
    from mla_prefill_ext.shared_prefix.views import SegmentInstance, attach_private_chunks

    d = R1_TP8
    host_plan = plan_context(
        case["table"].numpy(), case["context_lens"], case["loc"], BLOCK_SIZE, WORKSPACE_ROWS, shared=shared
    )
    plan = host_plan.to(device)  # one copy, as the step makes it; the views below are of it
    loc = case["loc"]
    steps = dict(block_table=case["table"].to(device), query_start_loc=loc.to(device))
    dtypes = dict(q_data_type=torch.bfloat16, output_dtype=torch.bfloat16)
    metadata = MLACommonPrefillMetadata(**steps, **dtypes, max_query_len=int((loc[1:] - loc[:-1]).max()))
    metadata.query_start_loc_cpu = loc
    backend = cls(vllm_config=None, scale=(d["qk_nope_head_dim"] + d["qk_rope_head_dim"]) ** -0.5, **d)
    segments = SegmentInstance(backend, device)
    attach_private_chunks(host_plan, metadata, on_device=plan)
    backend.prepare_metadata(metadata)
    segment_backend = segments.prepare(host_plan, metadata, on_device=plan)
    workspace = torch.empty(WORKSPACE_ROWS, case["cache"].shape[-1], dtype=torch.bfloat16, device=device)
    dims = LatentLayout(d["num_heads"], d["kv_lora_rank"], d["qk_nope_head_dim"], d["v_head_dim"])

    def kv_b_proj(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, case["w"])

    layer = LayerContext(case["cache"], kv_b_proj, dims, workspace, vllm_merge)
    block_table = metadata.block_table

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        from mla_prefill_ext.shared_prefix.execute import compute_context

        return compute_context(case["q"], plan, block_table, backend, segment_backend, layer)

    return plan, run


def timed(run: Any, repeats: int) -> float:
    import torch

    for _ in range(2):
        run()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def whole_reference(case: dict, decode: bool) -> tuple[Any, Any]:
    """Float64 attention of each request's queries: over its context (non-causal; ``decode``:
    over context + new tokens, causal), keys and values up-projected with ``kv_b_proj``."""
    import torch

    from mla_prefill_ext.testing.reference import reference_attention

    d = R1_TP8
    heads, nope, rope, rank = d["num_heads"], d["qk_nope_head_dim"], d["qk_rope_head_dim"], d["kv_lora_rank"]
    scale = (nope + rope) ** -0.5
    table = case["decode_table"] if decode else case["table"]
    lens = case["seq_lens"] if decode else case["context_lens"]
    cache = case["cache"]
    outs, lses = [], []
    for r, c in enumerate(lens):
        blocks = table[r, : -(-c // BLOCK_SIZE)].long().to(cache.device)
        latent = cache[blocks].reshape(-1, cache.shape[-1])[:c]
        kv = torch.nn.functional.linear(latent[:, :rank], case["w"]).double().view(c, heads, -1)
        k_pe = latent[:, None, rank:].double().expand(c, heads, rope)
        k = torch.cat([kv[..., :nope], k_pe], dim=-1)
        qr = case["q"][int(case["loc"][r]) : int(case["loc"][r + 1])]
        o, lse = reference_attention(qr, k, kv[..., nope:], scale, causal=decode)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, dim=1)


def reference_errors(
    cls: type,
    device: Any,
    sides: Sequence[str] = SIDES,
    attention: Callable | None = None,
    merge: Callable | None = None,
) -> dict[str, float]:
    """Each side against float64 attention, on a small case (4 requests, 1k shared + 200 private, 48 new;
    the decode sides 1 new, the only step the decode path serves). ``attention``, ``merge``: the decode
    sides' kernels (None: vLLM's, on a GPU)."""
    case = make_case(4, 1024, 200, 48, device, seed=1)
    out = {}
    if "vllm" in sides or "shared" in sides:
        ref_o, ref_l = whole_reference(case, decode=False)
        for name in (n for n in ("vllm", "shared") if n in sides):
            _, run = prepare(case, cls, name == "shared", device)
            o, lse = run()
            out[f"{name}_out_err"] = (o.double() - ref_o.to(o.device)).abs().max().item()
            out[f"{name}_lse_err"] = (lse.double() - ref_l.to(lse.device)).abs().max().item()
    if any(n in sides for n in DECODE_SIDES):
        case = make_case(4, 1024, 200, 1, device, seed=1)
    for name in (n for n in DECODE_SIDES if n in sides):
        ref_o, _ = whole_reference(case, decode=True)
        if name == "absorbed":
            o = prepare_absorbed(case, device, attention=attention)()
        else:
            o = prepare_shared_absorbed(case, device, attention=attention, merge=merge)()
        out[f"{name}_out_err"] = (o.double().view(ref_o.shape) - ref_o.to(o.device)).abs().max().item()
    return out


def point_row(new: int, times: dict, plan_ms: float | None, diffs: dict, prediction: dict) -> dict[str, Any]:
    """One point's record: the fields of earlier runs first (``new``, ``vllm_ms``, ``shared_ms``,
    ``ratio``, ``plan_ms``, the two plans' differences), then the absorbed side and the prediction."""
    row: dict[str, Any] = dict(new=new, **{f"{s}_ms": times[s] for s in ("vllm", "shared") if s in times})
    if "vllm" in times and "shared" in times:
        row["ratio"] = times["vllm"] / times["shared"]
    if plan_ms is not None:
        row["plan_ms"] = plan_ms
    row.update(diffs)
    if "shared_absorbed" in times:
        row["shared_absorbed_ms"] = times["shared_absorbed"]
    if "absorbed" in times:
        row["absorbed_ms"] = times["absorbed"]
        for side in ("shared", "vllm", "shared_absorbed"):
            if side in times:
                row[f"absorbed_over_{side}"] = times["absorbed"] / times[side]
    row.update(prediction)
    return row


def make_parser() -> argparse.ArgumentParser:
    parser = common.parser(__doc__)
    parser.add_argument("--backend", default="FLASH_ATTN", help="the plans' prefill backend")
    parser.add_argument("--requests", type=int, default=16, help="requests sharing the prefix")
    parser.add_argument("--prefix", type=int, default=32768, help="cached tokens they share")
    parser.add_argument("--private", type=int, default=0, help="cached tokens of each one's own")
    parser.add_argument("--private-only", action="store_true", help="no shared prefix: only --private each")
    parser.add_argument("--new", default="32,128,512,1024", help="new tokens per request, per point")
    parser.add_argument(
        "--sides", type=parse_sides, default=SIDES, help="vllm,shared,absorbed,shared_absorbed"
    )
    parser.add_argument("--num-splits", type=int, default=0, help="the absorbed call's max_num_splits")
    parser.add_argument(
        "--shared-splits", type=int, default=0, help="shared_absorbed's prefix call's num_splits"
    )
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per side (median)")
    parser.add_argument("--json", help="write the results here")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.private_only:
        if args.private <= 0:
            parser.error("--private-only needs --private > 0")
        args.prefix = 0
    if args.prefix % BLOCK_SIZE:
        parser.error(f"--prefix must be a multiple of the block size ({BLOCK_SIZE})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import time

    import torch

    import mla_prefill_ext
    from mla_prefill_ext.hosts.core.shared_prefix.routing import ROUTE_BELOW

    mla_prefill_ext.activate()
    device = torch.device("cuda")
    sides = args.sides
    cls = backend_class(args.backend)
    accuracy = reference_errors(cls, device, sides)
    print("against float64 (4 requests, 1k shared + 200 private, 48 new; decode 1):", accuracy, flush=True)
    header = ["N", *(f"{s} ms" for s in sides)]
    if "vllm" in sides and "shared" in sides:
        header += ["ratio", "plan ms", "max|dout|", "max|dlse|"]
    header += [
        f"absorbed/{s}" for s in ("shared", "vllm", "shared_absorbed") if "absorbed" in sides and s in sides
    ]
    header += ["max|ddecode|"] if set(DECODE_SIDES) <= set(sides) else []
    print(" ".join(f"{h:>12}" for h in header))
    rows = []
    for new in map(int, args.new.split(",")):
        case = make_case(args.requests, args.prefix, args.private, new, device)
        times, outs, plan_ms = {}, {}, None
        for side in sides:
            if side == "absorbed":
                run = prepare_absorbed(case, device, args.num_splits)
            elif side == "shared_absorbed":
                run = prepare_shared_absorbed(case, device, num_splits=args.shared_splits)
            else:
                t0 = time.perf_counter()
                _, run = prepare(case, cls, side == "shared", device)
                if side == "shared":
                    plan_ms = (time.perf_counter() - t0) * 1e3
            times[side] = timed(run, args.repeats)
            outs[side] = run()
        diffs = {}
        if "vllm" in outs and "shared" in outs:
            (o_v, l_v), (o_s, l_s) = outs["vllm"], outs["shared"]
            diffs["max_out_diff"] = (o_v.float() - o_s.float()).abs().max().item()
            diffs["max_lse_diff"] = (l_v - l_s).abs().max().item()
        if "absorbed" in outs and "shared_absorbed" in outs:  # the candidate against vLLM's decode
            diffs["decode_max_out_diff"] = (
                (outs["absorbed"].float() - outs["shared_absorbed"].float()).abs().max().item()
            )
        row = point_row(new, times, plan_ms, diffs, predicted_cost(case["table"], case["context_lens"], new))
        rows.append(row)
        cells = [str(new), *(f"{times[s]:.3f}" for s in sides)]
        if "max_out_diff" in diffs:
            cells += [f"{row['ratio']:.2f}x", f"{plan_ms:.2f}", f"{diffs['max_out_diff']:.4f}"]
            cells += [f"{diffs['max_lse_diff']:.4f}"]
        keys = ("absorbed_over_shared", "absorbed_over_vllm", "absorbed_over_shared_absorbed")
        cells += [f"{row[k]:.2f}x" for k in keys if k in row]
        cells += [f"{diffs['decode_max_out_diff']:.4f}"] if "decode_max_out_diff" in diffs else []
        print(" ".join(f"{c:>12}" for c in cells), flush=True)
        del case, outs
        torch.cuda.empty_cache()
    summary = crossover(rows, ROUTE_BELOW)
    print("\n".join(crossover_lines(summary)), flush=True)
    config = dict(vars(args), sides=list(sides), block_size=BLOCK_SIZE, workspace_rows=WORKSPACE_ROWS)
    config["dims"] = R1_TP8
    out = common.record(shared_prefix_layer=rows, accuracy=accuracy, crossover=summary, config=config)
    common.write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
