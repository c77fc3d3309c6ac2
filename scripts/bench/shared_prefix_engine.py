"""Engine time of requests sharing a cached prefix: stock vLLM vs the add-on, shared-prefix path on and off.

    python -m scripts.bench shared_prefix_engine [--sides stock,FLASH_ATTN,FLASH_ATTN:noshare]
        [--scenarios shared,private,fresh,decode] [--prefix-lens 32768,8192]
        [--points 16x32,16x128,16x512,8x1024,4x2048] [--reps 5] [--eager] [--gpu-mem 0.28]
        [--max-model-len 40960] [--max-num-batched-tokens 8192] [--stop-after S] [--json out.json]
        [--profile DIR [--profile-steps DELAY:COUNT]]

Sides, all alive at once in this driver process on one GPU (start-up and checks as in ``engine``):
``stock``, ``NAME``, ``NAME:noshare``, ``NAME:gather[MS]``, ``NAME:nogather``, another lifetime of one
(``stock:2``, ``NAME:noshare:3``), and ``NAME:pause[-PART+...]``, which times its calls on side ``NAME``'s
engine with the path or those parts paused there (shared_prefix_workload.SideSpec says each). Prefix
caching on, the 61-layer R1 slice (dummy weights), compiled unless ``--eager``. Each repetition runs every
point on every side in a rotating order, one untimed first; per point each side's median seconds and
paired ratio to ``--baseline``, the comparisons against every stock lifetime and of each pause side with
its host, the path's counters per call and each worker's memory peak. ``--json`` is rewritten after every
repetition. ``--profile DIR``: then one more call per point and side under vLLM's torch profiler
(``DELAY:COUNT`` worker steps skipped, then recorded), traces in ``DIR/SIDE/``, where each step's time
goes per side (``step_profile``). What it measures, the scenarios and the results: docs/benchmarks.md.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from . import common, engine, step_profile
from . import shared_prefix_workload as workload
from .shared_prefix_table import Raw, cache_notes, comparison_lines, comparisons, markdown, tabulate
from .shared_prefix_workload import SHARED_PREFIX_ENV, Point, SideSpec

DEFAULT_SIDES = "stock,FLASH_ATTN,FLASH_ATTN:noshare"
DEFAULT_POINTS = "16x32,16x128,16x512,8x1024,4x2048"

# What a timed run reports: seconds, prompt tokens the prefix cache served (None: vLLM did not say),
# output tokens.
Timed = tuple[float, int | None, int]


def take_turns(
    points: Sequence[Point],
    sides: Sequence[str],
    reps: int,
    vocab: int,
    warm: Callable[[str, list[list[int]]], None],
    timed: Callable[[str, list[list[int]], Point, int], Timed],
    after_repetition: Callable[[int, list[str], dict[str, Raw]], bool] = lambda rep, order, raw: True,
    own_tokens: set[str] | frozenset[str] = frozenset(),
) -> dict[str, Raw]:
    """Run the repetitions: repetition 0 untimed, then ``reps`` timed; in each, every point, its
    prefixes warmed on every side, then the same prompts timed on every side in a rotated order
    (``own_tokens``: sides that share an engine, each with fresh tokens of its own).

    Returns the raw results, ``seconds``, ``cached_tokens`` and ``output_tokens``: each side -> point
    key -> one value per timed repetition. ``timed(side, prompts, point, rep)`` runs one call (``rep``
    0: the untimed warm-up). ``after_repetition(rep, order, raw)`` is called after each repetition with
    the results so far; False stops the run there.
    """
    seconds: Raw = {s: {} for s in sides}
    cached: Raw = {s: {} for s in sides}
    out_tokens: Raw = {s: {} for s in sides}
    raw = {"seconds": seconds, "cached_tokens": cached, "output_tokens": out_tokens}
    for rep in range(reps + 1):
        order = [*sides[rep % len(sides) :], *sides[: rep % len(sides)]]
        for point in points:
            prefixes = workload.warm_prompts(point, vocab)
            if prefixes:
                for side in sides:
                    warm(side, prefixes)
            prompts = workload.timed_prompts(point, rep, vocab)
            for side in order:
                mine = workload.timed_prompts(point, rep, vocab, own=side) if side in own_tokens else prompts
                took, hit, produced = timed(side, mine, point, rep)
                if rep:  # repetition 0 warms every shape up
                    seconds[side].setdefault(point.key, []).append(took)
                    cached[side].setdefault(point.key, []).append(hit)
                    out_tokens[side].setdefault(point.key, []).append(produced)
        if not after_repetition(rep, order, raw):
            break
    return raw


def keep_going(rep: int, elapsed: float, last: float, stop_after: float | None) -> bool:
    """Whether the next repetition starts: always after the untimed one (a run times at least one),
    then while it would end within ``stop_after`` seconds of the start, were it as long as the last."""
    return rep == 0 or stop_after is None or elapsed + last <= stop_after


PATH_COUNTERS = ("steps", "steps_routed", "steps_with_segments")  # the workers' reports
PATH_COUNTERS += ("steps_with_decode_groups", "steps_dispatched_piecewise")
HASH_COUNTERS = {"blocks_reused": "reused_blocks", "hits_reused": "reused_hits", "gathered": "gathered"}
COUNTERS = (*PATH_COUNTERS, *HASH_COUNTERS)  # those and the engine core's prefix_hashes report


def path_counters(llm: Any) -> dict[str, int] | None:
    """The shared-prefix path's counters summed over the engine's workers (None: the path is not there).

    ``blocks_reused``: block hashes the engine core took from an earlier request instead of hashing;
    ``hits_reused``: prefix-cache hits its scheduler took from an earlier lookup instead of looking
    the blocks up; ``gathered``: client calls (requests, mostly) an idle engine core took into its
    first step by waiting for a burst over a shared prefix (all three read where the engine core runs
    in the worker's process, as on one GPU; else 0)."""
    workers = llm.collective_rpc(engine.prefill_owners)
    reports = [w.get("shared_prefix") for w in workers]
    if not reports or any(r is None for r in reports):
        return None
    counters: dict[str, Any] = {k: sum(int(r.get(k, 0)) for r in reports) for k in PATH_COUNTERS}
    for counter, key in HASH_COUNTERS.items():
        counters[counter] = sum(int((w.get("prefix_hashes") or {}).get(key, 0)) for w in workers)
    # The first worker's recent steps, (requests, tokens, routed) each: every worker runs every step.
    counters["first_worker_steps"] = int(reports[0].get("steps", 0))
    counters["shapes"] = [tuple(s) for s in reports[0].get("step_shapes", [])]
    return counters


def counter_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    """What one timed call added to each counter (None where the side has no path), and ``shapes``:
    its steps' (requests, scheduled tokens, routed), oldest first, when the workers keep them
    (their ring holds the last 256 steps; a call of more steps keeps its last 256)."""
    if before is None or after is None:
        return None
    delta: dict[str, Any] = {k: after.get(k, 0) - before.get(k, 0) for k in COUNTERS}
    took = after.get("first_worker_steps", 0) - before.get("first_worker_steps", 0)
    shapes = after.get("shapes", [])
    delta["shapes"] = [list(s) for s in shapes[len(shapes) - min(took, len(shapes)) :]]
    return delta


def path_steps_lines(records: Sequence[dict[str, Any]]) -> list[str]:
    """Per side and point: the steps each timed call took, routed, shared (the untimed warm-up calls
    left out; records without a point, from older runs, grouped by requests x prompt length)."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in records:
        if r.get("rep", 1) == 0:
            continue
        point = r.get("point") or f"{r['requests']} x {r['prompt_len']} tokens"
        groups.setdefault((r["side"], point), []).append(r)
    lines = []
    for (side, point), rs in groups.items():
        cells = ", ".join(f"{k} {[r.get(k, 0) for r in rs]}" for k in COUNTERS)
        lines.append(f"{side} {point}: {cells}")
        if any(r.get("shapes") for r in rs):  # requests/tokens per step of each call, "r" if routed
            marks = [[f"{q}/{t}{'r' if routed else ''}" for q, t, routed in r.get("shapes", [])] for r in rs]
            lines.append(f"  steps as requests/tokens: {' '.join('[' + ' '.join(m) + ']' for m in marks)}")
    return lines


def memory_lines(memory: dict[str, list[dict[str, int]]]) -> list[str]:
    """Per side and worker: the allocator's peak over the workload, and that peak beyond the KV cache."""
    gib = 1 << 30
    lines = []
    for label, workers in memory.items():
        for i, m in enumerate(workers):
            beyond = (m["peak_allocated"] - m["kv_cache"]) / gib
            lines.append(
                f"memory {label} worker {i}: peak allocated {m['peak_allocated'] / gib:.2f} GiB "
                f"(KV cache {m['kv_cache'] / gib:.2f} GiB, beyond it {beyond:.2f} GiB), "
                f"reserved {m['reserved'] / gib:.2f} GiB of {m['device_total'] / gib:.1f} GiB"
            )
    return lines


def check_switch(side: SideSpec, info: dict[str, Any]) -> None:
    """Every worker of the side's engine sees the shared-prefix switches the side sets (or none)."""
    for name, key in ((SHARED_PREFIX_ENV, "shared_prefix_env"), (engine.GATHER_ENV, "gather_env")):
        wanted = side.extra_env.get(name)
        for report in info["workers"]:
            if report.get(key) != wanted:
                raise SystemExit(
                    f"side {side.label}: a worker sees {name}={report.get(key)!r}, the side sets {wanted!r}"
                )


def profile_calls(
    points: Sequence[Point],
    labels: Sequence[str],
    folders: dict[str, Path],
    engines: dict[str, Any],
    timed: Callable[[str, list[list[int]], Point, int], Timed],
    vocab: int,
    rep: int,
) -> dict[str, dict[str, dict[str, Any]]]:
    """One more call per point and side (fresh prompts of repetition ``rep``) under the side's profiler;
    where each kind of worker step spends its time, per "side point"."""
    out = {}
    for point in points:
        prompts = workload.timed_prompts(point, rep, vocab)
        for side in labels:
            before = set(step_profile.traces_in(folders[side]))
            engines[side].start_profile()
            timed(side, prompts, point, rep)
            engines[side].stop_profile()  # returns once the workers have written their traces
            if not (new := step_profile.new_traces(folders[side], before)):
                raise SystemExit(f"side {side}: the profiler wrote no trace into {folders[side]}")
            out[f"{side} {point.key}"] = step_profile.summarize_files(new)
    return out


def make_parser():
    parser = common.parser(__doc__)
    parser.add_argument("--model", type=Path, default=engine.MODEL_DIR, help="model folder (config.json)")
    parser.add_argument("--eager", action="store_true", help="no torch.compile, no CUDA graphs")
    sides = "stock, NAME, NAME:noshare, NAME:gather, NAME:nogather, NAME:pause[-PART+...] (comma-separated)"
    parser.add_argument("--sides", default=DEFAULT_SIDES, help=sides)
    parser.add_argument("--baseline", default="stock", help="the side the ratios divide by")
    parser.add_argument("--scenarios", default="shared,private,fresh,decode", help="some of these")
    parser.add_argument("--prefix-lens", default="32768,8192", help="shared: prefix lengths P")
    parser.add_argument("--points", default=DEFAULT_POINTS, help="shared and fresh: BxN points")
    parser.add_argument("--private-prefix-len", type=int, default=8192, help="private: each request's P")
    parser.add_argument("--private-points", default="16x32,16x128,16x512", help="private: BxN points")
    parser.add_argument("--decode-prefix-len", type=int, default=32768, help="decode: the shared P")
    parser.add_argument("--decode-points", default="16x32", help="decode: BxN points")
    parser.add_argument("--decode-tokens", type=int, default=64, help="decode: tokens generated per request")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions (one more untimed first)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-model-len", type=int, default=40960, help="at least P + N (+ decode tokens)")
    parser.add_argument("--gpu-mem", type=float, default=0.28, help="gpu_memory_utilization per engine")
    stop = "seconds from the start: no repetition begins that would end later (by the last one's time)"
    parser.add_argument("--stop-after", type=float, help=stop)
    parser.add_argument("--json", help="write the raw results and the table here")
    profile = "then one call per point and side under vLLM's torch profiler, traces here (a folder a side)"
    parser.add_argument("--profile", type=Path, help=profile)
    parser.add_argument("--profile-steps", default="0:16", help="--profile: worker steps skipped:recorded")
    return parser


def profile_steps(text: str) -> tuple[int, int]:
    """``DELAY:COUNT``: worker steps a profiled call skips, then records (a ValueError says what is wrong)."""
    delay, _, count = text.partition(":")
    try:
        steps = int(delay), int(count)
    except ValueError:
        raise ValueError(f"--profile-steps {text!r}: DELAY:COUNT, two whole numbers") from None
    if steps[0] < 0 or steps[1] < 1:
        raise ValueError(f"--profile-steps {text!r}: DELAY >= 0 steps skipped, COUNT >= 1 recorded")
    return steps


def plan(args: Any) -> tuple[list[SideSpec], list[Point]]:
    """The run's sides and points from its flags (a ValueError says what is wrong)."""
    sides = workload.parse_sides(args.sides)
    points = workload.build_points(
        [s.strip() for s in args.scenarios.split(",")],
        workload.parse_ints(args.prefix_lens),
        workload.parse_points(args.points),
        args.private_prefix_len,
        workload.parse_points(args.private_points),
        args.decode_prefix_len,
        workload.parse_points(args.decode_points),
        args.decode_tokens,
    )
    workload.check_fits(points, args.max_model_len)
    if args.baseline not in [s.label for s in sides]:
        raise ValueError(f"--baseline {args.baseline!r} is not one of the sides {args.sides!r}")
    if args.profile is not None:
        profile_steps(args.profile_steps)
        if shared := [s.label for s in sides if s.engine is not None]:
            raise ValueError(f"--profile: sides {shared} run in another side's engine (one profiler each)")
    return sides, points


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        sides, points = plan(args)
    except ValueError as e:
        parser.error(str(e))
    labels = [s.label for s in sides]
    args.trees = {}  # engine.start_engine's other code trees: none here
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]

    engine.prepare_driver(extra_cleared=(SHARED_PREFIX_ENV, engine.GATHER_ENV))
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    own, info = {}, {}  # the engines started, by the label of the side that owns each
    folders = {s.label: args.profile / s.label.replace(":", "-") for s in sides} if args.profile else {}
    steps = profile_steps(args.profile_steps) if folders else (0, 0)
    for side in sides:
        if side.engine is None:
            options = {"enable_prefix_caching": True}
            if folders:
                options["profiler_config"] = step_profile.profiler_config(folders[side.label], *steps)
            own[side.label], info[side.label] = engine.start_engine(
                side.backend, args, extra_env=side.extra_env, name=side.label, **options
            )
            check_switch(side, info[side.label])
    engines = {s.label: own[s.engine or s.label] for s in sides}  # a pause side: its host's engine
    pauses = workload.pauses_before_calls(sides)
    for llm in own.values():  # the peaks reported at the end are the workload's, not the start-up's
        llm.collective_rpc(engine.reset_memory_peak)

    def set_pause(side: str, parts: tuple[str, ...]) -> None:
        """Outside the timing: the parts of the path paused in the side's engine (one GPU: the engine
        core runs in the worker's process, so the rpc reaches every part)."""
        if pauses[side] is None:
            return
        got = engines[side].collective_rpc(engine.pause_shared_prefix, args=(list(parts),))
        if any(tuple(g) != parts for g in got):
            raise SystemExit(f"side {side}: asked to pause {list(parts)}, the workers paused {got}")

    one = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)

    def warm(side: str, prompts: list[list[int]]) -> None:
        set_pause(side, ())  # prefixes go in as the path on has them
        engines[side].generate([TokensPrompt(prompt_token_ids=p) for p in prompts], one, use_tqdm=False)

    path_steps: list[dict[str, Any]] = []  # per timed call: how many steps, routed, with segments

    def timed(side: str, prompts: list[list[int]], point: Point, rep: int) -> Timed:
        params = SamplingParams(
            temperature=0.0, max_tokens=point.max_tokens, ignore_eos=True, detokenize=False
        )
        batch = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        set_pause(side, pauses[side] or ())
        before = path_counters(engines[side])  # outside the timing
        t = time.perf_counter()
        outputs = engines[side].generate(batch, params, use_tqdm=False)
        took = time.perf_counter() - t
        # Which call a record is of (rep 0: the untimed warm-up).
        call = dict(side=side, point=point.key, rep=rep, requests=len(prompts), prompt_len=len(prompts[0]))
        delta = counter_delta(before, path_counters(engines[side]))
        if delta is not None:
            path_steps.append({**call, **delta})
        counts = [o.num_cached_tokens for o in outputs]
        hit = None if None in counts else sum(counts)
        return took, hit, sum(len(o.outputs[0].token_ids) for o in outputs)

    header = common.record(
        args={**vars(args), "model": str(args.model), "trees": {}},
        sides=[
            {"label": s.label, "backend": s.backend, "env": s.extra_env, "engine": s.engine, "pause": s.pause}
            for s in sides
        ],
        points=[p.key for p in points],
        engines=info,
    )

    ends = [time.perf_counter()]  # when each repetition ended (the first: when the engines were ready)

    def after_repetition(rep: int, order: list[str], raw: dict[str, Raw]) -> bool:
        ends.append(time.perf_counter())
        elapsed = ends[-1] - started
        took = f"in {ends[-1] - ends[-2]:.0f} s, {elapsed:.0f} s since the start"
        common.stamp(f"repetition {rep}/{args.reps} done (order {order}) {took}")
        # Raw, before any arithmetic on it, after every repetition: a run cut short keeps what it timed.
        common.write_json(args.json, {**header, **raw, "timed_repetitions": rep})
        return keep_going(rep, elapsed, ends[-1] - ends[-2], args.stop_after)

    shared = workload.sharing_an_engine(sides)
    raw = take_turns(points, labels, args.reps, vocab, warm, timed, after_repetition, own_tokens=shared)
    table = tabulate(
        points, labels, args.baseline, raw["seconds"], raw["output_tokens"], raw["cached_tokens"]
    )
    lines = markdown(table, labels, args.baseline)
    notes = cache_notes(table)
    # Against every stock lifetime (two or more), each pause side against its host.
    compared = comparisons(raw["seconds"], header["sides"])
    # The lines below show the timed calls; the JSON keeps the profiled ones too (rep = reps + 1).
    timed_calls = list(path_steps)
    profiled = profile_calls(points, labels, folders, engines, timed, vocab, args.reps + 1) if folders else {}
    for label in own:  # the path as the add-on sets it again, before the last reports
        set_pause(label, ())
    # Whether the path ran at all: each engine's workers' counters (steps with shared segments,
    # steps whose short extends were routed) after the whole run (a pause side's are its host's).
    after = {label: own[label].collective_rpc(engine.prefill_owners) for label in own}
    for label, workers in after.items():
        print(f"{label}: shared-prefix path {[w.get('shared_prefix') for w in workers]}", flush=True)
    print("\n".join(path_steps_lines(timed_calls)), flush=True)
    memory = {label: own[label].collective_rpc(engine.memory_peak) for label in own}
    print("\n".join(memory_lines(memory)), flush=True)
    print("\n".join(lines + [f"note: {n}" for n in notes]), flush=True)
    if compared_lines := comparison_lines(compared):
        print("\n".join(compared_lines), flush=True)
    results = dict(table=table, markdown=lines, notes=notes, **compared, engines_after=after)
    if profiled:
        print("\n".join(step_profile.profile_lines(profiled)), flush=True)
        results["profile"] = profiled
    common.write_json(args.json, {**header, **raw, **results, "path_steps": path_steps, "memory": memory})
    return 0


if __name__ == "__main__":
    sys.exit(main())
