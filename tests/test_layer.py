"""The patched vLLM MLA layer, built for real on CPU under a real VllmConfig."""

from __future__ import annotations

import math
from typing import Any
from unittest import mock

import host
import pytest
import torch

from mla_prefill_ext.reference import reference_attention


def build(cfg: Any, capability: tuple[int, int] | None, prefix: str = "model.layers.0.self_attn") -> Any:
    with host.gpu_view(capability):
        return host.mla_layer(host.build_deepseek_attention(cfg, prefix=prefix))


def test_layer_owns_backend_with_its_own_scale(shim, clean_selection, model_dirs):
    from mla_prefill_ext.backends.flash_attn import FlashAttnPrefillBackend

    layer = build(host.make_vllm_config(model_dirs["plain"]), (9, 0))
    assert isinstance(layer.prefill_backend, FlashAttnPrefillBackend)
    assert layer.prefill_backend.scale == layer.scale == pytest.approx(192**-0.5)
    b = layer.prefill_backend
    assert (b.num_heads, b.qk_nope_head_dim, b.qk_rope_head_dim, b.v_head_dim, b.kv_lora_rank) == (
        4,
        128,
        64,
        128,
        512,
    )
    assert layer.impl.prefill_backend is layer.prefill_backend
    assert layer.impl._pad_v is False  # backends return unpadded outputs


def test_yarn_mscale_is_in_the_backend_scale(shim, clean_selection, model_dirs):
    from vllm.model_executor.models.deepseek_v2 import yarn_get_mscale

    layer = build(host.make_vllm_config(model_dirs["yarn"]), (9, 0))
    rs = host.YARN_ROPE_SCALING
    mscale = yarn_get_mscale(rs["factor"], rs["mscale_all_dim"])
    expected = 192**-0.5 * mscale * mscale
    assert mscale > 1.0
    assert layer.scale == pytest.approx(expected)
    assert layer.prefill_backend.scale == layer.scale
    assert not math.isclose(layer.prefill_backend.scale, 192**-0.5)


def test_explicit_invalid_choice_fails_at_layer_build(shim, clean_selection, model_dirs):
    clean_selection.setenv("MLA_PREFILL_BACKEND", "FLASHINFER")
    with pytest.raises(ValueError, match=r"FLASHINFER \(from MLA_PREFILL_BACKEND\).*R1"):
        build(host.make_vllm_config(model_dirs["non_r1"]), (9, 0))


def test_flashinfer_hyperparameters_resolve_lazily(shim, clean_selection, model_dirs):
    from mla_prefill_ext.backends.flashinfer import FlashInferPrefillBackend, GlobalHyperparameters

    clean_selection.setenv("MLA_PREFILL_BACKEND", "FLASHINFER")
    cfg = host.make_vllm_config(model_dirs["plain"])
    first = build(cfg, (9, 0), "model.layers.0.self_attn")
    # Built before the second layer exists: nothing may be resolved yet.
    assert isinstance(first.prefill_backend, FlashInferPrefillBackend)
    assert first.prefill_backend._global_hyperparameters is None
    second = build(cfg, (9, 0), "model.layers.1.self_attn")
    assert first.prefill_backend.kernel_backend == "fa3"
    assert first.prefill_backend._shared is second.prefill_backend._shared  # one plan per step

    hp = first.prefill_backend._resolve_global_hyperparameters()
    assert hp == GlobalHyperparameters(first.scale, -1, 0.0)
    # Cached: a later change to the context does not re-resolve.
    second.scale = 0.5
    assert first.prefill_backend._resolve_global_hyperparameters() is hp
    # A fresh backend sees the disagreement and names both layers.
    with pytest.raises(
        ValueError, match=r"disagree.*model\.layers\.0\.self_attn.*model\.layers\.1\.self_attn"
    ):
        second.prefill_backend._global_hyperparameters = None
        second.prefill_backend.prepare_metadata(object())


def test_builder_holds_no_prefill_state_of_its_own(shim, clean_selection, model_dirs):
    clean_selection.setenv("MLA_PREFILL_BACKEND", "FLASHINFER")
    cfg = host.make_vllm_config(model_dirs["plain"])
    layer = build(cfg, (10, 0))
    builder = make_builder(cfg, layer, (10, 0))
    assert builder._use_fi_prefill is False and builder._use_cudnn_prefill is False
    for attr in ("_fi_prefill_main", "_global_hyperparameters", "cudnn_workspace", "_workspace_buffer"):
        assert not hasattr(builder, attr), attr
    assert builder._mla_prefill_layer_names == [layer.layer_name]


def make_builder(cfg: Any, layer: Any, capability: tuple[int, int] | None) -> Any:
    from vllm.config import set_current_vllm_config

    builder_cls = layer.attn_backend.get_builder_cls()
    with host.gpu_view(capability), set_current_vllm_config(cfg):
        return builder_cls(layer.get_kv_cache_spec(cfg), [layer.layer_name], cfg, torch.device("cpu"))


def prefill_batch(new_lens: list[int]) -> Any:
    from vllm.v1.attention.backend import CommonAttentionMetadata

    loc = torch.tensor([0, *torch.tensor(new_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(new_lens, dtype=torch.int32)
    total = int(loc[-1])
    return CommonAttentionMetadata(
        query_start_loc=loc,
        query_start_loc_cpu=loc.clone(),
        seq_lens=seq_lens,
        num_reqs=len(new_lens),
        num_actual_tokens=total,
        max_query_len=max(new_lens),
        max_seq_len=max(new_lens),
        block_table_tensor=torch.zeros(len(new_lens), 8, dtype=torch.int32),
        slot_mapping=torch.arange(total, dtype=torch.int64),
        seq_lens_cpu_upper_bound=seq_lens.clone(),
    )


def test_forward_mha_runs_through_the_layer_backend(shim, clean_selection, model_dirs):
    """vLLM's own builder.build() and impl.forward_mha() on CPU tensors, via TORCH_SDPA."""
    from vllm.config import set_current_vllm_config

    from mla_prefill_ext.backends.torch_sdpa import TorchSDPAPrefillBackend

    cfg = host.make_vllm_config(model_dirs["yarn"])
    layer = build(cfg, None)  # a CPU: the portable backend
    backend = layer.prefill_backend
    assert isinstance(backend, TorchSDPAPrefillBackend)
    builder = make_builder(cfg, layer, None)

    new_lens = [5, 11, 3]
    with host.gpu_view(None), set_current_vllm_config(cfg):
        metadata = builder.build(0, prefill_batch(new_lens))
    assert metadata.num_prefills == 3 and metadata.prefill is not None
    assert backend._prefill_metadata is metadata.prefill  # handed over by the builder

    gen = torch.Generator().manual_seed(0)
    heads, tokens = layer.num_heads, sum(new_lens)
    dtype = torch.bfloat16
    layer.kv_b_proj.weight.data = (torch.randn(layer.kv_b_proj.weight.shape, generator=gen) * 0.05).to(dtype)
    q = torch.randn(tokens, heads, 192, generator=gen).to(dtype)
    kv_c = torch.randn(tokens, 512, generator=gen).to(dtype)
    k_pe = torch.randn(tokens, 1, 64, generator=gen).to(dtype)
    output = torch.full((tokens, heads * 128), float("nan"), dtype=dtype)

    impl = layer.impl
    impl.dcp_world_size = 1  # what MLAAttention.forward_impl sets before calling forward_mha
    impl.scale = float("nan")  # no prefill path may read the impl's own scale
    with mock.patch.object(backend, "run_prefill_new_tokens", wraps=backend.run_prefill_new_tokens) as spy:
        impl.forward_mha(q, kv_c, k_pe, torch.empty(0), metadata, None, output=output)
    assert spy.call_count == 1

    kv = (kv_c.double() @ layer.kv_b_proj.weight.double().T).view(tokens, heads, 256)
    k = torch.cat([kv[..., :128], k_pe.double().expand(tokens, heads, 64)], dim=-1)
    v = kv[..., 128:]
    ref, start = [], 0
    for n in new_lens:
        sl = slice(start, start + n)
        ref.append(reference_attention(q[sl].double(), k[sl], v[sl], layer.scale, causal=True)[0])
        start += n
    expected = torch.cat(ref).reshape(tokens, heads * 128)
    err = (output.double() - expected).abs().max().item()
    assert torch.isfinite(output).all()
    assert err <= 2.0**-7 * expected.abs().max().item(), err


def test_context_chunk_hook_calls_the_layer_backend(shim, clean_selection, model_dirs):
    """_compute_prefill_context gathers the KV cache with a CUDA kernel; its per-chunk hook is ours."""
    from mla_prefill_ext.problem import make_problem

    cfg = host.make_vllm_config(model_dirs["plain"])
    layer = build(cfg, None)
    p = make_problem([4, 6], [9, 0], num_chunks=2, num_heads=layer.num_heads, dtype=torch.float32)
    layer.impl.scale = float("nan")
    out, lse = layer.impl._run_prefill_context_chunk(
        prefill=p.metadata, chunk_idx=0, q=p.q, k=p.chunk_k[0], v=p.chunk_v[0]
    )
    assert layer.prefill_backend._prefill_metadata is p.metadata
    assert out.shape == (10, layer.num_heads, 128) and lse.shape == (layer.num_heads, 10)
    expected, expected_lse = reference_attention(
        p.q[:4], p.chunk_k[0][:5], p.chunk_v[0][:5], layer.scale, False
    )
    assert torch.allclose(out[:4].double(), expected, atol=1e-5)
    assert torch.allclose(lse[:, :4].double(), expected_lse, atol=1e-5)
    assert torch.isneginf(lse[:, 4:]).all()  # the second request has no context


def test_additional_config_choice_is_refused_when_the_patch_cannot_land(shim, clean_selection, model_dirs):
    """A patch target missing: vLLM stays stock, but an explicit additional_config choice fails."""
    import mla_prefill_ext
    from mla_prefill_ext import patches

    mla_prefill_ext.deactivate()
    saved = shim.use_cudnn_prefill
    del shim.use_cudnn_prefill  # a vLLM that changed under us
    try:
        mla_prefill_ext.activate()
        assert not patches.is_instrumented()
        explicit = host.make_vllm_config(
            model_dirs["plain"], additional_config={"mla_prefill_backend": "TORCH_SDPA"}
        )
        with pytest.raises(
            RuntimeError, match=r"cannot honour additional_config\['mla_prefill_backend'\]=TORCH_SDPA"
        ):
            build(explicit, None)
        shim.use_cudnn_prefill = saved  # vLLM's own __init__ needs it to build a layer
        layer = build(host.make_vllm_config(model_dirs["plain"]), (9, 0))
        assert not hasattr(layer, "prefill_backend")  # stock
    finally:
        shim.use_cudnn_prefill = saved
        mla_prefill_ext.deactivate()
        mla_prefill_ext.activate()
        assert patches.is_instrumented()


def test_layer_builds_where_vllm_has_no_flash_attention(shim, clean_selection, model_dirs):
    """ROCm without flash-attn, or a CPU build: vLLM 0.20's impl refuses to build; the portable
    backend serves, and vLLM's module-level kernel reference is left as it was."""
    from mla_prefill_ext.backends.torch_sdpa import TorchSDPAPrefillBackend

    saved = shim.flash_attn_varlen_func
    shim.flash_attn_varlen_func = None
    try:
        layer = build(host.make_vllm_config(model_dirs["plain"]), None)
        assert isinstance(layer.prefill_backend, TorchSDPAPrefillBackend)
        assert shim.flash_attn_varlen_func is None
    finally:
        shim.flash_attn_varlen_func = saved
