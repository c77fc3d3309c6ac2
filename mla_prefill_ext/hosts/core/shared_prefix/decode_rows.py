"""Decode rows over a shared prefix, on FLASH_ATTN_MLA (Hopper's decode default): planned once per step in
the builder, served per layer in place of ``FlashAttnMLAImpl.forward_mqa``
(:mod:`mla_prefill_ext.shared_prefix.decode`).

Off unless turned on (:func:`mla_prefill_ext.settings.shared_decode_setting`) until its token parity is
shown on a GPU. Served only where vLLM runs the layer's attention in Python: eager steps and piecewise
CUDA graphs (attention runs between the pieces). On the V2 runner (vLLM 0.33+) a one-token decode step whose
rows are served is dispatched to the piecewise graphs (:func:`uniform_unless_served`) instead of the full
decode graph; on the V1 runner such a step replays the full graph if vLLM captured one, and runs the
attention vLLM captured, whatever this module planned. No plan is ever made inside a capture. Not with
speculative decoding (the host's sequence lengths are upper bounds there, and more than one new token a
row lost in the measurements) nor where the decode call returns its LSE (decode context parallelism).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import numpy as np

from mla_prefill_ext._logging import first_time, log_once, logger
from mla_prefill_ext.hosts.core.shared_prefix import block_tables, costs, counters, needs, switch
from mla_prefill_ext.mla_layers import MLA_MODULE
from mla_prefill_ext.settings import shared_decode_setting
from mla_prefill_ext.shared_prefix.decode import decode_attention, fa3_attend, plan_decode
from mla_prefill_ext.shared_prefix.execute import vllm_merge

DECODE_ATTR = "mla_shared_decode"
"""The decode metadata's attribute holding the step's device plan (absent: vLLM's decode)."""


NOT_WRAPPED = {
    needs.ANY: "vLLM's FLASH_ATTN_MLA module was not imported with the path in place",
    needs.V2: "vLLM's V2 model runner was not imported with the path in place",
}
WRAP_PROBLEMS: dict[str, str | None] = dict(NOT_WRAPPED)
"""Why the decode part's wrappers are not in place in this process, per runner of the table's rows (None:
they are): ``any``, ``forward_mqa`` (the rows are served); ``V2``, the runner's graph choice (served steps
dispatched to piecewise graphs). Set by the instrumentor."""


def decide(vllm_config: Any) -> str | None:
    """Why this engine's decode rows are not served (None: they are, where a step's plan pays)."""
    on, source = shared_decode_setting()
    if not on:
        return f"turned off by {source}"
    if getattr(vllm_config, "speculative_config", None) is not None:
        return "speculative decoding is on (not served)"
    return WRAP_PROBLEMS[needs.ANY]


def decide_and_say(vllm_config: Any) -> str | None:
    """:func:`decide`, with one INFO line per process and outcome where the user turned it on."""
    why = decide(vllm_config)
    if shared_decode_setting()[0]:
        log_once(
            logging.INFO,
            ("shared-decode", why),
            "MLA shared-prefix decode (mla-prefill-ext): %s.",
            f"off ({why})" if why else "on, for groups of decode rows in the measured crossover",
        )
    return why


def _capturing() -> bool:
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def plan_step(builder: Any, metadata: Any, common: Any, rows: Any) -> None:
    """After vLLM's ``build``: the step's decode groups on ``metadata.decode`` when one pays."""
    decode = getattr(metadata, "decode", None)
    served = getattr(sys.modules.get(needs.FA_MLA_MODULE), "FlashAttnMLADecodeMetadata", None)
    if served is None or not isinstance(decode, served) or rows is None or _capturing():
        return  # another decode backend's metadata: its kernel is not the one measured
    seq_lens = getattr(common, "seq_lens_cpu_upper_bound", None)
    if seq_lens is None:
        return
    n = metadata.num_decodes
    loc = common.query_start_loc_cpu[: n + 1]
    block_size = builder.kv_cache_spec.block_size
    qlens = (loc[1:] - loc[:-1]).numpy()
    plan = plan_decode(rows[:n], seq_lens[:n].numpy(), qlens, block_size, costs.DECODE_VALUE)
    if plan is None:
        return
    setattr(decode, DECODE_ATTR, plan.to(decode.block_table, decode.seq_lens))
    if counters.add("steps_with_decode_groups") == 1:
        g = plan.groups[0]
        logger.info(
            "MLA shared-prefix decode (mla-prefill-ext): the first step with a shared prefix among its "
            "decode rows: %d group(s), the first of %d tokens shared by %d requests.",
            len(plan.groups),
            g.block_ids.shape[0] * plan.block_size,
            g.members.shape[0],
        )


_RUNNER_DECISION = "_mla_shared_decode"


def served_step(runner: Any, batch_state: Any) -> bool:
    """V2 runner, before it picks the step's CUDA graph: whether the step's decode rows (one new token each)
    hold a group worth a shared call, from the block rows the mirror holds (each row's last block left out:
    only full blocks are shared). Such a step is dispatched as a mixed batch, whose graphs are piecewise
    (its attention runs outside them, where it is served) instead of the full decode graph."""
    decision = runner.__dict__.get(_RUNNER_DECISION)
    if decision is None:
        decision = runner.__dict__[_RUNNER_DECISION] = (
            switch.decide(runner.vllm_config).on and decide(runner.vllm_config) is None
        )
    if not decision or batch_state is None:
        return False
    found = block_tables.mirrored_rows(runner.block_tables, batch_state.idx_mapping_np)
    if found is None:
        return False
    rows, counts = found
    block_size = runner.cache_config.block_size
    ones = np.ones(len(counts), dtype=np.int64)
    seq_lens = np.maximum(counts.astype(np.int64) - 1, 0) * block_size + 1
    return plan_decode(rows, seq_lens, ones, block_size, costs.DECODE_VALUE) is not None


def uniform_unless_served(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    """V2 ``GPUModelRunner.gather_batch_req_state(scheduler_output, dummy_run)``: vLLM's result, with no
    uniform decode token count for a one-token decode step that :func:`served_step` serves (so vLLM
    dispatches it to its piecewise graphs); any fault here leaves vLLM's result as it was (logged once)."""
    batch_state, uniform = wrapped(*args, **kwargs)
    if uniform != 1:
        return batch_state, uniform
    try:
        served = served_step(instance, batch_state)
    except Exception:
        served = False
        if first_time("shared-decode-dispatch-failed"):
            logger.exception("mla-prefill-ext: the shared-prefix decode's graph choice failed; vLLM's stands")
    if not served:
        return batch_state, uniform
    counters.add("steps_dispatched_piecewise")
    return batch_state, None


def _arg(args: Any, kwargs: Any, name: str, index: int) -> Any:
    return kwargs[name] if name in kwargs else args[index]


def forward_mqa(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    """``FlashAttnMLAImpl.forward_mqa(q, kv_c_and_k_pe_cache, attn_metadata, layer)``."""
    attn_metadata = _arg(args, kwargs, "attn_metadata", 2)
    decode = getattr(attn_metadata, "decode", None)
    plan = getattr(decode, DECODE_ATTR, None)
    if plan is None or getattr(instance, "need_to_return_lse_for_decode", False) or _capturing():
        return wrapped(*args, **kwargs)
    import torch

    q = _arg(args, kwargs, "q", 0)
    if isinstance(q, tuple):
        q_nope, q_pe = q
    else:
        q_nope, q_pe = torch.split(q, [instance.kv_lora_rank, instance.qk_rope_head_dim], dim=-1)
    merge = sys.modules[MLA_MODULE].merge_attn_states  # the binding vLLM's own context loop calls
    kernel = sys.modules[needs.FA_MLA_MODULE].flash_attn_varlen_func  # the decode backend's own binding
    out, _ = decode_attention(
        q_pe,
        q_nope,
        plan,
        decode.query_start_loc,
        max(decode.max_query_len, 1),
        fa3_attend(
            kernel, _arg(args, kwargs, "kv_c_and_k_pe_cache", 1), instance.kv_lora_rank, instance.scale
        ),
        lambda *states: vllm_merge(*states, kernel=merge),
    )
    return out, None
