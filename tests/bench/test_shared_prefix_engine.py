"""The shared-prefix engine benchmark's parts that run without a GPU: its sides and points, the prompts
(one cached prefix, fresh tokens new for every request and repetition), taking turns, the paired ratios
and the table; the engine's arguments read by the installed vLLM's own ``EngineArgs``.

Its numbers come from the GPU host (docs/benchmarks.md, "Shared-prefix engine benchmark").
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.bench import engine
from scripts.bench import shared_prefix_engine as bench
from scripts.bench.path_parts import PARTS
from scripts.bench.shared_prefix_table import (
    cache_notes,
    comparison_lines,
    comparisons,
    lifetime_table,
    markdown,
    paired_ratio,
    pause_table,
    tabulate,
)
from scripts.bench.shared_prefix_workload import (
    Point,
    build_points,
    check_fits,
    parse_points,
    parse_sides,
    timed_prompts,
    warm_prompts,
)

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 16160  # the R1 slice's


def default_plan(**flags):
    args = bench.make_parser().parse_args([f"--{k.replace('_', '-')}={v}" for k, v in flags.items()])
    return bench.plan(args)


# --- sides and points ---------------------------------------------------------------------------


def test_the_default_sides_are_stock_and_the_backend_with_the_path_on_and_off():
    sides, _ = default_plan()
    assert [(s.label, s.backend, s.extra_env) for s in sides] == [
        ("stock", "stock", {}),
        ("FLASH_ATTN", "FLASH_ATTN", {}),  # the add-on's default: the path on where supported
        ("FLASH_ATTN:noshare", "FLASH_ATTN", {"MLA_PREFILL_SHARED_PREFIX": "0"}),
    ]
    assert [s.label for s in parse_sides("stock, flashinfer:NOSHARE")] == ["stock", "FLASHINFER:noshare"]
    decode = parse_sides("FLASH_ATTN:decode,FLASH_ATTN:decode:2,FLASH_ATTN:decode-piecewise")
    assert [(s.label, dict(s.env)) for s in decode] == [
        ("FLASH_ATTN:decode", {"MLA_PREFILL_SHARED_DECODE": "1"}),
        ("FLASH_ATTN:decode:2", {"MLA_PREFILL_SHARED_DECODE": "1"}),
        (
            "FLASH_ATTN:decode-piecewise",
            {"MLA_PREFILL_SHARED_DECODE": "1", "MLA_BENCH_CUDAGRAPH_MODE": "PIECEWISE"},
        ),
    ]


def test_sides_with_and_without_the_engine_cores_gathering():
    sides = parse_sides("flash_attn:nogather,FLASH_ATTN:Gather,FLASH_ATTN:gather40")
    assert [(s.label, s.backend, s.extra_env) for s in sides] == [
        ("FLASH_ATTN:nogather", "FLASH_ATTN", {"MLA_PREFILL_SHARED_PREFIX_GATHER_MS": "0"}),
        ("FLASH_ATTN:gather", "FLASH_ATTN", {"MLA_PREFILL_SHARED_PREFIX_GATHER_MS": "100"}),
        ("FLASH_ATTN:gather40", "FLASH_ATTN", {"MLA_PREFILL_SHARED_PREFIX_GATHER_MS": "40"}),
    ]
    for bad in ("gather2000", "gather0", "gather²", "gathersoon"):  # windows the add-on would refuse
        with pytest.raises(ValueError, match="unknown mode"):
            parse_sides(f"FLASH_ATTN:{bad}")


def test_a_second_stock_lifetime_is_a_side_of_its_own():
    sides = parse_sides("stock,stock:2,FLASH_ATTN")
    assert [(s.label, s.backend, s.extra_env) for s in sides] == [
        ("stock", "stock", {}),
        ("stock:2", "stock", {}),
        ("FLASH_ATTN", "FLASH_ATTN", {}),
    ]


def test_any_engine_side_has_more_lifetimes():
    sides = parse_sides(
        "FLASH_ATTN,flash_attn:2,FLASH_ATTN:noshare,FLASH_ATTN:NOSHARE:3,FLASH_ATTN:gather40:2"
    )
    assert [(s.label, s.backend, s.extra_env, s.engine) for s in sides] == [
        ("FLASH_ATTN", "FLASH_ATTN", {}, None),
        ("FLASH_ATTN:2", "FLASH_ATTN", {}, None),
        ("FLASH_ATTN:noshare", "FLASH_ATTN", {"MLA_PREFILL_SHARED_PREFIX": "0"}, None),
        ("FLASH_ATTN:noshare:3", "FLASH_ATTN", {"MLA_PREFILL_SHARED_PREFIX": "0"}, None),
        ("FLASH_ATTN:gather40:2", "FLASH_ATTN", {"MLA_PREFILL_SHARED_PREFIX_GATHER_MS": "40"}, None),
    ]


@pytest.mark.parametrize(
    "text, error",
    [
        ("FLASH_ATTN:1", "a lifetime is 2 or more"),
        ("FLASH_ATTN,FLASH_ATTN:pause:2", "a pause side runs on another side's engine"),
        ("FLASH_ATTN:2,flash_attn:2", "listed twice"),
        ("FLASH_ATTN:sometimes:2", "unknown mode 'sometimes'"),
        ("FLASH_ATTN:noshare:2:3", "one mode, then at most one lifetime number"),
        ("FLASH_ATTN:2:2", "one mode, then at most one lifetime number"),
        ("FLASH_ATTN:2:pause", "one mode, then at most one lifetime number"),
        ("stock:2:3", "one mode, then at most one lifetime number"),
        ("FLASH_ATTN:²", "unknown mode '²'"),
        ("FLASH_ATTN::2", "one mode, then at most one lifetime number"),
        ("stock::2", "one mode, then at most one lifetime number"),
        ("FLASH_ATTN:noshare:", "one mode, then at most one lifetime number"),
        ("stock:²", "stock runs none of the add-on"),
        ("stock:noshare", "stock runs none of the add-on"),
        ("stock:1", "stock runs none of the add-on"),
        ("stock,stock:2,STOCK:2", "listed twice"),
        ("FLASH_ATTN:nosharing", "unknown mode 'nosharing'"),
        ("stock,FLASH_ATTN,flash_attn", "listed twice"),
        ("stock,,FLASH_ATTN", "empty side"),
    ],
)
def test_a_side_that_cannot_be_run_is_refused(text, error):
    with pytest.raises(ValueError, match=error):
        parse_sides(text)


def test_points_are_b_requests_of_n_fresh_tokens():
    assert parse_points("16x32, 8X1024") == [(16, 32), (8, 1024)]
    for bad in ("16", "0x32", "16x", "ax4", "16x32x2"):
        with pytest.raises(ValueError, match="write BxN"):
            parse_points(bad)


def test_the_default_run_holds_every_scenario_of_the_issue():
    _, points = default_plan()
    keys = [p.key for p in points]
    assert len(keys) == len(set(keys))
    by = {
        s: [(p.prefix_len, p.batch, p.new_tokens, p.max_tokens) for p in points if p.scenario == s]
        for s in ("shared", "private", "fresh", "decode")
    }
    issue_points = [(16, 32), (16, 128), (16, 512), (8, 1024), (4, 2048)]
    assert by["shared"] == [(p, b, n, 1) for p in (32768, 8192) for b, n in issue_points]
    assert by["private"] == [(8192, 16, n, 1) for n in (32, 128, 512)]
    assert by["fresh"] == [(0, b, n, 1) for b, n in issue_points]
    assert by["decode"] == [(32768, 16, 32, 64)]
    _, only = default_plan(scenarios="fresh,shared", prefix_lens="8192", points="4x8")
    assert [p.key for p in only] == ["fresh P=0 B=4 N=8", "shared P=8192 B=4 N=8"]


def test_a_run_whose_requests_do_not_fit_is_refused_before_any_engine_starts():
    with pytest.raises(ValueError, match="unknown scenario"):
        default_plan(scenarios="shared,mixed")
    points = build_points(["decode"], [], [], 0, [], 32768, [(16, 32)], 64)
    check_fits(points, 32768 + 32 + 64)
    with pytest.raises(ValueError, match="longer than --max-model-len 32863"):
        check_fits(points, 32768 + 32 + 63)
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.bench", "shared_prefix_engine", "--baseline", "FLASHINFER"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "--baseline 'FLASHINFER' is not one of the sides" in proc.stderr


# --- prompts ------------------------------------------------------------------------------------


def test_shared_prompts_share_the_cached_prefix_and_nothing_else():
    point = Point("shared", 1024, 16, 32)
    (prefix,) = warm_prompts(point, VOCAB)  # one prefix, warmed once
    assert len(prefix) == 1024
    reps = [timed_prompts(point, rep, VOCAB) for rep in range(3)]
    suffixes = []
    for prompts in reps:
        assert len(prompts) == 16
        for p in prompts:
            assert len(p) == 1024 + 32 and p[:1024] == prefix
            assert all(2 <= t < VOCAB for t in p)
            suffixes.append(tuple(p[1024:]))
    # fresh for every request and every repetition, from their first token on: only the prefix hits
    assert len({s[:4] for s in suffixes}) == len(suffixes) == 48
    # every side gets the same prompts in one repetition
    assert timed_prompts(point, 1, VOCAB) == reps[1]


def test_each_prefix_length_has_one_prefix_that_the_decode_mix_reuses():
    long, short = Point("shared", 4096, 4, 8), Point("shared", 1024, 4, 8)
    decode = Point("decode", 4096, 16, 32, max_tokens=64)
    assert (
        warm_prompts(decode, VOCAB)
        == warm_prompts(long, VOCAB)
        == warm_prompts(Point("shared", 4096, 8, 2), VOCAB)
    )
    assert warm_prompts(short, VOCAB)[0] != warm_prompts(long, VOCAB)[0][:1024]  # not each other's start
    assert all(p[:4096] == warm_prompts(long, VOCAB)[0] for p in timed_prompts(decode, 1, VOCAB))


def test_private_prompts_each_start_with_their_own_cached_prefix():
    point = Point("private", 512, 16, 32)
    warm = warm_prompts(point, VOCAB)
    assert len(warm) == 16 and len({tuple(w) for w in warm}) == 16
    for rep in (0, 1):
        prompts = timed_prompts(point, rep, VOCAB)
        assert [p[:512] for p in prompts] == warm  # the same prefixes every repetition
        assert len({tuple(p[512:]) for p in prompts}) == 16
    assert timed_prompts(point, 0, VOCAB)[0][512:] != timed_prompts(point, 1, VOCAB)[0][512:]


def test_fresh_prompts_have_nothing_to_warm_and_nothing_shared():
    point = Point("fresh", 0, 16, 128)
    assert warm_prompts(point, VOCAB) == [] and point.cached_tokens() == 0
    prompts = timed_prompts(point, 1, VOCAB)
    assert all(len(p) == 128 for p in prompts) and len({tuple(p[:4]) for p in prompts}) == 16
    shared = timed_prompts(Point("shared", 1024, 16, 128), 1, VOCAB)
    assert not {tuple(p[:4]) for p in prompts} & {tuple(p[1024:1028]) for p in shared}


# --- taking turns -------------------------------------------------------------------------------


def test_every_repetition_warms_then_times_every_side_in_a_rotating_order():
    points = [Point("shared", 64, 2, 4), Point("fresh", 0, 3, 5)]
    sides = ["stock", "A", "A:noshare"]
    calls = []

    def warm(side, prompts):
        calls.append(("warm", side, len(prompts)))

    reps_seen = []

    def timed(side, prompts, point, rep):
        calls.append(("timed", side, tuple(map(tuple, prompts))))
        reps_seen.append(rep)
        return float(len(calls)), 0, len(prompts) * point.max_tokens  # "seconds": the call's number

    orders = []
    raw = bench.take_turns(
        points, sides, 3, VOCAB, warm, timed, lambda rep, order, raw: orders.append(order) or True
    )
    assert orders == [sides, ["A", "A:noshare", "stock"], ["A:noshare", "stock", "A"], sides]
    per_rep = 2 * len(sides) + len(sides)  # the shared point's warm-ups and timed runs, the fresh point's
    assert len(calls) == 4 * per_rep
    assert reps_seen == [rep for rep in range(4) for _ in range(2 * len(sides))]
    for rep in range(4):
        block = calls[rep * per_rep : (rep + 1) * per_rep]
        assert block[:3] == [("warm", s, 1) for s in sides]  # before any timed run of that point
        assert [c[1] for c in block[3:6]] == orders[rep] == [c[1] for c in block[6:9]]
        assert len({c[2] for c in block[3:6]}) == 1  # the same prompts to every side
        assert block[3][2] == tuple(map(tuple, timed_prompts(points[0], rep, VOCAB)))
    # repetition 0 is untimed: 3 timed values per side and point, in repetition order
    assert {k: len(v) for k, v in raw["seconds"]["A"].items()} == {p.key: 3 for p in points}
    # stock's timed run of the shared point: third in repetition 1, second in 2, first in 3
    assert raw["seconds"]["stock"][points[0].key] == [
        per_rep + 3 + 3,
        2 * per_rep + 3 + 2,
        3 * per_rep + 3 + 1,
    ]
    assert raw["output_tokens"]["A"][points[1].key] == [3, 3, 3]


def test_a_run_stops_after_the_repetition_that_says_so():
    points = [Point("fresh", 0, 1, 2)]
    raw = bench.take_turns(
        points,
        ["stock", "A"],
        5,
        VOCAB,
        lambda *a: None,
        lambda *a: (1.0, 0, 1),
        lambda rep, order, raw: rep < 2,
    )
    assert raw["seconds"]["stock"][points[0].key] == [1.0, 1.0]  # repetitions 1 and 2, then stopped


def test_a_run_with_a_time_limit_times_at_least_once_and_ends_within_it():
    assert bench.keep_going(0, elapsed=500.0, last=100.0, stop_after=300.0)  # the untimed repetition
    assert bench.keep_going(1, elapsed=200.0, last=100.0, stop_after=None)
    assert bench.keep_going(1, elapsed=200.0, last=100.0, stop_after=300.0)
    assert not bench.keep_going(1, elapsed=200.0, last=100.5, stop_after=300.0)


def test_a_worker_that_does_not_see_the_sides_switch_stops_the_run():
    off, on = parse_sides("FLASH_ATTN:noshare,FLASH_ATTN")
    bench.check_switch(off, {"workers": [{"shared_prefix_env": "0"}]})
    bench.check_switch(on, {"workers": [{"shared_prefix_env": None}]})
    with pytest.raises(SystemExit, match="sees MLA_PREFILL_SHARED_PREFIX=None, the side sets '0'"):
        bench.check_switch(off, {"workers": [{"shared_prefix_env": "0"}, {"shared_prefix_env": None}]})
    with pytest.raises(SystemExit, match="sees MLA_PREFILL_SHARED_PREFIX='0', the side sets None"):
        bench.check_switch(on, {"workers": [{"shared_prefix_env": "0"}]})


def test_the_engines_arguments_are_the_installed_vllms_own():
    """Every argument the sides' engines get is a field of the installed vLLM's ``EngineArgs`` (what
    ``LLM`` builds from them), and prefix caching is on."""
    from vllm.engine.arg_utils import EngineArgs

    args = bench.make_parser().parse_args([])
    kwargs = engine.engine_kwargs(args, enable_prefix_caching=True)
    assert set(kwargs) <= {f.name for f in dataclasses.fields(EngineArgs)}
    assert kwargs["enable_prefix_caching"] is True and kwargs["enforce_eager"] is False
    assert (kwargs["max_num_batched_tokens"], kwargs["max_model_len"], kwargs["gpu_memory_utilization"]) == (
        8192,
        40960,
        0.28,
    )
    assert engine.engine_kwargs(argparse.Namespace(**{**vars(args), "eager": True}))["enforce_eager"] is True


# --- the table ----------------------------------------------------------------------------------


def test_a_ratio_is_the_median_of_paired_ratios_not_the_ratio_of_medians():
    stock, side = [2.0, 1.0, 4.0], [1.0, 1.0, 1.0]
    r = paired_ratio(stock, side)
    assert (r["median"], r["min"], r["max"], r["all"]) == (2.0, 1.0, 4.0, [2.0, 1.0, 4.0])
    assert paired_ratio([1.0, 3.0, 2.0], [2.0, 1.0, 4.0])["median"] == 0.5  # ratios 0.5, 3, 0.5
    with pytest.raises(ValueError):
        paired_ratio([1.0], [1.0, 2.0])


def sample_run():
    shared, decode = Point("shared", 32768, 16, 128), Point("decode", 32768, 16, 32, max_tokens=64)
    sides = ["stock", "FLASH_ATTN", "FLASH_ATTN:noshare"]
    seconds = {
        "stock": {shared.key: [0.5, 0.4, 0.6], decode.key: [2.0, 2.0, 2.0]},
        "FLASH_ATTN": {shared.key: [0.25, 0.25, 0.25], decode.key: [1.0, 2.0, 4.0]},
        "FLASH_ATTN:noshare": {shared.key: [0.5, 0.5, 0.5], decode.key: [2.0, 2.0, 2.0]},
    }
    out = {s: {shared.key: [16] * 3, decode.key: [1024] * 3} for s in sides}
    cached = {s: {shared.key: [16 * 32768] * 3, decode.key: [16 * 32768] * 3} for s in sides}
    cached["FLASH_ATTN:noshare"][decode.key][1] = 15 * 32768  # one run where the cache fell short
    return [shared, decode, Point("fresh", 0, 4, 8)], sides, seconds, out, cached


def test_the_table_pairs_each_side_with_stock_and_checks_the_cache():
    points, sides, seconds, out, cached = sample_run()
    table = tabulate(points, sides, "stock", seconds, out, cached)
    assert [row["key"] for row in table] == [points[0].key, points[1].key]  # the fresh point never ran
    shared, decode = table
    assert shared["reps"] == 3 and shared["sides"]["stock"]["median_s"] == 0.5
    assert shared["ratios"]["FLASH_ATTN"]["all"] == [2.0, 1.6, 2.4] and "stock" not in shared["ratios"]
    assert shared["ratios"]["FLASH_ATTN:noshare"]["median"] == 1.0
    assert "output_tokens_per_s" not in shared["sides"]["stock"]
    assert decode["sides"]["FLASH_ATTN"]["output_tokens_per_s"] == 512.0  # 1024 tokens in 2.0 s (median)
    assert decode["sides"]["FLASH_ATTN:noshare"]["cache_as_planned"] is False
    assert shared["sides"]["FLASH_ATTN:noshare"]["cache_as_planned"] is True
    assert cache_notes(table) == [
        f"FLASH_ATTN:noshare, {points[1].key}: the prefix cache served [491520, 524288] tokens per run, "
        "not 524288"
    ]


def test_the_markdown_table_shows_seconds_and_ratios_with_their_range():
    points, sides, seconds, out, cached = sample_run()
    lines = markdown(tabulate(points, sides, "stock", seconds, out, cached), sides, "stock")
    assert lines == [
        "| scenario | P | B | N | stock s | FLASH_ATTN s | FLASH_ATTN:noshare s | FLASH_ATTN x stock "
        "| FLASH_ATTN:noshare x stock |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        "| shared | 32768 | 16 | 128 | 0.500 | 0.250 | 0.500 | 2.000 [1.600-2.400] | 1.000 [0.800-1.200] |",
        "| decode | 32768 | 16 | 32 (+64 out) | 2.000 (512 out tok/s) | 2.000 (512 out tok/s) "
        "| 2.000 (512 out tok/s) | 1.000 [0.500-2.000] | 1.000 [1.000-1.000] |",
    ]
    no_stock = markdown(tabulate(points, sides[1:], "stock", seconds, out, cached), sides[1:], "stock")
    assert no_stock[0] == "| scenario | P | B | N | FLASH_ATTN s | FLASH_ATTN:noshare s |"


def test_the_paths_counters_per_timed_call_and_their_summary():
    before = {"steps": 10, "steps_routed": 2, "steps_with_segments": 3, "blocks_reused": 0, "hits_reused": 7}
    before["gathered"] = 4
    after = {
        "steps": 12,
        "steps_routed": 3,
        "steps_with_segments": 5,
        "steps_with_decode_groups": 9,
        "steps_dispatched_piecewise": 4,
        "blocks_reused": 30720,
        "hits_reused": 30727,
        "gathered": 19,
    }
    assert bench.counter_delta(before, after) == {
        "steps": 2,
        "steps_routed": 1,
        "steps_with_segments": 2,
        "steps_with_decode_groups": 9,
        "steps_dispatched_piecewise": 4,
        "blocks_reused": 30720,
        "hits_reused": 30720,
        "gathered": 15,
        "shapes": [],
    }
    assert bench.counter_delta(None, after) is None  # stock: no path to count
    records = [
        {
            "side": "FLASH_ATTN",
            "requests": 16,
            "prompt_len": 32896,
            "steps": 2,
            "steps_routed": 1,
            "steps_with_segments": 1,
            "blocks_reused": 30720,
            "hits_reused": 30720,
            "gathered": 15,
        },
        {
            "side": "FLASH_ATTN",
            "requests": 16,
            "prompt_len": 32896,
            "steps": 1,
            "steps_routed": 1,
            "steps_with_segments": 1,
            "blocks_reused": 32768,
            "hits_reused": 30720,
            "gathered": 0,
        },
    ]
    assert bench.path_steps_lines(records) == [  # records of an older run: no point, no repetition
        "FLASH_ATTN 16 x 32896 tokens: steps [2, 1], steps_routed [1, 1], steps_with_segments [1, 1], "
        "steps_with_decode_groups [0, 0], steps_dispatched_piecewise [0, 0], blocks_reused [30720, 32768], "
        "hits_reused [30720, 30720], "
        "gathered [15, 0]"
    ]
    # By point, the warm-up left out: two points with equal B and prompt length stay apart.
    shared, private = "shared P=8192 B=16 N=128", "private P=8192 B=16 N=128"
    pointed = [
        {**records[0], "point": shared, "rep": 0},
        {**records[0], "point": shared, "rep": 1},
        {**records[1], "point": private, "rep": 1},
    ]
    lines = bench.path_steps_lines(pointed)
    assert [line.split(":")[0] for line in lines] == [f"FLASH_ATTN {shared}", f"FLASH_ATTN {private}"]
    assert lines[0].split(": ")[1].startswith("steps [2], steps_routed [1]")


def test_a_calls_step_shapes_are_its_own_steps_of_the_first_worker():
    # Two workers (TP=2): the summed counters count each step twice; the shapes are worker 0's ring.
    zero = dict.fromkeys(
        ("steps_routed", "steps_with_segments", "blocks_reused", "hits_reused", "gathered"), 0
    )
    before = {**zero, "steps": 20, "first_worker_steps": 10, "shapes": [(1, 129, False)] * 10}
    ring = [(1, 129, False)] * 10 + [(1, 128, False), (15, 1920, True), (0, 0, False)]
    after = {**zero, "steps": 26, "first_worker_steps": 13, "shapes": ring}
    delta = bench.counter_delta(before, after)
    assert delta["steps"] == 6
    assert delta["shapes"] == [[1, 128, False], [15, 1920, True], [0, 0, False]]
    record = {"side": "FLASH_ATTN", "requests": 16, "prompt_len": 32896, **delta}
    assert bench.path_steps_lines([record])[1] == "  steps as requests/tokens: [1/128 15/1920r 0/0]"
    # A call longer than the ring keeps the ring's steps, the call's last.
    long_after = {**after, "first_worker_steps": 400, "shapes": ring}
    assert len(bench.counter_delta(before, long_after)["shapes"]) == len(ring)


def test_memory_lines_say_the_peak_beyond_the_kv_cache():
    gib = 1 << 30
    lines = bench.memory_lines(
        {
            "FLASH_ATTN": [
                {
                    "peak_allocated": 30 * gib,
                    "kv_cache": 18 * gib,
                    "reserved": 31 * gib,
                    "device_total": 140 * gib,
                }
            ]
        }
    )
    assert lines == [
        "memory FLASH_ATTN worker 0: peak allocated 30.00 GiB (KV cache 18.00 GiB, beyond it 12.00 GiB), "
        "reserved 31.00 GiB of 140.0 GiB"
    ]


def test_each_side_is_read_against_every_stock_lifetime():
    key = "fresh P=0 B=16 N=32"
    seconds = {
        "stock": {key: [1.0, 2.0, 1.0]},
        "stock:2": {key: [1.1, 2.2, 0.9]},  # vs stock 0.909 (median of 0.909, 0.909, 1.111); stock vs it 1.1
        "FLASH_ATTN": {key: [1.0, 2.5, 1.0]},  # vs stock 1.0 (1.0, 0.8, 1.0); vs stock:2 0.9 (1.1, 0.88, 0.9)
        "FLASH_ATTN:noshare": {key: [1.0, 2.0, 1.0]},  # vs stock 1.0; vs stock:2 1.1
        "FLASH_ATTN:pause": {key: []},  # not reached: no row
    }
    sides = ["stock", "stock:2", "FLASH_ATTN", "FLASH_ATTN:noshare", "FLASH_ATTN:pause"]
    lines = lifetime_table(seconds, sides, ["stock", "stock:2"])
    assert lines[2:] == [
        f"| {key} | stock lifetimes among themselves | 0.909 | 1.100 | - |",
        f"| {key} | FLASH_ATTN | 0.900 | 1.000 | 0.009 |",
        f"| {key} | FLASH_ATTN:noshare | 1.000 | 1.100 | 0.000 |",
    ]
    assert lifetime_table(seconds, sides, ["stock"]) == []  # one lifetime: nothing to compare with
    # A run cut short: a side or a stock lifetime without every repetition of a point is left out.
    short = {**seconds, "FLASH_ATTN": {key: [1.0, 2.5]}}
    assert [line.split(" | ")[1] for line in lifetime_table(short, sides, ["stock", "stock:2"])[2:]] == [
        "stock lifetimes among themselves",
        "FLASH_ATTN:noshare",
    ]
    assert lifetime_table({**seconds, "stock:2": {}}, sides, ["stock", "stock:2"]) == []
    third = {**seconds, "stock:3": {key: [1.0]}}  # a third stock lifetime cut short: the two others compared
    assert lifetime_table(third, sides, ["stock", "stock:2", "stock:3"]) == lines
    first = {**seconds, "stock:0": {key: [1.0]}}  # so is the first one listed
    assert lifetime_table(first, sides, ["stock:0", "stock", "stock:2"]) == lines
    recorded_sides = [{"label": s, "backend": s.partition(":")[0]} for s in sides]
    assert comparison_lines(comparisons(seconds, recorded_sides)) == [
        "against every stock lifetime (paired medians)",
        *lines,
    ]
    assert comparison_lines(comparisons(seconds, [{"label": "stock", "backend": "stock"}])) == []


def test_a_pause_side_is_read_against_its_host_in_their_one_engine_lifetime():
    import random
    import statistics

    key = "private P=8192 B=16 N=128"
    host = [1.0 + i / 100 for i in range(31)]  # host / pause: 1.00, 1.01, ..., 1.30 (median 1.15)
    seconds = {
        "stock": {key: [1.0] * 31},
        "FLASH_ATTN": {key: host},
        "FLASH_ATTN:pause": {key: [1.0] * 31},
        "FLASH_ATTN:pause-plan+route": {key: [1.0, 1.1]},  # not every repetition: left out
    }
    hosts = {"FLASH_ATTN:pause": "FLASH_ATTN", "FLASH_ATTN:pause-plan+route": "FLASH_ATTN"}
    lines = pause_table(seconds, hosts)
    assert lines[0] == (
        "| point | host / pause side | pairs | median [95% interval] | min-max | share of the path's gain |"
    )
    assert len(lines) == 3
    cells = lines[2].split(" | ")
    assert cells[1:3] == ["FLASH_ATTN / FLASH_ATTN:pause", "31"]
    assert cells[3].startswith("1.150 [") and cells[4:] == ["1.000-1.300", "- |"]  # no side pausing all named
    # The interval, bootstrapped here on its own: the 50th and the 1,951st of 2,000 sorted medians.
    rng = random.Random(f"{key}|FLASH_ATTN:pause")
    medians = sorted(statistics.median(rng.choices(host, k=31)) for _ in range(2000))
    low, high = (float(v) for v in cells[3][len("1.150 [") : -1].split("-"))
    assert low == pytest.approx(medians[49], abs=0.006) and high == pytest.approx(medians[1950], abs=0.006)
    assert 1.05 < low < 1.15 < high < 1.25  # narrower than min-max (1.00-1.30)
    assert pause_table(seconds, hosts) == lines  # seeded: one record, one interval
    assert pause_table(seconds, {}) == []
    recorded_sides = [
        {"label": "stock", "backend": "stock", "engine": None},
        {"label": "FLASH_ATTN", "backend": "FLASH_ATTN", "engine": None},
        {"label": "FLASH_ATTN:pause", "backend": "FLASH_ATTN", "engine": "FLASH_ATTN"},
    ]
    timed = {k: v for k, v in seconds.items() if k != "FLASH_ATTN:pause-plan+route"}
    assert comparison_lines(comparisons(timed, recorded_sides)) == [
        "the path on / paused, in one engine lifetime",
        *lines,
    ]


def test_each_paused_part_is_given_its_share_of_the_whole_paths_gain():
    key = "shared P=32768 B=16 N=128"
    seconds = {
        "FLASH_ATTN": {key: [1.0, 1.1, 0.9]},  # median 1.0
        "FLASH_ATTN:pause": {key: [2.0, 2.2, 1.9]},  # everything paused: median 2.0
        "FLASH_ATTN:pause-hits": {key: [1.2, 1.3, 1.25]},  # median 1.25: a quarter of the gain
        "FLASH_ATTN:pause-gather": {key: [0.95, 1.0, 1.05]},  # median 1.0: none of it
    }
    recorded_sides = [
        {"label": "FLASH_ATTN", "backend": "FLASH_ATTN", "engine": None, "pause": []},
        {"label": "FLASH_ATTN:pause", "backend": "FLASH_ATTN", "engine": "FLASH_ATTN", "pause": list(PARTS)},
        {
            "label": "FLASH_ATTN:pause-hits",
            "backend": "FLASH_ATTN",
            "engine": "FLASH_ATTN",
            "pause": ["hits"],
        },
        {
            "label": "FLASH_ATTN:pause-gather",
            "backend": "FLASH_ATTN",
            "engine": "FLASH_ATTN",
            "pause": ["gather"],
        },
    ]
    rows = comparisons(seconds, recorded_sides)["pause_vs_host"][2:]
    assert [(r.split(" | ")[1], r.split(" | ")[-1]) for r in rows] == [
        ("FLASH_ATTN / FLASH_ATTN:pause", "100% |"),
        ("FLASH_ATTN / FLASH_ATTN:pause-hits", "25% |"),
        ("FLASH_ATTN / FLASH_ATTN:pause-gather", "0% |"),
    ]
    # Pausing everything gained nothing: no share to give.
    flat = {**seconds, "FLASH_ATTN:pause": {key: [1.0, 1.0, 1.0]}}
    assert {r.split(" | ")[-1] for r in comparisons(flat, recorded_sides)["pause_vs_host"][2:]} == {"- |"}


def test_a_pause_side_times_its_calls_on_an_earlier_sides_engine_with_parts_paused():
    from scripts.bench.shared_prefix_workload import PAUSE_PARTS, pauses_before_calls

    sides = parse_sides("stock,FLASH_ATTN,flash_attn:PAUSE,FLASH_ATTN:pause-hits+route,FLASH_ATTN:noshare")
    assert [(s.label, s.backend, s.engine, s.pause) for s in sides] == [
        ("stock", "stock", None, ()),
        ("FLASH_ATTN", "FLASH_ATTN", None, ()),
        ("FLASH_ATTN:pause", "FLASH_ATTN", "FLASH_ATTN", PAUSE_PARTS),
        ("FLASH_ATTN:pause-route+hits", "FLASH_ATTN", "FLASH_ATTN", ("route", "hits")),  # parts' order
        ("FLASH_ATTN:noshare", "FLASH_ATTN", None, ()),
    ]
    # Before each call: the host engine resumes everything for its own side's calls and pauses for the
    # pause sides'; engines that host none are never asked.
    assert pauses_before_calls(sides) == {
        "stock": None,
        "FLASH_ATTN": (),
        "FLASH_ATTN:pause": PAUSE_PARTS,
        "FLASH_ATTN:pause-route+hits": ("route", "hits"),
        "FLASH_ATTN:noshare": None,
    }


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("FLASH_ATTN:pause", "runs on the engine of side 'FLASH_ATTN': list FLASH_ATTN before it"),
        ("FLASH_ATTN,FLASH_ATTN:pause-hash", r"unknown part\(s\) \['hash'\]; the parts are plan\+route"),
        ("FLASH_ATTN,FLASH_ATTN:pause-", r"unknown part\(s\) \[''\]"),
        ("FLASH_ATTN,FLASH_ATTN:pause,FLASH_ATTN:pause", "listed twice"),
    ],
)
def test_a_pause_side_without_its_engine_or_with_unknown_parts_is_refused(text, error):
    with pytest.raises(ValueError, match=error):
        parse_sides(text)


def test_the_workers_pause_is_the_benchmarks_path_parts(paused_parts):
    from scripts.bench import path_parts

    assert engine.pause_shared_prefix(None, ["hits", "plan"]) == ["plan", "route", "hits"]
    assert path_parts.paused() == ["plan", "route", "hits"]
    assert engine.pause_shared_prefix(None, []) == [] and path_parts.paused() == []


def test_a_pause_side_names_what_its_parts_imply():
    (_, side) = parse_sides("FLASH_ATTN,FLASH_ATTN:pause-plan")
    assert (side.label, side.pause) == ("FLASH_ATTN:pause-plan+route", ("plan", "route"))
    (_, side) = parse_sides("FLASH_ATTN,FLASH_ATTN:pause-hashes")
    assert (side.label, side.pause) == ("FLASH_ATTN:pause-hashes+gather", ("hashes", "gather"))


def test_sides_that_share_an_engine_never_send_it_the_same_prompts():
    """A pause side and its host run on one engine with prefix caching: were their fresh tokens the
    same, the second of them each repetition would find its whole prompts cached."""
    from scripts.bench.shared_prefix_workload import sharing_an_engine

    sides = parse_sides("stock,FLASH_ATTN,FLASH_ATTN:pause,FLASH_ATTN:noshare")
    engine_of = {s.label: s.engine or s.label for s in sides}
    points = build_points(["shared", "fresh"], [256], [(2, 32)], 256, [], 256, [], 8)
    sent: dict[tuple[str, int], list[tuple[int, ...]]] = {}  # (engine, rep) -> prompts it was sent
    by_side: dict[tuple[str, int, str], list[tuple[int, ...]]] = {}

    def timed(side, prompts, point, rep):
        got = [tuple(p) for p in prompts]
        seen = sent.setdefault((engine_of[side], rep), [])
        assert not set(got) & set(seen), f"{side} sent its engine prompts another side had sent"
        seen.extend(got)
        by_side[(side, rep, point.key)] = got
        return 0.1, 0, 2

    assert sharing_an_engine(sides) == {"FLASH_ATTN", "FLASH_ATTN:pause"}
    bench.take_turns(
        points,
        [s.label for s in sides],
        3,
        VOCAB,
        lambda *a: None,
        timed,
        own_tokens=sharing_an_engine(sides),
    )
    for rep in range(4):
        for point in points:
            key = point.key
            # Sides with engines of their own get the same prompts; a shared engine's sides their own,
            # of the same lengths and prefixes.
            assert by_side[("stock", rep, key)] == by_side[("FLASH_ATTN:noshare", rep, key)]
            ours, paused = by_side[("FLASH_ATTN", rep, key)], by_side[("FLASH_ATTN:pause", rep, key)]
            assert (
                [len(p) for p in ours]
                == [len(p) for p in paused]
                == [len(p) for p in by_side[("stock", rep, key)]]
            )
            assert ours != paused
            if point.prefix_len:
                assert [p[: point.prefix_len] for p in ours] == [p[: point.prefix_len] for p in paused]
