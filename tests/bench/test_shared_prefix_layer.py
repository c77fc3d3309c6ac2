"""The shared-prefix layer benchmark's parts that run without a GPU: its options, the absorbed side's
inputs and call (vLLM's FA3 call replaced by a float64 paged latent attention), the router's FLOP
prediction for a point and the crossover summary.

Its numbers come from the GPU host (docs/benchmarks.md, "Shared-prefix context path, one layer").
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest
import torch
from vllm_runner_objects import runner_input_batch

from scripts.bench import shared_prefix_layer as bench
from scripts.bench.shared_prefix_case import block_table, decode_table
from scripts.bench.shared_prefix_crossover import SHORT_EXTEND_MAX

pytestmark = pytest.mark.vllm_patch  # the script records vLLM 0.20.2's FLASH_ATTN_MLA call


# --- options ------------------------------------------------------------------------------------


def test_all_three_sides_run_by_default_and_a_subset_in_the_order_given():
    assert bench.parse_args([]).sides == ("vllm", "shared", "absorbed")
    assert bench.parse_args(["--sides", "absorbed, SHARED"]).sides == ("absorbed", "shared")


@pytest.mark.parametrize(
    "argv, error",
    [
        (["--sides", "vllm,decode"], "unknown side 'decode'"),
        (["--sides", "vllm,vllm"], "listed twice"),
        (["--private-only"], "--private-only needs --private > 0"),
        (["--prefix", "1000"], "multiple of the block size"),
    ],
)
def test_options_that_cannot_be_run_are_refused(argv, error, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert error in capsys.readouterr().err


def test_private_only_drops_the_shared_prefix():
    args = bench.parse_args(["--private", "8192", "--private-only"])
    assert (args.prefix, args.private) == (0, 8192)
    table = block_table(args.requests, args.prefix, args.private)
    rows = [set(r[:128].tolist()) for r in table]
    assert all(not (a & b) for i, a in enumerate(rows) for b in rows[i + 1 :])  # no block in two requests


# --- the absorbed side --------------------------------------------------------------------------


def paged_latent_attention(calls, **kw):
    """Float64 stand-in for FA3's paged varlen call with ``q_v`` (causal bottom-right), [T, H, 512]."""
    calls.append(kw)
    q, q_v, k, v = kw["q"], kw["q_v"], kw["k"][:, :, 0], kw["v"][:, :, 0]
    page = k.shape[1]
    cu, used, table = kw["cu_seqlens_q"].tolist(), kw["seqused_k"].tolist(), kw["block_table"]
    outs, lses = [], []
    for r, n in enumerate(used):
        pages = table[r, : -(-n // page)].long()
        kr, vr = (
            k[pages].reshape(-1, k.shape[-1])[:n].double(),
            v[pages].reshape(-1, v.shape[-1])[:n].double(),
        )
        qs = slice(cu[r], cu[r + 1])
        s = (q[qs].double() @ kr.T + q_v[qs].double() @ vr.T) * kw["softmax_scale"]  # [Lq, H, n]
        lq = s.shape[0]
        if kw["causal"]:
            mask = torch.ones(lq, n, dtype=torch.bool).triu(n - lq + 1)
            s = s.masked_fill(mask[:, None, :], float("-inf"))
        outs.append(torch.softmax(s, dim=-1) @ vr)
        lses.append(torch.logsumexp(s, dim=-1).T)  # [H, Lq], natural log, as FA3 returns it
    out = torch.cat(outs).to(q.dtype)
    return (out, torch.cat(lses, dim=1).float()) if kw["return_softmax_lse"] else out


def lse_merge(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse=None):
    """Float64 stand-in for vLLM's ``merge_attn_states`` (its keywords)."""
    wp, wo = prefix_lse.T.double()[..., None], suffix_lse.T.double()[..., None]
    top = torch.maximum(wp, wo)
    wp, wo = torch.exp(wp - top), torch.exp(wo - top)
    output.copy_((prefix_output.double() * wp + suffix_output.double() * wo) / (wp + wo))
    if output_lse is not None:
        output_lse.copy_((top + torch.log(wp + wo))[..., 0].T)


@pytest.mark.parametrize("private", [200, 128])  # new tokens starting in a partly filled block, and not
def test_the_absorbed_side_is_attention_over_context_and_new_tokens(private):
    case = bench.make_case(3, 256, private, 40, "cpu", seed=2)
    calls = []
    run = bench.prepare_absorbed(case, "cpu", attention=lambda **kw: paged_latent_attention(calls, **kw))
    out = run().view(case["q"].shape[0], bench.R1_TP8["num_heads"], -1).double()
    ref, _ = bench.whole_reference(case, decode=True)
    assert (out - ref).abs().max() <= 0.02 * ref.abs().max()
    context_only, _ = bench.whole_reference(case, decode=False)
    assert (out - context_only).abs().max() > 0.1 * ref.abs().max()  # the new tokens' own keys count
    (call,) = calls
    assert call["seqused_k"].tolist() == [256 + private + 40] * 3
    assert call["causal"] and call["fa_version"] == 3 and call["num_splits"] == 0
    assert call["q_v"].shape == (120, 16, 512) and call["q"].shape == (120, 16, 64)


@pytest.mark.parametrize("private", [0, 200, 128])
def test_the_shared_decode_candidate_is_each_requests_attention_over_prefix_own_context_and_new_tokens(
    private,
):
    new = 1
    case = bench.make_case(4, 256, private, new, "cpu", seed=3)
    calls = []
    attention = lambda **kw: paged_latent_attention(calls, **kw)  # noqa: E731
    run = bench.prepare_shared_absorbed(case, "cpu", attention=attention, merge=lse_merge, num_splits=8)
    out = run().view(case["q"].shape[0], bench.R1_TP8["num_heads"], -1).double()
    ref, _ = bench.whole_reference(case, decode=True)
    assert (out - ref).abs().max() <= 0.02 * ref.abs().max()
    own, shared = calls  # the path's order: the step's call over own pages, then each group's
    assert shared["block_table"].tolist() == [list(range(4))] and shared["seqused_k"].tolist() == [256]
    assert not shared["causal"] and shared["cu_seqlens_q"].tolist() == [0, 4 * new]  # one call, every query
    assert own["causal"] and own["seqused_k"].tolist() == [private + new] * 4
    assert shared["num_splits"] == 8 and own["num_splits"] == 0  # --shared-splits: the prefix call's only


def test_the_decode_sides_accuracy_check_runs_on_a_step_the_path_serves():
    # The benchmark's float64 check once fed the decode sides 48 new tokens a request, which the path
    # never serves: every shared_absorbed run stopped there before measuring.
    attention = lambda **kw: paged_latent_attention([], **kw)  # noqa: E731
    errors = bench.reference_errors(None, "cpu", ("absorbed", "shared_absorbed"), attention, lse_merge)
    assert set(errors) == {"absorbed_out_err", "shared_absorbed_out_err"}
    assert max(errors.values()) < 0.01


def test_the_shared_decode_side_measures_only_what_the_path_serves():
    case = bench.make_case(4, 256, 128, 3, "cpu", seed=3)  # three new tokens a request: never served
    with pytest.raises(ValueError, match="one new token"):
        bench.prepare_shared_absorbed(case, "cpu", attention=lambda **kw: None, merge=lse_merge)


def test_the_decode_table_gives_each_request_its_own_new_blocks():
    table = block_table(2, 128, 100)  # 2 shared blocks, 2 private each (the second partly filled)
    decode = decode_table(table, [228, 228], 100, first_free=7)
    assert decode.tolist() == [[0, 1, 2, 3, 7, 8], [0, 1, 4, 5, 9, 10]]


def _keywords(func, callee: str) -> set[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func).endswith(callee)]
    assert len(calls) == 1
    return {k.arg for k in calls[0].keywords}


def test_the_absorbed_call_passes_what_vllms_flash_attn_mla_passes():
    from vllm.v1.attention.backends.mla.flashattn_mla import FlashAttnMLAImpl, FlashAttnMLAMetadataBuilder

    case = bench.make_case(2, 128, 64, 8, "cpu")
    calls, schedules = [], []
    bench.prepare_absorbed(
        case,
        "cpu",
        num_splits=32,
        attention=lambda **kw: paged_latent_attention(calls, **kw),
        schedule=lambda **kw: schedules.append(kw),
    )()
    assert set(calls[0]) == _keywords(FlashAttnMLAImpl.forward_mqa, "flash_attn_varlen_func")
    assert set(schedules[0]) == _keywords(
        FlashAttnMLAMetadataBuilder._schedule_decode, "get_scheduler_metadata"
    )
    assert schedules[0]["num_splits"] == calls[0]["num_splits"] == 32
    assert (schedules[0]["headdim"], schedules[0]["headdim_v"], schedules[0]["page_size"]) == (64, 512, 64)


# --- the prediction and the crossover -----------------------------------------------------------


def test_the_prediction_is_the_routers_time_model_with_the_prefix_up_projected_once():
    table = block_table(16, 32768, 0)
    p = bench.predicted_cost(table, [32768] * 16, 128)
    attention = 16 * 128 * 32768  # (query, context token) pairs, per head
    # FLOPs per head over the H200 rates (TFLOP/s = 1e6 FLOP per microsecond)
    assert p["absorbed_us"] == pytest.approx(2 * (576 + 512) * attention / 622e6)
    up_projection = 2 * 512 * 256 * 32768  # one up-projection of the prefix
    assert p["prefill_us"] == pytest.approx(2 * (192 + 128) * attention / 739e6 + up_projection / 215e6)
    assert (p["groups"], p["short_extends"], p["router_moves"]) == (1, True, True)
    assert p["predicted_ratio"] == pytest.approx(p["absorbed_us"] / p["prefill_us"])


def test_the_time_model_matches_the_h200_layer_measurement_where_flops_alone_did_not():
    """One R1 layer on the H200 (docs/results/h200-2026-12-01-shared-prefix-engine-run2): absorbed / shared
    measured 1.06x at N=32, 2.23x at 128, 3.08x at 256, 3.44x at 512 (16 requests, 32k shared prefix).
    By FLOPs alone the router predicted 1.89x at N=32 and moved a step that only broke even."""
    table = block_table(16, 32768, 0)
    measured = {32: 1.06, 128: 2.23, 256: 3.08, 512: 3.44}
    for new, ratio in measured.items():
        p = bench.predicted_cost(table, [32768] * 16, new)
        assert p["predicted_ratio"] == pytest.approx(ratio, rel=0.1), new
        assert p["router_moves"] == (new > 32), new


def test_private_contexts_and_long_extends_are_not_moved():
    private = bench.predicted_cost(block_table(16, 0, 8192), [8192] * 16, 512)
    assert private["groups"] == 0 and not private["router_moves"]
    assert private["prefill_us"] == pytest.approx(
        2 * 320 * 16 * 512 * 8192 / 739e6 + 2 * 512 * 256 * 16 * 8192 / 215e6
    )
    long = bench.predicted_cost(block_table(16, 32768, 0), [32768] * 16, 1024)
    assert long["groups"] == 1 and not long["short_extends"] and not long["router_moves"]


def row(new, vllm, shared, absorbed, predicted, groups=1):
    prediction = dict(
        absorbed_us=predicted,
        prefill_us=1.0,
        predicted_ratio=predicted,
        groups=groups,
        short_extends=new <= 512,
        router_moves=new <= 512 and groups > 0 and predicted > 1 / 0.8,
    )
    times = {k: v for k, v in dict(vllm=vllm, shared=shared, absorbed=absorbed).items() if v is not None}
    return bench.point_row(new, times, 1.0, {}, prediction)


def test_a_row_keeps_the_fields_of_earlier_runs_and_adds_the_absorbed_side():
    r = row(32, 10.0, 1.0, 2.5, 1.9)
    assert list(r)[:5] == ["new", "vllm_ms", "shared_ms", "ratio", "plan_ms"]
    assert (r["ratio"], r["absorbed_ms"], r["absorbed_over_shared"], r["absorbed_over_vllm"]) == (
        10.0,
        2.5,
        2.5,
        0.25,
    )
    only = row(32, None, None, 2.5, 1.9)
    assert "ratio" not in only and "absorbed_over_shared" not in only and only["absorbed_ms"] == 2.5


def test_the_crossover_names_the_fastest_side_and_judges_each_decision_by_the_same_margin():
    rows = [
        row(32, 10.0, 1.0, 2.0, 1.9),  # moves, measured 2.0 > 1.25: right
        row(64, 10.0, 2.0, 2.2, 1.9),  # moves, measured 1.1: faster, but not by the margin: wrong
        row(128, 10.0, 2.0, 3.0, 1.1),  # stays, measured 1.5: wrong
        row(512, 10.0, 5.0, 4.0, 1.0),  # stays, absorbed faster: right
        row(1024, 10.0, 8.0, 9.0, 5.0),  # not a short extend: not judged
        row(256, 3.0, 3.0, 1.0, 9.0, groups=0),  # no group: the router cannot move it
    ]
    s = bench.crossover(rows, 0.8)
    assert [p["fastest"] for p in s["points"]] == [
        "shared",
        "shared",
        "shared",
        "absorbed",
        "shared",
        "absorbed",
    ]
    assert [p.get("router_right") for p in s["points"]] == [True, False, False, True, None, None]
    assert s["gain_needed"] == pytest.approx(1.25) and not s["consistent"]
    assert s["points"][0]["measured_over_predicted"] == pytest.approx(2.0 / 1.9)
    fits = bench.crossover([rows[0], rows[3], rows[4]], 0.8)
    assert fits["consistent"]
    lines = bench.crossover_lines(s)
    assert "(wrong)" in lines[2] and "(wrong)" not in lines[1] and "decided wrong" in lines[-1]
    assert "every point decided as measured" in bench.crossover_lines(fits)[-1]
    decode = dict(row(1, None, None, 0.94, 0.3), shared_absorbed_ms=0.35)  # the decode candidate is measured
    assert bench.crossover([decode], 0.8)["points"][0]["fastest"] == "shared_absorbed"


def _runner_batch(table, context_lens, new):
    """vLLM's runner ``InputBatch`` (CPU) holding the bench's requests, ``new`` tokens scheduled each."""
    bs = bench.BLOCK_SIZE
    requests = [
        (table[i, : -(-(ctx + new) // bs)].tolist(), ctx, ctx + new) for i, ctx in enumerate(context_lens)
    ]
    batch = runner_input_batch(requests, bs, max_model_len=16384)
    return batch, {f"r{i}": new for i in range(len(context_lens))}


@pytest.mark.parametrize(
    "requests, prefix, private, new",
    [(16, 4096, 0, 32), (16, 4096, 64, 512), (2, 128, 0, 8), (16, 0, 2048, 512), (4, 1024, 0, 600)],
)
def test_the_prediction_decides_as_the_router_does_on_vllms_input_batch(requests, prefix, private, new):
    from mla_prefill_ext.hosts.core.shared_prefix import routing

    table = block_table(requests, prefix, private)
    ctx = [prefix + private] * requests
    decode = decode_table(table, ctx, new, first_free=int(table.max()) + 1)
    batch, scheduled = _runner_batch(decode, ctx, new)
    routed = routing.step_threshold(batch, scheduled, SHORT_EXTEND_MAX) == 1
    assert bench.predicted_cost(table, ctx, new)["router_moves"] == routed


def test_the_crossover_grid_measures_both_decodes_on_the_same_rows():
    from scripts.bench import shared_decode_crossover as grid

    attention = lambda **kw: paged_latent_attention([], **kw)  # noqa: E731
    point = grid.measure(
        4, 256, 64, "cpu", 1, time_it=lambda run, n: (run(), 2.0)[1], attention=attention, merge=lse_merge
    )
    assert (point["requests"], point["prefix"], point["private"], point["ratio"]) == (4, 256, 64, 1.0)
    assert point["max_out_diff"] < 0.01  # the same attention, summed in two parts


def point(b, p, s, ratio):
    return dict(requests=b, prefix=p, private=s, ratio=ratio)


def test_the_crossover_is_the_fewest_requests_from_which_every_point_is_faster():
    from scripts.bench.shared_decode_crossover import crossover

    points = [
        point(32, 32768, 0, 1.2),
        point(32, 32768, 256, 0.9),  # one S loses: not from 32
        point(64, 32768, 0, 2.1),
        point(64, 32768, 256, 1.5),
        point(128, 32768, 0, 2.7),
        point(128, 32768, 256, 2.6),
        point(48, 8192, 0, 1.1),
        point(64, 8192, 0, 0.8),
        point(96, 8192, 0, 1.3),  # won at 48, lost at 64
        point(128, 4096, 0, 0.7),
    ]
    assert crossover(points) == {4096: None, 8192: 96, 32768: 64}
