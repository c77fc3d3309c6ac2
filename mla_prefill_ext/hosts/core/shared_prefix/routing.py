"""Short extends that share a long cached prefix, routed to the prefill path when that is cheaper.

vLLM serves a request with cached context and at most ``reorder_batch_threshold`` new tokens
(512 for FLASH_ATTN_MLA) as a decode: absorbed attention over the latent cache, about 3.4x the
FLOPs of up-projected attention per query, and nothing shared. For a step whose short extends
share cached blocks, the prefill path with the shared segments (:mod:`.step`) does the prefix's
up-projection once and attends with 320-wide heads instead of 1,088. Per step, before vLLM
reorders the batch, :func:`step_threshold` compares the two by predicted time over all of the step's
short extends (those not in a group pay their own up-projection on the prefill path); when the
prefill side costs less than :data:`ROUTE_BELOW` of the absorbed side, the step's decode
threshold is lowered to 1 for the reorder and for the builders' split, so those requests become
prefills; so do the step's short new prompts (at most the threshold's tokens, no context), which
vLLM counts as decodes when every request of the step is that short (their attention is over their
own few tokens either way). Everything else stays where vLLM puts it: true decodes (one new token),
long extends, long prompts. Groups are those the step planner forms (:mod:`.costs`), so a routed step
has its shared segment. Not with speculative decoding (its decodes have several tokens).

The comparison is in time, not FLOPs: each side's FLOPs over the rate that part ran at on an H200
(:data:`H200_TFLOPS`, one layer of R1 at 16 heads, ``python -m scripts.bench shared_prefix_layer``,
docs/benchmarks.md section 11). The up-projection runs at a third of the attention kernels' rate
(it also gathers the latents and writes K and V), so by FLOPs alone the router moved steps that only
broke even (16 requests, 32 new tokens each over a 32k prefix: 1.06x measured for one layer, 1.89x
predicted by FLOPs; 1.02x by time).
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import numpy as np

from mla_prefill_ext._logging import logger
from mla_prefill_ext.hosts.core.shared_prefix import costs, counters, switch
from mla_prefill_ext.shared_prefix import find_shared_prefixes

ROUTE_BELOW = 0.8
"""Route when the prefill side's predicted time is below this share of the absorbed side's (the new
tokens' own attention pass, the step's planning and extra launches are not in the model)."""

# FLOPs per (query, context token) and per up-projected context token, per head, at R1's dims.
ABSORBED_PER_QK = 2 * (512 + 64 + 512)  # scores over 576 latent dims, values over 512
PREFILL_PER_QK = 2 * (192 + 128)
UP_PROJECTION_PER_TOKEN = 2 * 512 * (128 + 128)

H200_TFLOPS = {"absorbed": 622.0, "prefill_attention": 739.0, "up_projection": 215.0}
"""Each part's rate on an H200 (vLLM 0.20.2, FA3, bf16; one R1 layer, 16 requests over a shared 32k
prefix, N = 32, 128, 256, 512 new tokens each), least-squares fits of the layer benchmark's times: the
absorbed side's time as a line through the origin in N; the shared side's as a line, whose slope is the
segment's attention and whose intercept (0.64 ms) the prefix's up-projection with its gather and K/V
writes. Only their ratios matter."""

_FLOPS_PER_US = {part: tflops * 1e6 for part, tflops in H200_TFLOPS.items()}  # TFLOP/s = 1e6 FLOP/us

SHAPES: collections.deque[tuple[int, int, bool]] = collections.deque(maxlen=256)
"""The V1 runner's last steps' (requests, scheduled tokens, routed), this process's: how a benchmark's
call was split into steps (requests that reach an engine apart run in separate steps, each its own
forward). Every step the runner reordered, one entry each as the count ``steps`` counts them, empty ones
included (``(0, 0, False)``: async scheduling's steps that only collect the previous step's output)."""
_LOCAL = threading.local()  # this step's lowered threshold, between the reorder and the builders
_USABLE = threading.Event()  # a builder found the path usable (its backend takes shared segments)


def mark_usable() -> None:
    _USABLE.set()


def current_threshold() -> int | None:
    return getattr(_LOCAL, "threshold", None)


def route_cost(
    q: np.ndarray, ctx: np.ndarray, shared: np.ndarray, group_tokens: list[int]
) -> tuple[float, float]:
    """(absorbed, prefill) predicted time of the short extends ``q`` new over ``ctx`` cached tokens,
    in microseconds per head of one layer (FLOPs over :data:`H200_TFLOPS`).

    ``shared[i]``: the tokens of request ``i``'s context its group up-projects once
    (``group_tokens``, one entry per group).
    """
    attention = float((q * ctx).sum())
    projected = float((ctx - shared).sum()) + float(sum(group_tokens))
    absorbed = ABSORBED_PER_QK * attention / _FLOPS_PER_US["absorbed"]
    prefill = (
        PREFILL_PER_QK * attention / _FLOPS_PER_US["prefill_attention"]
        + UP_PROJECTION_PER_TOKEN * projected / _FLOPS_PER_US["up_projection"]
    )
    return absorbed, prefill


def route_threshold(
    rows: np.ndarray, ctx: np.ndarray, q: np.ndarray, block_size: int, threshold: int
) -> int | None:
    """1 when the step's short extends are cheaper as shared prefills; None: vLLM's threshold.

    Per request of the step, in batch order: ``rows`` its block ids (host), ``ctx`` its cached tokens,
    ``q`` its new tokens. Short extends: cached context and more than one, at most ``threshold``, new
    tokens (true decodes have one; speculative decoding, whose decodes have several, is not routed).
    """
    short = (ctx > 0) & (q > 1) & (q <= threshold)
    if short.sum() < 2:
        return None
    ctx, q = ctx[short], q[short]
    groups = find_shared_prefixes(rows[short], ctx, block_size, q, costs.GROUP_VALUE)
    if not groups:
        return None
    shared = np.zeros_like(ctx)
    tokens = []
    for g in groups:
        t = g.num_blocks * block_size
        shared[list(g.members)] = t
        tokens.append(t)
    absorbed, prefill = route_cost(q, ctx, shared, tokens)
    return 1 if prefill < ROUTE_BELOW * absorbed else None


def step_threshold(input_batch: Any, num_scheduled_tokens: dict[str, int], threshold: int) -> int | None:
    """V1 runner, before it reorders the batch: :func:`route_threshold` from its ``InputBatch`` (host
    arrays only) and the scheduler output's ``num_scheduled_tokens``, by request id."""
    batch = input_batch
    n = batch.num_reqs
    if n < 2:
        return None
    q = np.fromiter((num_scheduled_tokens[r] for r in batch.req_ids[:n]), dtype=np.int64, count=n)
    ctx = batch.num_computed_tokens_cpu[:n].astype(np.int64)
    table = batch.block_table[0]
    return route_threshold(table.block_table.np[:n], ctx, q, table.block_size, threshold)


def builder_threshold(builder: Any, common: Any, rows: np.ndarray | None) -> int | None:
    """V2 runner (vLLM 0.33+), in the builder: :func:`route_threshold` from the step's common metadata.

    The V2 runner already orders a step's requests by their new tokens (decodes, then short extends,
    then prefills), so a threshold of 1 in the builder's split is all routing takes there; no reorder.
    ``rows``: the step's host block rows (:func:`.block_tables.host_rows`).
    """
    threshold = getattr(builder, "reorder_batch_threshold", None)
    n = common.num_reqs
    if rows is None or threshold is None or threshold <= 1 or n < 2:
        return None
    if getattr(builder.vllm_config, "speculative_config", None) is not None:
        return None
    seq_lens = getattr(common, "seq_lens_cpu_upper_bound", None)  # exact for prefill rows
    if seq_lens is None:
        return None
    loc = common.query_start_loc_cpu[: n + 1].numpy().astype(np.int64)
    q = loc[1:] - loc[:-1]
    ctx = seq_lens[:n].numpy().astype(np.int64) - q
    lowered = route_threshold(rows[:n], ctx, q, builder.kv_cache_spec.block_size, threshold)
    if lowered is not None:
        _count_routed()
    return lowered


def _count_routed() -> None:
    if counters.add("steps_routed") == 1:
        logger.info(
            "MLA shared-prefix prefill (mla-prefill-ext): a step's short extends that share a cached "
            "prefix run on the prefill path from now on, where that is cheaper (the first such step)."
        )


def _routing_on(runner: Any) -> bool:
    on = runner.__dict__.get("_mla_shared_routing")
    if on is None:
        config = runner.vllm_config
        on = switch.decide(config).on and getattr(config, "speculative_config", None) is None
        runner._mla_shared_routing = on
    return on and _USABLE.is_set()


def may_reorder_batch(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    """``GPUModelRunner._may_reorder_batch(scheduler_output)``: this step's threshold decided first."""
    _LOCAL.threshold = None
    counters.add("steps")
    scheduler_output = kwargs.get("scheduler_output", args[0] if args else None)
    scheduled = scheduler_output.num_scheduled_tokens
    SHAPES.append((len(scheduled), scheduler_output.total_num_scheduled_tokens, False))
    threshold = instance.reorder_batch_threshold
    if threshold is None or threshold <= 1 or not _routing_on(instance):
        return wrapped(*args, **kwargs)
    lowered = step_threshold(instance.input_batch, scheduled, threshold)
    if lowered is None:
        return wrapped(*args, **kwargs)
    _LOCAL.threshold = lowered
    _count_routed()
    SHAPES[-1] = (*SHAPES[-1][:2], True)
    instance.reorder_batch_threshold = lowered
    try:
        return wrapped(*args, **kwargs)
    finally:
        instance.reorder_batch_threshold = threshold


def build_at_threshold(wrapped: Any, instance: Any, args: Any, kwargs: Any, lowered: int | None) -> Any:
    """The MLA builder's ``build``, splitting decodes from prefills at ``lowered`` (None: vLLM's own)."""
    threshold = getattr(instance, "reorder_batch_threshold", None)
    if lowered is None or threshold is None or threshold <= lowered:
        return wrapped(*args, **kwargs)
    instance.reorder_batch_threshold = lowered
    try:
        return wrapped(*args, **kwargs)
    finally:
        instance.reorder_batch_threshold = threshold
