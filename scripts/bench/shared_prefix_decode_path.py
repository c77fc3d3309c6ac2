"""vLLM 0.20.2's decode (absorbed) path, FLASH_ATTN_MLA on Hopper, for the layer benchmark's requests:
the ``q_nope x W_UK_T`` absorption, ``forward_mqa``'s FA3 call over the paged latent cache, ``_v_up_proj``;
and the shared-prefix decode as the add-on serves it (its own code): the same absorption, one FA3 call of
every request's queries over the shared prefix's pages, one over each request's own pages, vLLM's LSE merge.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .shared_prefix_case import BLOCK_SIZE, R1_TP8


def absorbed_weights(w: Any) -> tuple[Any, Any]:
    """(``W_UK_T`` [H, 128, 512], ``W_UV`` [H, 512, 128]) from ``kv_b_proj``'s weight, as vLLM makes them.

    ``MLAAttention.process_weights_after_loading``: the weight transposed, viewed per head, split,
    permuted; views of the weight, with the strides vLLM's bmms see.
    """
    d = R1_TP8
    kv_b = w.T.view(d["kv_lora_rank"], d["num_heads"], d["qk_nope_head_dim"] + d["v_head_dim"])
    w_uk, w_uv = kv_b.split([d["qk_nope_head_dim"], d["v_head_dim"]], dim=-1)
    return w_uk.permute(1, 2, 0), w_uv.transpose(0, 1)


def v_up_proj(x: Any, w_uv: Any, out: Any) -> None:
    """``MLAAttention._v_up_proj`` (bf16 weights): [T, H, 512] x ``W_UV`` into ``out`` [T, H x 128]."""
    import torch

    d = R1_TP8
    heads, v_dim = d["num_heads"], d["v_head_dim"]
    x = x.view(-1, heads, d["kv_lora_rank"]).transpose(0, 1)
    out = out.view(-1, heads, v_dim).transpose(0, 1)
    torch.bmm(x, w_uv, out=out)
    out_new = out.transpose(0, 1).reshape(-1, heads * v_dim)
    n, b, v = out.shape
    out.resize_((b, n * v))
    out.copy_(out_new)


def decode_metadata(case: dict, device: Any, num_splits: int, schedule: Callable | None) -> dict:
    """What ``FlashAttnMLAMetadataBuilder._build_decode`` gives ``forward_mqa``, once per step.

    ``schedule``: vLLM's ``get_scheduler_metadata`` (FA3's ahead-of-time schedule, as
    ``_schedule_decode`` calls it), or None to leave scheduling to the kernel.
    """
    import torch

    d = R1_TP8
    loc = case["loc"]
    query_start_loc = loc.to(device)
    seq_lens = torch.tensor(case["seq_lens"], dtype=torch.int32, device=device)
    max_query_len = int((loc[1:] - loc[:-1]).max())
    max_seq_len = max(case["seq_lens"])
    scheduler_metadata = None
    if schedule is not None:
        shape = dict(num_heads_q=d["num_heads"], num_heads_kv=1, headdim=d["qk_rope_head_dim"])
        shape.update(headdim_v=d["kv_lora_rank"], page_size=BLOCK_SIZE, qkv_dtype=case["cache"].dtype)
        step = dict(batch_size=seq_lens.shape[0], max_seqlen_q=max_query_len, max_seqlen_k=max_seq_len)
        step.update(cache_seqlens=seq_lens, cu_seqlens_q=query_start_loc, causal=True, num_splits=num_splits)
        scheduler_metadata = schedule(**shape, **step)
    meta = dict(block_table=case["decode_table"].to(device), seq_lens=seq_lens, max_seq_len=max_seq_len)
    meta.update(query_start_loc=query_start_loc, max_query_len=max_query_len, max_num_splits=num_splits)
    return {**meta, "scheduler_metadata": scheduler_metadata}


def prepare_absorbed(
    case: dict,
    device: Any,
    num_splits: int = 0,
    attention: Callable | None = None,
    schedule: Callable | None = None,
) -> Callable[[], Any]:
    """vLLM's decode path for the case's requests on one layer: a callable returning [T, H x 128].

    Without ``attention``: vLLM's FA3 ``flash_attn_varlen_func`` and ``get_scheduler_metadata``
    (GPU); with it (a reference kernel on a CPU), ``schedule`` (None: no scheduler metadata).
    """
    import torch

    if attention is None:
        from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata

        attention, schedule = flash_attn_varlen_func, get_scheduler_metadata
    d = R1_TP8
    heads, nope, rope, rank = d["num_heads"], d["qk_nope_head_dim"], d["qk_rope_head_dim"], d["kv_lora_rank"]
    w_uk_t, w_uv = absorbed_weights(case["w"])
    meta = decode_metadata(case, device, num_splits, schedule)
    cache, q = case["cache"], case["q"]
    kv_c_cache, k_pe_cache = cache[..., :rank], cache[..., rank:]
    scale = (nope + rope) ** -0.5
    output = torch.empty(q.shape[0], heads * d["v_head_dim"], dtype=q.dtype, device=q.device)
    # FlashAttnMLAImpl.forward_mqa's arguments but the queries, the same for every call of the step.
    m = meta
    step = dict(k=k_pe_cache.unsqueeze(-2), v=kv_c_cache.unsqueeze(-2), block_table=m["block_table"])
    step.update(cu_seqlens_q=m["query_start_loc"], seqused_k=m["seq_lens"], max_seqlen_k=m["max_seq_len"])
    step.update(max_seqlen_q=max(m["max_query_len"], 1), softmax_scale=scale, causal=True, fa_version=3)
    step.update(scheduler_metadata=m["scheduler_metadata"], num_splits=m["max_num_splits"])
    step.update(return_softmax_lse=False, cp_world_size=1, cp_rank=0, cp_tot_seqused_k=None)

    def run() -> torch.Tensor:
        # MLAAttention.forward_impl, decode tokens (bf16 cache, no DCP)
        q_nope, q_pe = q.split([nope, rope], dim=-1)
        q_nope = q_nope.transpose(0, 1)
        ql_nope = q_nope.new_empty((heads, q.shape[0], rank))
        torch.bmm(q_nope, w_uk_t, out=ql_nope)
        ql_nope = ql_nope.transpose(0, 1)
        v_up_proj(attention(q=q_pe, q_v=ql_nope, **step), w_uv, output)  # FlashAttnMLAImpl.forward_mqa
        return output

    return run


def prepare_shared_absorbed(
    case: dict,
    device: Any,
    attention: Callable | None = None,
    merge: Callable | None = None,
    num_splits: int = 0,
) -> Callable[[], Any]:
    """The shared-prefix decode as the add-on serves it, for the case's requests on one layer: [T, H x 128].

    The path's own code (:mod:`mla_prefill_ext.shared_prefix.decode`): the step's plan over the decode
    block table (every group of rows sharing whole blocks: the crossover is what this measures), one
    non-causal call of all the group's queries over the prefix's pages, the step's causal call over each
    row's own pages, vLLM's ``merge_attn_states``; planned once (the path plans once a step, not a layer).
    ``attention``/``merge``: reference kernels on a CPU; ``num_splits``: FA3's split of the prefix call
    (0: its heuristic). One new token a request: the path serves nothing else.
    """
    import numpy as np
    import torch

    from mla_prefill_ext.shared_prefix.decode import (
        ANY_SHARED_BLOCK,
        decode_attention,
        fa3_attend,
        plan_decode,
    )
    from mla_prefill_ext.shared_prefix.execute import vllm_merge

    if attention is None:
        from vllm.v1.attention.ops.merge_attn_states import merge_attn_states as merge
        from vllm.vllm_flash_attn import flash_attn_varlen_func as attention
    d = R1_TP8
    heads, nope, rope, rank = d["num_heads"], d["qk_nope_head_dim"], d["qk_rope_head_dim"], d["kv_lora_rank"]
    w_uk_t, w_uv = absorbed_weights(case["w"])
    q, loc, table = case["q"], case["loc"], case["decode_table"]
    query_lens = (loc[1:] - loc[:-1]).numpy()
    plan = plan_decode(table.numpy(), np.asarray(case["seq_lens"]), query_lens, BLOCK_SIZE, ANY_SHARED_BLOCK)
    if plan is None:
        raise ValueError("shared_absorbed: the path serves steps of one new token a request sharing a prefix")
    seq_lens = torch.tensor(case["seq_lens"], dtype=torch.int32, device=device)
    on_device = plan.to(table.to(device), seq_lens)
    attend = fa3_attend(attention, case["cache"], rank, (nope + rope) ** -0.5, shared_splits=num_splits)
    loc = loc.to(device)
    output = torch.empty(q.shape[0], heads * d["v_head_dim"], dtype=q.dtype, device=q.device)

    def run() -> torch.Tensor:
        q_nope, q_pe = q.split([nope, rope], dim=-1)
        ql_nope = torch.bmm(q_nope.transpose(0, 1), w_uk_t).transpose(0, 1)
        latent, _ = decode_attention(
            q_pe, ql_nope, on_device, loc, 1, attend, lambda *states: vllm_merge(*states, kernel=merge)
        )
        v_up_proj(latent, w_uv, output)
        return output

    return run
