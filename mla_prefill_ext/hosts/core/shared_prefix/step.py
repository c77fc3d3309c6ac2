"""Once per step, after vLLM's metadata builder: the plan, the private chunks, the segment instance.

vLLM's ``build`` has made the prefill metadata with its own chunk plan and prepared the step's
backend. When the step's prefill requests share cached leading blocks worth sharing
(:func:`mla_prefill_ext.shared_prefix.plan_context`), the private chunks replace vLLM's
(:func:`~mla_prefill_ext.shared_prefix.attach_private_chunks`), the step's backend is prepared
again for them, a second instance of it is prepared for the shared segments, and the prefill
metadata carries a :class:`SharedStep` for the layers. Otherwise nothing changes: the layers run
vLLM's own context path. Reads host copies only (block table, query offsets, sequence lengths).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from typing import Any

from mla_prefill_ext._logging import first_time, log_once, logger
from mla_prefill_ext.backend_errors import is_backend_error, note_backend_error
from mla_prefill_ext.hosts.core.shared_prefix import (
    block_tables,
    costs,
    counters,
    decode_rows,
    routing,
    switch,
)
from mla_prefill_ext.shared_prefix import (
    ContextPlan,
    SegmentInstance,
    accepts_shared_segments,
    attach_private_chunks,
    find_shared_prefixes,
    plan_context,
)

STEP_ATTR = "mla_shared_step"
"""The prefill metadata's attribute holding the step's :class:`SharedStep` (absent: vLLM's path)."""


class SharedStep:
    """What the layers of one step read: the plan on the device and each backend key's two instances."""

    __slots__ = ("backends", "plan")

    def __init__(self, plan: ContextPlan, backends: dict[Hashable, tuple[Any, Any]]) -> None:
        self.plan = plan
        self.backends = backends  # key -> (step instance, segment instance)

    def instances_for(self, impl: Any) -> tuple[Any, Any]:
        if len(self.backends) == 1:
            return next(iter(self.backends.values()))
        key = getattr(getattr(impl, "prefill_backend", None), "step_key", None)
        return self.backends[key]


class _BuilderState:
    __slots__ = ("decision", "decode", "segments", "usable")

    def __init__(self, decision: switch.PathDecision, decode: str | None) -> None:
        self.decision = decision
        self.decode = decode  # why its decode rows are not served (None: they are)
        self.usable: bool | None = None  # its backends take shared segments (None: not known yet)
        self.segments: dict[Hashable, SegmentInstance] = {}


def _state(builder: Any) -> _BuilderState:
    state = builder.__dict__.get("_mla_shared_prefix")
    if state is None:
        decision = switch.decide_and_say(builder.vllm_config)
        state = _BuilderState(decision, decode_rows.decide_and_say(builder.vllm_config))
        builder._mla_shared_prefix = state
    return state


def step_backends(builder: Any, prefill: Any) -> dict[Hashable, tuple[Any, Callable[[Any], None]]] | None:
    """The step's add-on instances by backend key, each with how to prepare it again (None: not ours).

    vLLM 0.20, the patch: the builder's prepared runners, one per key, on the prefill metadata.
    vLLM 0.23+, the bridge: the builder's adapter and the add-on instance inside it.
    """
    runners = getattr(prefill, "mla_prefill_runners", None)
    if runners:
        return {key: (runner, runner.prepare_metadata) for key, runner in runners.items()}
    adapter = getattr(builder, "_prefill_backend", None)
    inner = getattr(adapter, "inner", None)
    if inner is not None:
        # The add-on instance itself: on 0.29+ the adapter's own preparation shows it no chunks
        # (vLLM's chunk objects go to per-chunk views); the private passes are the add-on's kind.
        return {None: (inner, inner.prepare_metadata)}
    return None


def _make_segment_instances(builder: Any, state: _BuilderState) -> None:
    """One segment instance per backend key, made at the builder's first build (engine start), so
    that its workspace is reserved then, not on the first step with a shared prefix."""
    runners = builder.__dict__.get("_mla_prefill_runners")
    if runners:
        backends = dict(runners)
    else:
        backends = {None: builder._prefill_backend.inner}
    for key, backend in backends.items():
        state.segments[key] = SegmentInstance(backend, builder.device)


def _backends_accept(builder: Any) -> bool | None:
    """Whether the builder's add-on instances all take shared segments (None: none made yet).

    Known before any step with context: the patch's runners (vLLM 0.20) or the bridge's adapter.
    One INFO line names a backend that does not; its steps run vLLM's own context plan.
    """
    runners = builder.__dict__.get("_mla_prefill_runners")
    if runners:
        backends = list(runners.values())
    else:
        inner = getattr(getattr(builder, "_prefill_backend", None), "inner", None)
        backends = [inner] if inner is not None else []
    if not backends:
        return None
    refusing = [type(b).__name__ for b in backends if not accepts_shared_segments(b)]
    if refusing:
        log_once(
            logging.INFO,
            ("shared-prefix-backend", tuple(refusing)),
            "MLA shared-prefix prefill (mla-prefill-ext): off for backend %s, which does not declare "
            "accepts_shared_context_segments; it runs vLLM's own context plan.",
            ", ".join(refusing),
        )
    return not refusing


def _arg(args: Any, kwargs: Any, name: str, index: int) -> Any:
    return kwargs[name] if name in kwargs else (args[index] if len(args) > index else None)


def after_build(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    """``MLACommonMetadataBuilder.build``: vLLM's metadata, with a shared-prefix plan when one pays."""
    state = _state(instance)
    common = _arg(args, kwargs, "common_attn_metadata", 1)
    on = state.decision.on
    rows, lowered = None, routing.current_threshold()  # the V1 runner's reorder decided it
    if on and state.usable:
        try:
            rows = block_tables.host_rows(common)
            if lowered is None and rows is not None and getattr(common, "req_idx", None) is not None:
                lowered = routing.builder_threshold(instance, common, rows)  # the V2 runner: here
        except Exception:
            rows, lowered = None, None  # vLLM's own split and context path for this step
            if first_time("shared-prefix-rows-failed"):
                logger.exception(
                    "mla-prefill-ext: reading the step's block rows failed; this step (and any other "
                    "that fails the same way) runs vLLM's own split and context path"
                )
    metadata = routing.build_at_threshold(wrapped, instance, args, kwargs, lowered)
    if not on:
        return metadata
    if state.decode is None and getattr(metadata, "decode", None) is not None:
        _plan_decode(instance, metadata, common)
    if state.usable is None:
        state.usable = _backends_accept(instance)
        if state.usable:
            _make_segment_instances(instance, state)
            routing.mark_usable()  # short extends may be routed here from now on (routing.py)
            rows = block_tables.host_rows(common)
    prefill = getattr(metadata, "prefill", None)
    if not state.usable or prefill is None or getattr(prefill, "chunked_context", None) is None:
        return metadata
    try:
        plan_step(instance, metadata, prefill, common, rows, state)
    except Exception as e:
        if is_backend_error(e):
            raise  # a backend that raised: no fallback, the engine stops (mla_prefill_ext.backend_errors)
        # A fault of the add-on's planning must not stop the engine: this step runs vLLM's own
        # context path, and the log says so with the traceback (once per process).
        prefill.__dict__.pop(STEP_ATTR, None)
        if first_time("shared-prefix-plan-failed"):
            logger.exception(
                "mla-prefill-ext: planning the shared-prefix path failed; this step (and any other "
                "that fails the same way) runs vLLM's own context path"
            )
    return metadata


def _plan_decode(builder: Any, metadata: Any, common: Any) -> None:
    try:
        decode_rows.plan_step(builder, metadata, common, block_tables.host_rows(common))
    except Exception:  # a fault of the add-on's planning: this step runs vLLM's decode, the log says so once
        metadata.decode.__dict__.pop(decode_rows.DECODE_ATTR, None)
        if first_time("shared-decode-plan-failed"):
            logger.exception(
                "mla-prefill-ext: planning the shared-prefix decode failed; this step (and any other that "
                "fails the same way) runs vLLM's own decode"
            )


def plan_step(
    builder: Any, metadata: Any, prefill: Any, common: Any, rows: Any, state: _BuilderState
) -> None:
    """Plan the step; attach the plan and prepare both instances when it has shared segments.

    ``rows``: the step's host block rows (:func:`.block_tables.host_rows`; None: not known here).
    """
    import torch

    if prefill.q_data_type not in (torch.bfloat16, torch.float16, torch.float32):
        return  # FP8 prefill queries: vLLM's path
    seq_lens = getattr(common, "seq_lens_cpu_upper_bound", None)
    if rows is None or seq_lens is None:
        log_once(
            logging.INFO,
            "shared-prefix-no-host-table",
            "MLA shared-prefix prefill (mla-prefill-ext): the runner's host block table or sequence "
            "lengths are not known here; steps run vLLM's own context path.",
        )
        return
    backends = step_backends(builder, prefill)
    if not backends:
        return
    start, end = metadata.num_decodes, common.num_reqs
    loc = common.query_start_loc_cpu[start : end + 1]
    loc = loc - loc[0]
    context_lens = (seq_lens[start:end] - (loc[1:] - loc[:-1])).numpy()
    block_size = builder.kv_cache_spec.block_size
    rows = rows[start:end]
    qlens = (loc[1:] - loc[:-1]).numpy()
    # Most steps share nothing: find out before building any chunk.
    groups = find_shared_prefixes(rows, context_lens, block_size, qlens, costs.GROUP_VALUE)
    if not groups:
        return
    plan = plan_context(
        rows, context_lens, loc.numpy(), block_size, builder.chunked_prefill_workspace_size, groups=groups
    )
    if not plan.has_segments:
        return
    device = prefill.query_start_loc.device
    # What can fail comes first, while the prefill metadata is still vLLM's own.
    on_device = plan.to(device)  # one copy for the layers and both instances' views
    segments = {key: state.segments[key].prepare(plan, prefill, on_device) for key in backends}
    shared = SharedStep(on_device, {key: (b, segments[key]) for key, (b, _) in backends.items()})
    attach_private_chunks(plan, prefill, on_device)
    for backend, prepare in backends.values():
        try:
            prepare(prefill)  # the private chunks, in place of vLLM's
        except Exception as e:  # the backend's failure stops the engine (after_build lets it through)
            note_backend_error(e, backend, "prepare_metadata (the shared-prefix private chunks)")
            raise
    setattr(prefill, STEP_ATTR, shared)
    if counters.add("steps_with_segments") == 1:
        s = plan.segments[0]
        logger.info(
            "MLA shared-prefix prefill (mla-prefill-ext): the first step with a shared prefix: %d "
            "segment(s), the first of %d tokens shared by %d requests.",
            len(plan.segments),
            s.num_tokens,
            len(s.members),
        )
