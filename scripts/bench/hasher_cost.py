"""vLLM's request block hasher and the add-on's reusing hasher around it, call by call, paired (CPU).

    python -m scripts.bench hasher_cost [--requests 16] [--prefix 8192] [--private] [--new 128]
        [--block-size 64] [--rounds 60] [--json out.json]

One call: ``--requests`` new ``vllm.v1.request.Request`` objects, each hashed on creation (as the engine
core's ``preprocess_add_request`` does): ``--prefix`` leading tokens, one prefix shared by all
(default) or each request's own (``--private``, the engine benchmark's private point; the same
prefixes in every call), then ``--new`` random tokens of each request's own, new every call. Two
hashers over vLLM's real one (``get_request_block_hasher``, sha256, ``init_none_hash``): ``stock``
(vLLM's alone) and ``reuse`` (``prefix_hashes.ReusingHasher`` around it, as the add-on's engine core
has it), in one process, taking turns in an order alternating from round to round, one untimed round
first. Printed and in the JSON: each side's median ms per call, the paired differences (reuse minus
stock, ms per call: median and quartiles), and the blocks the reusing hasher reused and hashed.

What it answers: the engine core's hashing part of the shared-prefix path, where there is something to
reuse (shared) and where there is nothing (private with more requests than the 8 recent ones the
reusing hasher remembers, as at 16: every request's first block is compared with theirs, nothing
matches, and it is remembered without a copy of its tokens). A call's requests stay alive until it
ends, as in the engine, where they are in flight together.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from . import common

VOCAB = 129280  # the R1 slice's vocabulary


def calls(args: Any) -> dict[str, Any]:
    os.environ["MLA_PREFILL_EXT_DISABLE"] = "1"  # vLLM's hasher as vLLM makes it; the add-on is driven here
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name  # vLLM 0.20.2, 0.25.1 and 0.33.0
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from mla_prefill_ext.hosts.core.shared_prefix.prefix_hashes import ReusingHasher

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    stock = get_request_block_hasher(args.block_size, hash_fn)
    hashers = {"stock": stock, "reuse": ReusingHasher(stock, args.block_size)}
    if args.private:
        prefixes = [common.seeded_tokens(f"prefix{i}", args.prefix, VOCAB) for i in range(args.requests)]
    else:
        prefixes = [common.seeded_tokens("prefix", args.prefix, VOCAB)] * args.requests
    params = SamplingParams(max_tokens=1)
    ms: dict[str, list[float]] = {side: [] for side in hashers}
    for rnd in range(args.rounds + 1):  # the first untimed
        order = list(hashers) if rnd % 2 else list(reversed(hashers))
        for side in order:
            prompts = [
                prefixes[i] + common.seeded_tokens(f"{side}/{rnd}/{i}", args.new, VOCAB)
                for i in range(args.requests)
            ]
            start = time.perf_counter()
            # A call's requests are in flight together, as in the engine (a finished one lends nothing).
            in_flight = [
                Request(f"{side}-{rnd}-{i}", prompt, params, None, block_hasher=hashers[side])
                for i, prompt in enumerate(prompts)
            ]
            if rnd:
                ms[side].append((time.perf_counter() - start) * 1e3)
            del in_flight  # freed outside the timing, as the engine core frees them on its busy loop
    diffs = sorted(r - s for s, r in zip(ms["stock"], ms["reuse"], strict=True))
    quartiles = statistics.quantiles(diffs, n=4) if len(diffs) > 1 else [diffs[0]] * 3
    reusing = hashers["reuse"]
    return {
        "median_ms": {side: statistics.median(v) for side, v in ms.items()},
        "reuse_minus_stock_ms": {"median": statistics.median(diffs), "q1": quartiles[0], "q3": quartiles[2]},
        "reused_blocks": reusing.reused_blocks,
        "hashed_blocks": reusing.hashed_blocks,
        "raw_ms": ms,
    }


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(__doc__)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prefix", type=int, default=8192, help="leading tokens: shared, or each its own")
    parser.add_argument("--private", action="store_true", help="each request its own prefix")
    parser.add_argument("--new", type=int, default=128, help="each request's own new tokens")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=60, help="timed rounds (one more untimed first)")
    parser.add_argument("--json", help="write the results and every raw time here")
    args = parser.parse_args(argv)
    if min(args.requests, args.new, args.rounds, args.block_size) < 1 or args.prefix < 0:
        parser.error("--requests, --new, --rounds and --block-size must be at least 1, --prefix at least 0")
    res = calls(args)
    d = res["reuse_minus_stock_ms"]
    print(
        f"{args.requests} requests x ({args.prefix} {'own' if args.private else 'shared'} + {args.new} new) "
        f"tokens, block size {args.block_size}, {args.rounds} rounds: "
        f"stock {res['median_ms']['stock']:.2f} ms, reuse {res['median_ms']['reuse']:.2f} ms per call; "
        f"reuse minus stock {d['median']:+.3f} ms [{d['q1']:+.3f}, {d['q3']:+.3f}] (median [quartiles]); "
        f"blocks reused {res['reused_blocks']}, "
        f"hashed {res['hashed_blocks']}",
        flush=True,
    )
    common.write_json(args.json, common.record(args=vars(args), hasher_cost=res))
    return 0
