#!/usr/bin/env python3
"""Runs one vLLM 0.20 engine scenario on the tiny DeepSeek-V2 and writes its results as JSON.

A scenario is one engine lifetime in a fresh process (so that the add-on's
environment switches reach vLLM's child processes as they would for a user):

    python tests/gpu/engine_runner.py --name shim-fa --backend-env FLASH_ATTN --out r.json [--bench]

Greedy tokens and logprobs for prompts that take every prefill path (plain,
chunked prefill over prior context, a prefix-cache hit), and with ``--bench``
prefill throughput (prompt tokens/s, ``max_tokens=1``) for a grid of shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODEL_DIR = HERE / "tiny_deepseek_v2"
EXAMPLES = HERE.parent.parent / "examples"

MAX_NUM_BATCHED_TOKENS = 4096  # prompts longer than this prefill in chunks over prior context
PARITY_PROMPT_LENS = [6000, 4500, 1200, 700]
PREFIX_SHARED, PREFIX_NEW = 4096, 1000  # a second request reusing 4096 cached tokens
MAX_TOKENS = 16
BENCH_GRID = [(1024, 1), (1024, 16), (4096, 1), (4096, 8), (8192, 4)]
BENCH_REPS = 5
VOCAB = 32000


def prompts(lengths: list[int], seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB) for _ in range(n)] for n in lengths]


def run(args: argparse.Namespace) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if args.custom:
        from mla_prefill_ext import MLAPrefillBackendEnum, register_mla_prefill_backend

        register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, "counting_backend.CountingPrefillBackend")

    kwargs: dict = {}
    if args.additional:
        kwargs["additional_config"] = {"mla_prefill_backend": args.additional}
    t0 = time.perf_counter()
    llm = LLM(
        model=str(MODEL_DIR),
        load_format="dummy",
        skip_tokenizer_init=True,
        tensor_parallel_size=args.tp,
        enforce_eager=args.eager,
        max_model_len=16384,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        gpu_memory_utilization=0.6,
        seed=0,
        # Triton MoE: vLLM's automatic choice on Hopper is FlashInfer's CUTLASS MoE, whose
        # JIT build takes many minutes on a host without FlashInfer's prebuilt kernels.
        moe_backend="triton",
        # Likewise FlashInfer's all-reduce fusion (TP > 1): minutes of JIT build per host.
        compilation_config={"pass_config": {"fuse_allreduce_rms": False}},
        **kwargs,
    )
    ready_s = time.perf_counter() - t0
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1, detokenize=False)

    def generate(token_lists: list[list[int]], params) -> list:
        return llm.generate([TokensPrompt(prompt_token_ids=t) for t in token_lists], params, use_tqdm=False)

    def summarize(out) -> dict:
        c = out.outputs[0]
        return {
            "prompt_len": len(out.prompt_token_ids),
            "tokens": list(c.token_ids),
            "logprobs": [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)],
            "num_cached_tokens": out.num_cached_tokens,
        }

    base = prompts(PARITY_PROMPT_LENS, seed=1)
    results = {"batch": [summarize(o) for o in generate(base, greedy)]}
    # Prefix-cache hit: shares the first PREFIX_SHARED tokens of an earlier prompt.
    hit = [base[0][:PREFIX_SHARED] + prompts([PREFIX_NEW], seed=2)[0]]
    results["prefix_hit"] = [summarize(o) for o in generate(hit, greedy)]

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
            bench.append(
                {
                    "prompt_len": length,
                    "batch": batch,
                    "seconds": times,
                    "tokens_per_s": [length * batch / s for s in times],
                }
            )
    return {"ready_s": ready_s, "results": results, "bench": bench}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--stock", action="store_true", help="add-on disabled: vLLM as shipped")
    parser.add_argument("--backend-env", help="MLA_PREFILL_BACKEND for this engine")
    parser.add_argument("--additional", help="additional_config mla_prefill_backend")
    parser.add_argument("--custom", action="store_true", help="register the counting CUSTOM backend")
    parser.add_argument("--spawn", action="store_true", help="VLLM_WORKER_MULTIPROC_METHOD=spawn")
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--bench", action="store_true")
    args = parser.parse_args()

    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    if args.stock:
        os.environ["MLA_PREFILL_EXT_DISABLE"] = "1"
    if args.backend_env:
        os.environ["MLA_PREFILL_BACKEND"] = args.backend_env
    if args.spawn:
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    count_file = Path(args.out).with_suffix(".calls")
    if args.custom:
        count_file.unlink(missing_ok=True)
        os.environ["MLA_PREFILL_COUNT_FILE"] = str(count_file)
        # The backend's module must be importable in vLLM's child processes too.
        os.environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(EXAMPLES), os.environ.get("PYTHONPATH")])
        )
        sys.path.insert(0, str(EXAMPLES))

    record: dict = {"name": args.name, "args": vars(args), "pid": os.getpid()}
    try:
        record.update(run(args))
        record["ok"] = True
    except Exception as e:  # the failure itself is the result for startup-error scenarios
        record["ok"] = False
        record["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    if args.custom and count_file.exists():
        calls = [line.split(" ", 1) for line in count_file.read_text().splitlines()]
        record["custom_calls"] = {
            "lines": len(calls),
            "pids": sorted({int(pid) for pid, _ in calls}),
            "kinds": sorted({what.split()[0] for _, what in calls}),
        }
    Path(args.out).write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
