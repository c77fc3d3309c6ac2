#!/usr/bin/env python3
"""One MLA layer's context part for requests sharing a cached prefix: vLLM's plan vs the shared plan (GPU).

    python -m scripts.bench shared_prefix_layer [--backend FLASH_ATTN] [--requests 16] [--prefix 32768]
        [--private 0] [--new 32,128,512,1024] [--repeats 10] [--json out.json]

DeepSeek-R1's MLA as one GPU of TP=8 sees it (16 heads, kv_lora 512, rope 64, nope 128, v 128),
bf16, block size 64, vLLM's 64k-row context workspace. ``--requests`` prefill requests hold the
same ``--prefix`` cached tokens (the same block ids, as prefix caching gives them), then
``--private`` cached tokens of their own, and add ``--new`` tokens each. Both plans run through
``mla_prefill_ext.shared_prefix.execute.compute_context`` with the same add-on backend (a subclass
declaring ``accepts_shared_context_segments``), vLLM's gather kernel and ``merge_attn_states``:

* ``vllm``: vLLM's own plan (each request's whole context gathered and up-projected in workspace
  passes, one varlen attention per pass);
* ``shared``: the prefix gathered and up-projected once, one attention of every member's queries
  over it, then each request's private context.

Times are medians of ``--repeats`` CUDA-event timings after two warm-up calls (planning, a
host-side step done once per step in the builder, is not in them; ``plan_ms`` gives it). The
outputs of the two plans are compared (largest |difference| of the output and the LSE), and a
small case of the same kind is checked against float64 attention over each whole context.
"""

from __future__ import annotations

import statistics
import sys
from typing import Any

from . import common

R1_TP8 = dict(num_heads=16, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
BLOCK_SIZE = 64
WORKSPACE_ROWS = 65536  # vLLM 0.20's cap on the context workspace (min(max(8 x max_model_len, ...), 64k))


def make_case(requests: int, prefix: int, private: int, new: int, device: Any, seed: int = 0) -> dict:
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    bs, d = BLOCK_SIZE, R1_TP8
    prefix_blocks, private_blocks = prefix // bs, -(-private // bs)
    blocks = prefix_blocks + requests * private_blocks + 1
    width = prefix_blocks + private_blocks + 1
    table = torch.full((requests, width), blocks - 1, dtype=torch.int32)
    for r in range(requests):
        table[r, :prefix_blocks] = torch.arange(prefix_blocks, dtype=torch.int32)
        first = prefix_blocks + r * private_blocks
        table[r, prefix_blocks : prefix_blocks + private_blocks] = torch.arange(
            first, first + private_blocks, dtype=torch.int32
        )
    latent = d["kv_lora_rank"] + d["qk_rope_head_dim"]
    cache = torch.randn(blocks, bs, latent, generator=gen).to(device, torch.bfloat16)
    q_dim = d["qk_nope_head_dim"] + d["qk_rope_head_dim"]
    q = torch.randn(requests * new, d["num_heads"], q_dim, generator=gen).to(device, torch.bfloat16)
    w = torch.randn(
        d["num_heads"] * (d["qk_nope_head_dim"] + d["v_head_dim"]), d["kv_lora_rank"], generator=gen
    )
    w = (w / d["kv_lora_rank"] ** 0.5).to(device, torch.bfloat16)
    loc = torch.arange(0, requests * new + 1, new, dtype=torch.int32)
    return dict(table=table, context_lens=[prefix + private] * requests, loc=loc, cache=cache, q=q, w=w)


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
    plan = plan_context(
        case["table"].numpy(), case["context_lens"], case["loc"], BLOCK_SIZE, WORKSPACE_ROWS, shared=shared
    ).to(device)
    loc = case["loc"]
    metadata = MLACommonPrefillMetadata(
        block_table=case["table"].to(device),
        query_start_loc=loc.to(device),
        max_query_len=int((loc[1:] - loc[:-1]).max()),
        q_data_type=torch.bfloat16,
        output_dtype=torch.bfloat16,
    )
    metadata.query_start_loc_cpu = loc
    backend = cls(vllm_config=None, scale=(d["qk_nope_head_dim"] + d["qk_rope_head_dim"]) ** -0.5, **d)
    segments = SegmentInstance(backend, device)
    attach_private_chunks(plan, metadata)
    backend.prepare_metadata(metadata)
    segment_backend = segments.prepare(plan, metadata)
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


def reference_errors(cls: type, device: Any) -> dict[str, float]:
    """Both plans against float64 attention over each whole context, on a small case."""
    import torch

    from mla_prefill_ext.testing.reference import reference_attention

    d = R1_TP8
    case = make_case(4, 1024, 200, 48, device, seed=1)
    out = {}
    refs_o, refs_l = [], []
    scale = (d["qk_nope_head_dim"] + d["qk_rope_head_dim"]) ** -0.5
    for r in range(4):
        c = case["context_lens"][r]
        blocks = case["table"][r, : -(-c // BLOCK_SIZE)].long().to(device)
        latent = case["cache"][blocks].reshape(-1, case["cache"].shape[-1])[:c]
        kv = torch.nn.functional.linear(latent[:, : d["kv_lora_rank"]], case["w"]).double()
        kv = kv.view(c, d["num_heads"], -1)
        k_pe = latent[:, None, d["kv_lora_rank"] :].double().expand(c, d["num_heads"], d["qk_rope_head_dim"])
        k = torch.cat([kv[..., : d["qk_nope_head_dim"]], k_pe], dim=-1)
        v = kv[..., d["qk_nope_head_dim"] :]
        qr = case["q"][int(case["loc"][r]) : int(case["loc"][r + 1])]
        o, lse = reference_attention(qr, k, v, scale, causal=False)
        refs_o.append(o)
        refs_l.append(lse)
    ref_o, ref_l = torch.cat(refs_o), torch.cat(refs_l, dim=1)
    for shared in (False, True):
        _, run = prepare(case, cls, shared, device)
        o, lse = run()
        name = "shared" if shared else "vllm"
        out[f"{name}_out_err"] = (o.double() - ref_o.to(o.device)).abs().max().item()
        out[f"{name}_lse_err"] = (lse.double() - ref_l.to(lse.device)).abs().max().item()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(__doc__)
    parser.add_argument("--backend", default="FLASH_ATTN")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prefix", type=int, default=32768)
    parser.add_argument("--private", type=int, default=0)
    parser.add_argument("--new", default="32,128,512,1024")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    import time

    import torch

    import mla_prefill_ext

    mla_prefill_ext.activate()
    device = torch.device("cuda")
    cls = backend_class(args.backend)
    accuracy = reference_errors(cls, device)
    print("against float64 (4 requests, 1k shared + 200 private, 48 new):", accuracy, flush=True)
    rows = []
    header = ("N", "vllm ms", "shared ms", "ratio", "plan ms", "max|dout|", "max|dlse|")
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, (6, 9, 10, 7, 8, 10, 10), strict=True)))
    for new in map(int, args.new.split(",")):
        case = make_case(args.requests, args.prefix, args.private, new, device)
        results = {}
        for shared in (False, True):
            t0 = time.perf_counter()
            _, run = prepare(case, cls, shared, device)
            plan_ms = (time.perf_counter() - t0) * 1e3
            results[shared] = (timed(run, args.repeats), plan_ms, run())
        (t_v, _, (o_v, l_v)), (t_s, p_s, (o_s, l_s)) = results[False], results[True]
        row = dict(
            new=new,
            vllm_ms=t_v,
            shared_ms=t_s,
            ratio=t_v / t_s,
            plan_ms=p_s,
            max_out_diff=(o_v.float() - o_s.float()).abs().max().item(),
            max_lse_diff=(l_v - l_s).abs().max().item(),
        )
        rows.append(row)
        print(
            f"{new:>6} {t_v:>9.3f} {t_s:>10.3f} {t_v / t_s:>6.2f}x {p_s:>8.2f} "
            f"{row['max_out_diff']:>10.4f} {row['max_lse_diff']:>10.4f}",
            flush=True,
        )
        del case, results, o_v, o_s
        torch.cuda.empty_cache()
    config = dict(vars(args), block_size=BLOCK_SIZE, workspace_rows=WORKSPACE_ROWS, dims=R1_TP8)
    common.write_json(args.json, common.record(shared_prefix_layer=rows, accuracy=accuracy, config=config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
