"""Decode rows over a shared prefix inside vLLM's own FLASH_ATTN_MLA builder and ``forward_mqa``.

vLLM 0.20.2 (its FLASH_ATTN_MLA module imports on a CPU; the bridge's vLLMs need the FA3 extension to
import it): the real builder makes a decode step of six rows, four of them sharing three cached blocks,
from the V1 runner's real ``BlockTable``; the add-on plans one group and the wrapped ``forward_mqa`` serves
it. FA3's paged call and vLLM's merge run in float64 torch (``cpu_flash_attn_varlen_func``). The output
is checked against vLLM's own ``forward_mqa`` on the same step (the plan taken off), and a plan whose
prefix row names another page fails that check.
"""

from __future__ import annotations

import importlib
from unittest import mock

import numpy as np
import pytest
import torch
from mla_layer_on_cpu import activate_on_this_vllm, cpu_flash_attn_varlen_func, cpu_step_kernels, make_builder
from vllm_runner_objects import runner_block_table

from mla_prefill_ext.shared_prefix.decode import ANY_SHARED_BLOCK
from mla_prefill_ext.testing import vllm_host as host

FA_MLA = "vllm.v1.attention.backends.mla.flashattn_mla"
BS, LORA, ROPE = 16, 512, 64
ROWS = [[0, 1, 2, 3], [0, 1, 2, 4], [0, 1, 2, 5], [0, 1, 2, 6, 7], [8, 9], [10, 11, 12]]
SEQ_LENS = [50, 63, 49, 70, 20, 40]  # rows 0-3 hold 3 shared full blocks (48 tokens) before their own


@pytest.fixture
def fa_mla(clean_selection, tmp_path):
    """vLLM's FLASH_ATTN_MLA layer and builder on this vLLM, the add-on active, decode rows turned on."""
    try:
        module = importlib.import_module(FA_MLA)
    except ImportError as e:
        pytest.skip(f"vLLM's FLASH_ATTN_MLA module does not import on this CPU: {e}")
    clean_selection.setenv("MLA_PREFILL_SHARED_DECODE", "1")
    mla_module = activate_on_this_vllm(clean_selection)
    path = importlib.import_module("mla_prefill_ext.hosts.core.shared_prefix.instrumentor").INSTRUMENTOR
    if not path.is_instrumented():
        pytest.skip(f"the shared-prefix path is not available here: {path.state().skipped_reason}")
    path._instrument_decode("any", module)  # its post-import hook's work, had the variable been set at import
    from mla_prefill_ext.hosts.core.shared_prefix import costs, decode_rows

    assert decode_rows.WRAP_PROBLEMS["any"] is None
    clean_selection.setattr(costs, "DECODE_VALUE", ANY_SHARED_BLOCK)
    cfg = host.make_vllm_config(host.write_model_dir(tmp_path))
    with (
        host.gpu_view((9, 0)),
        mock.patch(
            "vllm.model_executor.layers.attention.mla_attention.get_attn_backend",
            lambda *a, **k: module.FlashAttnMLABackend,
        ),
        mock.patch.object(module, "flash_attn_supports_mla", lambda: True),
    ):
        layer = host.mla_layer(host.build_deepseek_attention(cfg))
    assert isinstance(layer.impl, module.FlashAttnMLAImpl)
    with mock.patch.object(module, "flash_attn_supports_mla", lambda: True):
        builder = make_builder(cfg, [layer], (9, 0))
    with mock.patch.object(module, "flash_attn_varlen_func", cpu_flash_attn_varlen_func):
        yield cfg, layer, builder, mla_module


def decode_step(cfg, layer, builder, mla_module):
    from vllm.config import set_current_vllm_config

    table, req_idx = runner_block_table(ROWS, BS, "V1")
    batch = host.prefill_batch([1] * len(ROWS), [n - 1 for n in SEQ_LENS], table, BS, req_idx=req_idx)
    with cpu_step_kernels(mla_module), host.gpu_view(None), set_current_vllm_config(cfg):
        metadata = builder.build(0, batch)
    gen = torch.Generator().manual_seed(3)
    heads = layer.impl.num_heads
    cache = (torch.randn(13, BS, LORA + ROPE, generator=gen) * 2).to(torch.bfloat16)
    q = ((torch.randn(len(ROWS), heads, LORA, generator=gen) * 2).to(torch.bfloat16),
         (torch.randn(len(ROWS), heads, ROPE, generator=gen) * 2).to(torch.bfloat16))  # fmt: skip
    return metadata, cache, q


def forward(layer, mla_module, metadata, cache, q):
    with cpu_step_kernels(mla_module):
        out, lse = layer.impl.forward_mqa(q, cache, metadata, layer)
    return out.double(), lse


def test_decode_rows_that_share_a_prefix_take_one_shared_call_with_vllms_answer(fa_mla):
    from mla_prefill_ext.hosts.core.shared_prefix.decode_rows import DECODE_ATTR

    cfg, layer, builder, mla_module = fa_mla
    metadata, cache, q = decode_step(cfg, layer, builder, mla_module)
    assert metadata.num_decodes == len(ROWS) and metadata.prefill is None
    plan = getattr(metadata.decode, DECODE_ATTR)
    assert [g.members.tolist() for g in plan.groups] == [[0, 1, 2, 3]] and plan.groups[0].num_tokens == 48
    calls = []

    def counted(**kw):
        calls.append(kw["causal"])
        return cpu_flash_attn_varlen_func(**kw)

    module = importlib.import_module(FA_MLA)
    with mock.patch.object(module, "flash_attn_varlen_func", counted):
        served, _ = forward(layer, mla_module, metadata, cache, q)
    assert calls == [True, False]  # every row's own pages, then the group's one shared call
    delattr(metadata.decode, DECODE_ATTR)
    stock, _ = forward(layer, mla_module, metadata, cache, q)
    assert np.isfinite(stock.numpy()).all()
    torch.testing.assert_close(served, stock, rtol=0, atol=2.0**-7 * stock.abs().max().item())


def test_a_plan_that_reads_another_page_fails_the_check(fa_mla):
    """The check above can fail: the group's third shared block read from another row's page."""
    from mla_prefill_ext.hosts.core.shared_prefix.decode_rows import DECODE_ATTR

    cfg, layer, builder, mla_module = fa_mla
    metadata, cache, q = decode_step(cfg, layer, builder, mla_module)
    getattr(metadata.decode, DECODE_ATTR).groups[0].prefix_row[0, 2] = 12
    served, _ = forward(layer, mla_module, metadata, cache, q)
    delattr(metadata.decode, DECODE_ATTR)
    stock, _ = forward(layer, mla_module, metadata, cache, q)
    assert (served[:4] - stock[:4]).abs().max() > 2.0**-7 * stock.abs().max()
    torch.testing.assert_close(served[4:], stock[4:], rtol=0, atol=2.0**-7 * stock.abs().max().item())


def test_decode_rows_stay_vllms_when_not_turned_on(fa_mla, monkeypatch):
    from mla_prefill_ext.hosts.core.shared_prefix import decode_rows

    monkeypatch.delenv("MLA_PREFILL_SHARED_DECODE")
    assert decode_rows.decide(fa_mla[0]) == "turned off by the default"
