#!/usr/bin/env python3
"""Runs one vLLM 0.20 engine scenario on the tiny DeepSeek-V2 and writes its results as JSON.

    python scripts/gpu_harness/engine_runner.py --name shim-fa --backend-env FLASH_ATTN --out r.json \\
        [--model-dir CKPT] [--weights sharp|dummy] [--prompts parity|chunks|shared|shared_decode] \\
        [--context-chunk-tokens N] [--custom | --custom-class mod.Class] [--bench] \\
        [--shared-evidence | --shared-mutant other-prefix|drop-segment-lse|segment-scale] \\
        [--shared-decode | --shared-decode-mutant other-prefix|drop-segment-lse|segment-scale]

One engine lifetime in a fresh process (the add-on's switches reach vLLM's children as a user's
would). Weights: ``sharp`` (default; make_sharp_checkpoint.py, generated into a cache folder without
``--model-dir``), on which a wrong backend changes logprobs and tokens, or vLLM's ``dummy`` (start-up
scenarios). Greedy, ``MAX_TOKENS`` tokens per prompt, recording tokens, their logprobs and the top-2
(verdict.py). Prompt sets: ``parity`` (every prefill path and a prefix-cache hit), ``chunks`` (a
12288-token prompt extending a cached 8192-token one, then a fresh 10000-token one), ``shared``
(:func:`shared_prompt_sets`: requests over one cached prefix, each set in one ``generate`` call),
``shared_decode`` (:func:`shared_decode_prompt_sets`: long greedy outputs over one cached prefix).

Test-only wrappers, installed with wrapt before ``LLM(...)`` and inherited by the forked engine core
(the run fails unless their evidence comes from another process): ``--context-chunk-tokens N`` lowers
the MLA builder's context workspace to N tokens (N = 2048: 4 context chunks in one step);
``--decode-threshold`` lowers its ``reorder_batch_threshold``; ``--shared-evidence`` records each
shared-prefix plan and ``--shared-mutant`` makes the shared context deliberately wrong
(:func:`install_shared_context_wrapper`); ``--shared-decode`` turns on decode rows, serves the tiny model's
groups, records them, and ``--shared-decode-mutant`` makes them wrong (:func:`install_shared_decode_wrapper`).
``--bench``: prefill throughput over a grid of shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MODEL_DIR = HERE / "tiny_deepseek_v2"  # config only: dummy weights
EXAMPLES = HERE.parent.parent / "examples"
# The mutation scenarios' backends (doubles/mutant_backends.py): a folder of their own on the engine's
# PYTHONPATH, so that only they become importable by class path there.
TEST_DOUBLES = HERE / "doubles"
MAKE_CHECKPOINT = HERE / "make_sharp_checkpoint.py"
SHARP_SEED = 0
CHECKPOINT_DIR_ENV = "MLA_SHARP_CHECKPOINT_DIR"

MAX_NUM_BATCHED_TOKENS = 4096  # prompts longer than this prefill in chunks over prior context
PARITY_PROMPT_LENS = [6000, 4500, 1200, 700]
PREFIX_SHARED, PREFIX_NEW = 4096, 1000  # a second request reusing 4096 cached tokens
CHUNKS_PREFIX, CHUNKS_NEW, CHUNKS_FRESH = 8192, 4096, 10000
MAX_TOKENS = 16
# The ``shared`` set. Cached lengths are multiples of 64 tokens (of every MLA block size: 16, 64),
# so that the cache holds whole prefixes; every set's new tokens fit one step's budget.
SHARED_PREFIX = 6144
SHARED_SHORT, SHARED_SHORT_NEW = 16, 200  # <= 512 new tokens: vLLM's decode path unless routed
SHARED_LONG, SHARED_LONG_NEW = 8, 1200
SHARED_PRIVATE, SHARED_PRIVATE_CONTEXT, SHARED_PRIVATE_NEW = 8, 704, 600
SHARED_MAX_NUM_BATCHED_TOKENS = 12288  # 8 x 1200 new tokens in one step
SHARED_SETS = ("shared_warm", "shared_short", "shared_long", "shared_private_warm", "shared_private")
SHARED_MUTANTS = ("other-prefix", "drop-segment-lse", "segment-scale")
SEGMENT_SCALE_ERROR = 1.02  # the segment-scale mutant's softmax scale, relative to the layer's
# The ``shared_decode`` set: requests over one cached prefix, each extending it past FLASH_ATTN_MLA's decode
# threshold (512: the first token on vLLM's prefill path, stock's and the add-on's alike), then long greedy
# outputs: every decode step after that holds one group of DECODE_REQUESTS rows over the prefix.
DECODE_PREFIX, DECODE_REQUESTS, DECODE_NEW, DECODE_MAX_TOKENS = 2048, 16, 520, 128
SHARED_DECODE_SETS = ("shared_decode_warm", "shared_decode")
TOP_LOGPROBS = 2
BENCH_GRID = [(1024, 1), (1024, 16), (4096, 1), (4096, 8), (8192, 4)]
BENCH_REPS = 5
VOCAB = 32000


# The prompt sets a result holds, in order.
RECORD_KEYS = ("batch", "prefix_hit", "chunks", *SHARED_SETS, *SHARED_DECODE_SETS)


def records(data: dict) -> list[dict]:
    """A scenario result's per-prompt records, every prompt set it ran in :data:`RECORD_KEYS` order."""
    res = data["results"]
    return [r for key in RECORD_KEYS for r in res.get(key, [])]


def prompts(lengths: list[int], seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB) for _ in range(n)] for n in lengths]


def shared_prompt_sets() -> dict[str, list[list[int]]]:
    """The ``shared`` prompt set, one ``generate`` call per entry in order: the prefix alone (cached),
    16 short extends of it (vLLM's decode path unless routed), 8 long ones, then 8 private contexts
    after it (cached by the first of those two calls), each extended."""
    prefix = prompts([SHARED_PREFIX], seed=11)[0]
    private = [prefix + p for p in prompts([SHARED_PRIVATE_CONTEXT] * SHARED_PRIVATE, seed=14)]
    sets = {"shared_warm": [prefix]}
    sets["shared_short"] = [prefix + s for s in prompts([SHARED_SHORT_NEW] * SHARED_SHORT, seed=12)]
    sets["shared_long"] = [prefix + s for s in prompts([SHARED_LONG_NEW] * SHARED_LONG, seed=13)]
    extends = prompts([SHARED_PRIVATE_NEW] * SHARED_PRIVATE, seed=15)
    sets["shared_private_warm"] = private
    return {**sets, "shared_private": [p + n for p, n in zip(private, extends, strict=True)]}


def shared_decode_prompt_sets() -> dict[str, list[list[int]]]:
    """The ``shared_decode`` prompt set, one ``generate`` call per entry: the prefix alone (cached), then
    :data:`DECODE_REQUESTS` extends of it by :data:`DECODE_NEW` fresh tokens each."""
    prefix = prompts([DECODE_PREFIX], seed=21)[0]
    extends = [prefix + s for s in prompts([DECODE_NEW] * DECODE_REQUESTS, seed=22)]
    return {"shared_decode_warm": [prefix], "shared_decode": extends}


def shared_cached_tokens(key: str) -> int:
    """How many leading tokens of each prompt of ``key`` an earlier call of the ``shared`` set cached."""
    cached = {"shared_warm": 0, "shared_private": SHARED_PREFIX + SHARED_PRIVATE_CONTEXT}
    return cached.get(key, SHARED_PREFIX)


def default_checkpoint_dir() -> Path:
    cache = Path.home() / ".cache" / "mla-prefill-ext" / f"tiny-deepseek-v2-sharp-seed{SHARP_SEED}"
    return Path(os.environ.get(CHECKPOINT_DIR_ENV) or cache)


def ensure_checkpoint(model_dir: Path) -> Path:
    """The sharp checkpoint in ``model_dir``, generated (in a child process, CPU only) if missing."""
    subprocess.run([sys.executable, MAKE_CHECKPOINT, model_dir, "--seed", str(SHARP_SEED)], check=True)
    return model_dir


# --- test-only wrappers: one install mechanism, one evidence file (from the engine process) -----

# One installed wrapper: (module, attribute path, wrapt's handle), for :func:`uninstall`.
Installed = tuple[Any, str, Any]


def _wrap(module_name: str, wrappers: dict[str, Any]) -> list[Installed]:
    """wrapt function wrappers on attributes (dotted paths) of ``module_name``."""
    import importlib

    import wrapt

    module = importlib.import_module(module_name)
    return [(module, path, wrapt.wrap_function_wrapper(module, path, w)) for path, w in wrappers.items()]


def uninstall(installed: list[Installed]) -> None:
    """Remove wrappers :func:`_wrap` installed, the last first (tests; the runner's engine ends with them)."""
    import wrapt

    for module, path, handle in reversed(installed):
        wrapt.unwrap_object(module, path, handle)


def _record(evidence: Path, kind: str, *fields: Any) -> None:
    """One line of a wrapper's evidence: ``PID KIND FIELD ...`` (the pid tells which process wrote it)."""
    with open(evidence, "a") as f:
        f.write(" ".join(map(str, (os.getpid(), kind, *fields))) + "\n")


def _lines(evidence: Path, *kinds: str) -> list[tuple[int, str, list[str]]]:
    """The evidence lines of ``kinds``, as ``(pid, kind, fields)`` (none: no wrapper wrote)."""
    lines = evidence.read_text().splitlines() if evidence.exists() else []
    return [(int(pid), kind, rest) for pid, kind, *rest in map(str.split, lines) if kind in kinds]


def _where(pids: set[int]) -> dict:
    """Which processes wrote the evidence: ``ran_in_engine_process`` if some did and none is this one."""
    here = os.getpid()
    return {
        "pids": sorted(pids),
        "runner_pid": here,
        "ran_in_engine_process": bool(pids) and here not in pids,
    }


# --- test-only: vLLM's MLA builder with smaller context chunks or a lower decode threshold ------------


def install_builder_wrappers(
    evidence: Path, chunk_tokens: int | None = None, threshold: int | None = None
) -> list[Installed]:
    """After vLLM's own ``MLACommonMetadataBuilder.__init__``: with ``chunk_tokens``, set its chunked-context
    workspace size to it (``init STOCK NEW``) and record each step's context chunks from ``build``
    (``chunks N LONGEST``); safe on vLLM 0.20.2: ``build()`` cuts the context by that size, and the
    workspace keeps its stock (larger) allocation, of which a chunk uses the first rows. With ``threshold``,
    lower its ``reorder_batch_threshold`` (1: only one-token queries are decodes; the runner reads it after
    construction), so that stock serves short extends on its prefill path, the reference for a candidate
    that routes them there (``threshold STOCK NEW``)."""

    def builder_init(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> None:
        wrapped(*args, **kwargs)
        if chunk_tokens:
            stock = instance.chunked_prefill_workspace_size
            if chunk_tokens > stock:
                raise ValueError(
                    f"--context-chunk-tokens {chunk_tokens} exceeds the stock workspace ({stock})"
                )
            instance.chunked_prefill_workspace_size = chunk_tokens
            _record(evidence, "init", stock, chunk_tokens)
        if threshold:
            stock = instance.reorder_batch_threshold
            instance.reorder_batch_threshold = min(stock, threshold)
            _record(evidence, "threshold", stock, instance.reorder_batch_threshold)

    def builder_build(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        metadata = wrapped(*args, **kwargs)
        chunked = getattr(getattr(metadata, "prefill", None), "chunked_context", None)
        if chunked is not None:  # host lists: no device sync
            _record(evidence, "chunks", len(chunked.seq_tot), max(chunked.max_seq_lens))
        return metadata

    wrappers = {"MLACommonMetadataBuilder.__init__": builder_init}
    if chunk_tokens:
        wrappers["MLACommonMetadataBuilder.build"] = builder_build
    return _wrap("vllm.model_executor.layers.attention.mla_attention", wrappers)


def chunk_evidence(evidence: Path, tokens: int) -> dict:
    """What the builder wrappers wrote of context chunks (``ran_in_engine_process``: its inits)."""
    lines = [(pid, kind, *map(int, rest)) for pid, kind, rest in _lines(evidence, "init", "chunks")]
    inits, chunks = [x for x in lines if x[1] == "init"], [x for x in lines if x[1] == "chunks"]
    where = _where({x[0] for x in lines})
    return {
        "context_chunk_tokens": tokens,
        "builder_inits": len(inits),
        "stock_workspace_tokens": sorted({x[2] for x in inits}),
        "steps_with_context": len(chunks),
        "chunks_per_step": [x[2] for x in chunks],
        "max_chunks_per_step": max((x[2] for x in chunks), default=0),
        "max_chunk_tokens": max((x[3] for x in chunks), default=0),
        **where,
        "ran_in_engine_process": where["ran_in_engine_process"] and bool(inits),
    }


def decode_threshold_evidence(evidence: Path, threshold: int) -> dict:
    """What the builder wrappers wrote of the decode threshold."""
    rows = [(pid, int(stock), int(new)) for pid, _, (stock, new) in _lines(evidence, "threshold")]
    return {
        "decode_threshold": threshold,
        "builder_inits": len(rows),
        "stock_thresholds": sorted({stock for _, stock, _ in rows}),
        "thresholds": sorted({new for _, _, new in rows}),
        **_where({pid for pid, _, _ in rows}),
    }


# --- test-only: the shared-prefix path recorded, or made wrong: prefill context and decode rows ------

SHARED_LAYER_MODULE = "mla_prefill_ext.hosts.core.shared_prefix.layer"
SHARED_DECODE_MODULE = "mla_prefill_ext.hosts.core.shared_prefix.decode_rows"


def install_shared_context_wrapper(mode: str, evidence: Path) -> list[Installed]:
    """Wrap ``compute_context`` where the shared-prefix layer hook calls it; each call writes one line
    of evidence (``context MODE``, passes, each segment's members, tokens and longest query).

    ``mode``: ``record`` calls it unchanged; ``other-prefix`` shifts the segment block table by its
    width (each segment gathers blocks that are not its prefix); ``drop-segment-lse`` runs the plan
    without its segments (with no private context either: zero output, LSE -inf, as vLLM writes for a
    request without context); ``segment-scale`` scales the segments' softmax by
    :data:`SEGMENT_SCALE_ERROR`."""
    import copy
    import dataclasses

    import torch

    if mode not in ("record", *SHARED_MUTANTS):
        raise ValueError(f"unknown shared-context wrapper mode {mode!r}")

    def record(plan: Any) -> None:
        longest = [max(e - b for b, e in s.query_ranges) for s in plan.segments]
        shapes = [f"{len(s.members)}:{s.num_tokens}:{q}" for s, q in zip(plan.segments, longest, strict=True)]
        _record(evidence, "context", mode, len(plan.segment_passes), len(plan.private_passes), *shapes)

    def wrapper(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        return call(wrapped, *args, **kwargs)

    def call(
        wrapped: Any, q: Any, plan: Any, table: Any, step_backend: Any, segment_backend: Any, layer: Any
    ) -> Any:
        record(plan)
        if mode == "other-prefix":
            blocks = layer.kv_cache.shape[0]
            shifted = (plan.segment_block_table.long() + plan.segment_block_table.shape[1]) % blocks
            plan = dataclasses.replace(plan, segment_block_table=shifted.to(plan.segment_block_table.dtype))
        elif mode == "segment-scale" and segment_backend is not None:
            segment_backend = copy.copy(segment_backend)  # the step's instance stays right
            segment_backend.scale = segment_backend.scale * SEGMENT_SCALE_ERROR
        elif mode == "drop-segment-lse":
            if not plan.private_passes:
                out, lse = wrapped(q, plan, table, step_backend, segment_backend, layer)
                return torch.zeros_like(out), torch.full_like(lse, float("-inf"))
            return wrapped(q, dataclasses.replace(plan, segments=()), table, step_backend, None, layer)
        return wrapped(q, plan, table, step_backend, segment_backend, layer)

    return _wrap(SHARED_LAYER_MODULE, {"compute_context": wrapper})


def install_shared_decode_wrapper(mode: str, evidence: Path) -> list[Installed]:
    """Serve any two decode rows sharing a whole block (the tiny model is far below the measured crossover:
    a correctness check), and wrap ``decode_attention`` where the decode-rows hook calls it, one line of
    evidence per call (``decode MODE``, each group's members and prefix tokens). ``other-prefix``: each
    prefix row shifted by its width (other pages); ``drop-segment-lse``: no shared call (members keep only
    their own pages); ``segment-scale``: the shared calls' queries times :data:`SEGMENT_SCALE_ERROR` (a
    softmax scale 2% off)."""
    from mla_prefill_ext.hosts.core.shared_prefix import costs
    from mla_prefill_ext.shared_prefix.decode import ANY_SHARED_BLOCK

    if mode not in ("record", *SHARED_MUTANTS):
        raise ValueError(f"unknown shared-decode wrapper mode {mode!r}")
    costs.DECODE_VALUE = ANY_SHARED_BLOCK

    def wrapper(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        q_pe, q_nope, plan, *step, attend, merge = args  # the hook passes them by position
        _record(evidence, "decode", mode, *(f"{g.num_members}:{g.num_tokens}" for g in plan.groups))
        if mode == "other-prefix":
            pages = plan.own_block_table.max() + 1  # a device tensor: valid page ids, no sync
            moved = [
                g._replace(prefix_row=(g.prefix_row + g.prefix_row.shape[1]) % pages) for g in plan.groups
            ]
            plan = plan._replace(groups=moved)
        elif mode == "drop-segment-lse":
            plan = plan._replace(groups=[])
        elif mode == "segment-scale":
            right, e = attend, SEGMENT_SCALE_ERROR

            def attend(q_pe: Any, q_nope: Any, *rest: Any) -> Any:  # rest[-1]: causal (a row's own pages)
                return right(q_pe, q_nope, *rest) if rest[-1] else right(q_pe * e, q_nope * e, *rest)

        return wrapped(q_pe, q_nope, plan, *step, attend, merge)

    return _wrap(SHARED_DECODE_MODULE, {"decode_attention": wrapper})


def _shapes(fields: list[str]) -> list[tuple[int, ...]]:
    return [tuple(map(int, f.split(":"))) for f in fields]


def shared_context_evidence(evidence: Path) -> dict:
    """What the shared-context wrapper wrote."""
    calls = [
        (pid, mode, int(s), int(o), _shapes(segs))
        for pid, _, (mode, s, o, *segs) in _lines(evidence, "context")
    ]
    shapes = [s for c in calls for s in c[4]]
    return {
        "modes": sorted({c[1] for c in calls}),
        "calls": len(calls),
        "calls_with_segments": sum(1 for c in calls if c[4]),
        "max_members": max((m for m, _, _ in shapes), default=0),
        "max_segment_tokens": max((t for _, t, _ in shapes), default=0),
        # Members whose queries are short extends (vLLM's decode path without the routing).
        "max_short_extend_members": max((m for m, _, q in shapes if q <= 512), default=0),
        "max_segment_passes": max((c[2] for c in calls), default=0),
        "max_private_passes": max((c[3] for c in calls), default=0),
        **_where({c[0] for c in calls}),
    }


def shared_decode_evidence(evidence: Path) -> dict:
    """What the shared-decode wrapper wrote."""
    calls = [(pid, mode, _shapes(groups)) for pid, _, (mode, *groups) in _lines(evidence, "decode")]
    groups = [g for c in calls for g in c[2]]
    return {
        "modes": sorted({c[1] for c in calls}),
        "calls_with_groups": sum(1 for c in calls if c[2]),
        "max_members": max((m for m, _ in groups), default=0),
        "max_prefix_tokens": max((t for _, t in groups), default=0),
        **_where({c[0] for c in calls}),
    }


# --- the engine ------------------------------------------------------------------------------


def llm_kwargs(args: argparse.Namespace) -> dict:
    budget = SHARED_MAX_NUM_BATCHED_TOKENS if args.prompts.startswith("shared") else MAX_NUM_BATCHED_TOKENS
    kwargs: dict = dict(skip_tokenizer_init=True, tensor_parallel_size=args.tp, enforce_eager=args.eager)
    kwargs.update(max_model_len=16384, max_num_batched_tokens=budget, gpu_memory_utilization=args.gpu_mem)
    # Prefix caching is V1's default, stated: the prompt sets rely on it.
    kwargs.update(enable_prefix_caching=True, distributed_executor_backend=args.executor, seed=0)
    # Triton MoE and no all-reduce fusion: vLLM's automatic choices on Hopper (FlashInfer's CUTLASS MoE,
    # its all-reduce fusion at TP > 1) take minutes of JIT build on a host without FlashInfer's kernels.
    kwargs.update(moe_backend="triton", compilation_config={"pass_config": {"fuse_allreduce_rms": False}})
    if args.weights == "dummy":
        kwargs.update(model=str(MODEL_DIR), load_format="dummy")
    else:
        kwargs.update(model=str(args.model_dir), load_format="auto")
    if args.additional:
        kwargs["additional_config"] = {"mla_prefill_backend": args.additional}
    if args.flash_attn_version:
        # vLLM's own prefill kernel on another FlashAttention version (2 runs on SM90 too); vLLM's
        # MLA decode on SM90 stays FA3 whatever this says.
        kwargs["attention_config"] = {"flash_attn_version": args.flash_attn_version}
    if args.attention_backend:
        # vLLM's own other MLA decode kernel (stock): how far another implementation of the same decode is
        kwargs["attention_backend"] = args.attention_backend
    return kwargs


def flash_attn_libraries(worker: Any = None) -> list[str]:
    """Runs in each worker: vLLM's FlashAttention libraries mapped in that process (which versions ran)."""
    import re as _re

    with open("/proc/self/maps") as f:
        return sorted(set(_re.findall(r"_vllm_fa\d_C", f.read())))


def summarize(out: Any) -> dict:
    c = out.outputs[0]
    top2, top2_tokens = [], []
    for position in c.logprobs:
        best = sorted(position.items(), key=lambda kv: kv[1].logprob, reverse=True)[:TOP_LOGPROBS]
        top2.append([lp.logprob for _, lp in best])
        top2_tokens.append([tok for tok, _ in best])
    logprobs = [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)]
    record = dict(prompt_len=len(out.prompt_token_ids), tokens=list(c.token_ids), logprobs=logprobs)
    record["top2"] = top2
    return {**record, "top2_tokens": top2_tokens, "num_cached_tokens": out.num_cached_tokens}


def run(args: argparse.Namespace) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if args.custom or args.custom_class:
        from mla_prefill_ext import MLAPrefillBackendEnum, register_mla_prefill_backend

        path = args.custom_class or "counting_backend.CountingPrefillBackend"
        register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, path)

    if args.context_chunk_tokens or args.decode_threshold:
        install_builder_wrappers(args.evidence, args.context_chunk_tokens, args.decode_threshold)
    if args.shared_mode:
        install_shared_context_wrapper(args.shared_mode, args.evidence)
    if args.decode_mode:
        install_shared_decode_wrapper(args.decode_mode, args.evidence)
    if args.wrapped:
        import torch

        if torch.cuda.is_initialized():  # vLLM would then spawn, without the wrapper
            raise RuntimeError("CUDA is initialized in the runner: vLLM would spawn its engine unwrapped")

    t0 = time.perf_counter()
    llm = LLM(**llm_kwargs(args))
    ready_s = time.perf_counter() - t0
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOP_LOGPROBS, detokenize=False)

    def generate(token_lists: list[list[int]], params) -> list:
        return llm.generate([TokensPrompt(prompt_token_ids=t) for t in token_lists], params, use_tqdm=False)

    results: dict[str, list[dict]] = {}
    if args.prompts == "parity":
        base = prompts(PARITY_PROMPT_LENS, seed=1)
        results["batch"] = [summarize(o) for o in generate(base, greedy)]
        # Prefix-cache hit: shares the first PREFIX_SHARED tokens of an earlier prompt.
        hit = [base[0][:PREFIX_SHARED] + prompts([PREFIX_NEW], seed=2)[0]]
        results["prefix_hit"] = [summarize(o) for o in generate(hit, greedy)]
    elif args.prompts.startswith("shared"):
        sets, params = shared_prompt_sets(), greedy
        if args.prompts == "shared_decode":
            sets = shared_decode_prompt_sets()
            params = SamplingParams(temperature=0.0, max_tokens=DECODE_MAX_TOKENS, logprobs=TOP_LOGPROBS)
            params.detokenize, params.ignore_eos = False, True  # every output as long as asked
        # One call per set: its requests arrive together and are scheduled in one step.
        for key, token_lists in sets.items():
            results[key] = [summarize(o) for o in generate(token_lists, params)]
    else:
        # One request at a time, so each step holds one request and the cache is filled
        # before the prompt that reuses it.
        first = prompts([CHUNKS_PREFIX], seed=3)[0]
        second = first + prompts([CHUNKS_NEW], seed=4)[0]
        fresh = prompts([CHUNKS_FRESH], seed=5)[0]
        results["chunks"] = [summarize(generate([p], greedy)[0]) for p in (first, second, fresh)]

    bench = []
    if args.bench:
        one = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
        for length, batch in BENCH_GRID:
            times = []
            for rep in range(BENCH_REPS + 1):  # rep 0 warms up; fresh prompts defeat the prefix cache
                ps = prompts([length] * batch, seed=1000 * length + 10 * batch + rep)
                t = time.perf_counter()
                generate(ps, one)
                if rep:
                    times.append(time.perf_counter() - t)
            point = {"prompt_len": length, "batch": batch, "seconds": times}
            bench.append({**point, "tokens_per_s": [length * batch / s for s in times]})
    libraries = llm.collective_rpc(flash_attn_libraries) if args.flash_attn_version else None
    return {"ready_s": ready_s, "results": results, "bench": bench, "flash_attn_libraries": libraries}


def make_parser() -> argparse.ArgumentParser:
    """The runner's command line (a scenario's flags, scripts/gpu_harness/scenarios.py)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--stock", action="store_true", help="add-on disabled: vLLM as shipped")
    parser.add_argument("--backend-env", help="MLA_PREFILL_BACKEND for this engine")
    parser.add_argument("--additional", help="additional_config mla_prefill_backend")
    custom = parser.add_mutually_exclusive_group()
    custom.add_argument("--custom", action="store_true", help="register examples' counting CUSTOM backend")
    custom.add_argument("--custom-class", help="register CUSTOM to this class path (e.g. mutant_backends.X)")
    parser.add_argument("--spawn", action="store_true", help="VLLM_WORKER_MULTIPROC_METHOD=spawn")
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--weights", choices=["sharp", "dummy"], default="sharp")
    parser.add_argument("--model-dir", type=Path, help="the sharp checkpoint (default: generated to a cache)")
    parser.add_argument("--prompts", choices="parity chunks shared shared_decode".split(), default="parity")
    parser.add_argument("--context-chunk-tokens", type=int, help="test-only: chunked-context workspace size")
    parser.add_argument("--decode-threshold", type=int, help="test-only: the MLA builders' reorder threshold")
    shared = parser.add_mutually_exclusive_group()
    shared.add_argument("--shared-evidence", action="store_true", help="test-only: record the path's plans")
    shared.add_argument("--shared-mutant", choices=SHARED_MUTANTS, help="test-only: a wrong path")
    decode = parser.add_mutually_exclusive_group()
    decode.add_argument("--shared-decode", action="store_true", help="test-only: decode rows served")
    decode.add_argument("--shared-decode-mutant", choices=SHARED_MUTANTS, help="test-only: wrong decode rows")
    parser.add_argument("--bench", action="store_true")
    parser.add_argument("--executor", choices=["mp", "ray"], help="distributed_executor_backend")
    parser.add_argument("--gpu-mem", type=float, default=0.6, help="gpu_memory_utilization")
    parser.add_argument("--flash-attn-version", type=int, choices=[2, 3], help="vLLM's own, on stock")
    parser.add_argument("--attention-backend", help="vLLM's own attention backend (e.g. FLASHMLA), on stock")
    parser.add_argument("--example", action="store_true", help="count the installed example package's calls")
    return parser


def attach_evidence(record: dict, args: argparse.Namespace) -> None:
    """The test-only wrappers' evidence into the run's record (and the log); a run that went well fails
    when a wrapper's evidence is required and did not come from the engine process."""
    evidence, attached = args.evidence, []  # (record key, summary, the flag, more on a failure, required)
    if args.context_chunk_tokens:
        chunks = chunk_evidence(evidence, args.context_chunk_tokens)
        attached.append(("context_chunks", chunks, "--context-chunk-tokens", "", True))
    if args.decode_threshold:
        threshold = decode_threshold_evidence(evidence, args.decode_threshold)
        attached.append(("decode_threshold", threshold, "--decode-threshold", "", True))
    if args.shared_mode:
        context, flag = shared_context_evidence(evidence), f"--shared-mutant {args.shared_mutant}"
        attached.append(
            ("shared_context", context, flag, " (or made no shared plan)", bool(args.shared_mutant))
        )
    if args.decode_mode:
        decode = shared_decode_evidence(evidence)
        attached.append(("shared_decode", decode, "--shared-decode", " (or served no decode group)", True))
    not_forked = "left no evidence from the engine process (was the engine core spawned instead of forked?)"
    for key, summary, flag, more, required in attached:
        record[key] = summary
        print(f"{key.replace('_', ' ')}:", json.dumps(summary), flush=True)
        if record["ok"] and required and not summary["ran_in_engine_process"]:
            record.update(ok=False, error=f"the {flag} wrapper {not_forked}{more}")


def main() -> int:
    parser = make_parser()
    args = parser.parse_args()

    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local folders only; the GPU host has no network
    if args.stock:
        os.environ["MLA_PREFILL_EXT_DISABLE"] = "1"
    if args.flash_attn_version:
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with a function
    if args.backend_env:
        os.environ["MLA_PREFILL_BACKEND"] = args.backend_env
    if args.spawn:
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    args.shared_mode = args.shared_mutant or ("record" if args.shared_evidence else None)
    args.decode_mode = args.shared_decode_mutant or ("record" if args.shared_decode else None)
    if args.decode_mode:
        os.environ["MLA_PREFILL_SHARED_DECODE"] = "1"  # read when the add-on instruments vLLM's modules
    args.wrapped = any((args.context_chunk_tokens, args.shared_mode, args.decode_threshold, args.decode_mode))
    if args.wrapped and args.spawn:
        parser.error("the test-only wrappers need the engine forked (see the module docstring)")
    out = Path(args.out)
    count_file = out.with_suffix(".calls")
    args.evidence = out.with_suffix(".evidence")  # every test-only wrapper's lines
    for stale in (count_file, args.evidence):
        stale.unlink(missing_ok=True)
    if args.custom or args.example:
        variable = "MLA_PREFILL_EXAMPLE_COUNT_FILE" if args.example else "MLA_PREFILL_COUNT_FILE"
        os.environ[variable] = str(count_file)
    if args.executor == "ray":
        # The test's own counting variables, copied as a user's backend would ask vLLM to copy its own.
        os.environ["VLLM_RAY_EXTRA_ENV_VARS_TO_COPY"] = (
            "MLA_PREFILL_COUNT_FILE,MLA_PREFILL_EXAMPLE_COUNT_FILE"
        )
    if args.custom or args.custom_class:
        # The backend's module must be importable in vLLM's child processes too.
        os.environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(EXAMPLES), str(TEST_DOUBLES), os.environ.get("PYTHONPATH")])
        )
        sys.path[:0] = [str(EXAMPLES), str(TEST_DOUBLES)]

    plain_args = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    record: dict = {"name": args.name, "args": plain_args, "pid": os.getpid()}
    try:
        if args.weights == "sharp":
            args.model_dir = ensure_checkpoint(args.model_dir or default_checkpoint_dir())
            record["model_dir"] = str(args.model_dir)
        record["weights"] = args.weights
        record.update(run(args), ok=True)
    except Exception as e:  # the failure itself is the result for startup-error scenarios
        record.update(ok=False, error=f"{type(e).__name__}: {e}")
        traceback.print_exc()
    attach_evidence(record, args)
    if (args.custom or args.example) and count_file.exists():
        calls = [line.split(" ", 1) for line in count_file.read_text().splitlines()]
        pids, kinds = sorted({int(pid) for pid, _ in calls}), sorted({what.split()[0] for _, what in calls})
        record["custom_calls"] = {"lines": len(calls), "pids": pids, "kinds": kinds}
    Path(args.out).write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
