"""The patched vLLM MLA layer, built for real on CPU under a real VllmConfig."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from mla_layer_on_cpu import (
    CHUNK_WORKSPACE,
    TOLERANCE,
    SeededRequests,
    cpu_kernels,
    make_builder,
    recording,
)

from mla_prefill_ext.testing import vllm_host as host
from mla_prefill_ext.testing.reference import reference_attention

pytestmark = pytest.mark.vllm_patch  # the patch of vLLM 0.20 (skipped where the add-on bridges)


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
    # Equal parameters: the metadata builder prepares one instance for both (one plan per step).
    assert first.prefill_backend.step_key == second.prefill_backend.step_key

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


def test_flashinfer_reads_the_layers_through_the_reader_the_patch_hands_it(
    shim, clean_selection, model_dirs, monkeypatch
):
    """The layers' hyperparameters come from the patch (backends never import it): handed to the
    layer's backend when the layer builds it, passed on to the builder's instances by clone()."""
    from mla_prefill_ext.backends.flashinfer import FlashInferPrefillBackend, GlobalHyperparameters
    from mla_prefill_ext.mla_layers import mla_layer_hyperparameters

    clean_selection.setenv("MLA_PREFILL_BACKEND", "FLASHINFER")
    monkeypatch.setenv("VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE", str(1 << 16))
    cfg = host.make_vllm_config(model_dirs["plain"])
    layers = [build(cfg, (9, 0), f"model.layers.{i}.self_attn") for i in range(2)]
    assert all(
        layer.prefill_backend.read_layer_hyperparameters is mla_layer_hyperparameters for layer in layers
    )
    builder = make_builder(cfg, [layers[0]], (9, 0))
    (runner,) = builder._mla_prefill_runners.values()
    assert runner is not layers[0].prefill_backend
    assert runner.read_layer_hyperparameters is mla_layer_hyperparameters
    assert runner._global_hyperparameters is None  # still lazy: resolved at its first plan
    layers[1].scale = 0.5  # the builder's instance sees every layer of the model, not only its own
    with pytest.raises(
        ValueError, match=r"disagree.*model\.layers\.0\.self_attn.*model\.layers\.1\.self_attn"
    ):
        runner._resolve_global_hyperparameters()
    # Built on its own (no reader handed): its own values, whatever the context holds.
    with host.gpu_view((9, 0)):
        alone = FlashInferPrefillBackend(4, 0.25, 512, 128, 64, 128, cfg)
    assert alone.read_layer_hyperparameters is None
    assert alone._resolve_global_hyperparameters() == GlobalHyperparameters(0.25, -1, 0.0)


def test_builder_holds_no_prefill_state_of_its_own(shim, clean_selection, model_dirs):
    clean_selection.setenv("MLA_PREFILL_BACKEND", "FLASHINFER")
    cfg = host.make_vllm_config(model_dirs["plain"])
    layer = build(cfg, (10, 0))
    builder = make_builder(cfg, [layer], (10, 0))
    assert builder._use_fi_prefill is False and builder._use_cudnn_prefill is False
    for attr in ("_fi_prefill_main", "_global_hyperparameters", "cudnn_workspace", "_workspace_buffer"):
        assert not hasattr(builder, attr), attr
    assert builder._mla_prefill_layer_names == [layer.layer_name]


def test_vllms_inits_take_their_prefill_choice_through_the_wrapped_ones(shim, clean_selection, model_dirs):
    """The impl's and the builder's __init__ ask the three choice functions the patch wraps, by their
    names in vLLM's module, and get False: so neither builds FlashInfer, cuDNN or TRT-LLM prefill state
    (targets.py checks only their signatures)."""
    from mla_prefill_ext.hosts.vllm_0_20.targets import PREFILL_CHOICE_FUNCTIONS

    asked: list[tuple[str, bool]] = []

    def spy(name: str) -> Any:
        wrapper = getattr(shim, name)  # the patch's wrapper of vLLM's function

        def ask() -> bool:
            answer = wrapper()
            asked.append((name, answer))
            return answer

        return ask

    cfg = host.make_vllm_config(model_dirs["plain"])
    with contextlib.ExitStack() as stack:
        for name in PREFILL_CHOICE_FUNCTIONS:
            stack.enter_context(mock.patch.object(shim, name, spy(name)))
        layer = build(cfg, (10, 0))
        by_impl = set(asked)
        asked.clear()
        make_builder(cfg, [layer], (10, 0))
        by_builder = set(asked)
    expected = {(name, False) for name in PREFILL_CHOICE_FUNCTIONS}
    assert by_impl == expected and by_builder == expected


def test_forward_mha_runs_through_the_layer_backend(shim, clean_selection, model_dirs):
    """vLLM's own builder.build() and impl.forward_mha() on CPU tensors, via TORCH_SDPA."""
    from vllm.config import set_current_vllm_config

    from mla_prefill_ext.backends.torch_sdpa import TorchSDPAPrefillBackend

    cfg = host.make_vllm_config(model_dirs["yarn"])
    layer = build(cfg, None)  # a CPU: the portable backend
    backend = layer.prefill_backend
    assert isinstance(backend, TorchSDPAPrefillBackend)
    builder = make_builder(cfg, [layer], None)

    new_lens = [5, 11, 3]
    with recording(type(backend), "prepare_metadata") as prepared:
        with host.gpu_view(None), set_current_vllm_config(cfg):
            metadata = builder.build(0, host.prefill_batch(new_lens))
    assert metadata.num_prefills == 3 and metadata.prefill is not None
    assert prepared and all(args[0] is metadata.prefill for _, args, _ in prepared)  # by the builder

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
    with recording(type(backend), "run_prefill_new_tokens") as ran:
        impl.forward_mha(q, kv_c, k_pe, torch.empty(0), metadata, None, output=output)
    assert len(ran) == 1
    assert ran[0][0] in [inst for inst, _, _ in prepared]  # the instance the builder prepared

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


# The context branch, two steps: requests A and B prefill their first tokens (step 1);
# in step 2 they continue, their step-1 tokens now cached context, and request C starts.
STEP1_NEW = [37, 20]  # A, B
STEP2_NEW = [9, 5, 7]  # A, B, C
STEP2_CONTEXT = [37, 20, 0]


def two_steps_with_context(
    cfg: Any, layer: Any, chunk_workspace: int | None = CHUNK_WORKSPACE
) -> dict[str, Any]:
    """Steps 1 and 2 (see STEP1_NEW, STEP2_NEW) through vLLM's builder and ``forward_mha``.

    Returns each step's relative error against the float64 reference of attention over
    each request's whole sequence (cached context + new tokens), and what ran.
    ``chunk_workspace=None`` leaves the builder's chunked-context workspace as it is built.
    """
    import importlib

    from vllm.config import set_current_vllm_config

    from mla_prefill_ext.hosts import vllm_0_20 as patches

    mla_module = importlib.import_module(patches.MLA_MODULE)
    builder = make_builder(cfg, [layer], None)
    if chunk_workspace is not None:
        builder.chunked_prefill_workspace_size = chunk_workspace
    impl = layer.impl
    inputs = SeededRequests(layer, [c + n for c, n in zip(STEP2_CONTEXT, STEP2_NEW, strict=True)])
    impl.dcp_world_size = 1  # what MLAAttention.forward_impl sets before calling forward_mha
    impl.scale = float("nan")  # no prefill path may read the impl's own scale

    result: dict[str, Any] = {"errors": [], "chunks": None}
    steps = [(STEP1_NEW, [0, 0]), (STEP2_NEW, STEP2_CONTEXT)]
    for step, (new_lens, ctx_lens) in enumerate(steps):
        batch = inputs.batch(new_lens, ctx_lens)
        with cpu_kernels(mla_module), host.gpu_view(None), set_current_vllm_config(cfg):
            metadata = builder.build(0, batch)
        chunked = metadata.prefill.chunked_context
        if step == 1:
            assert chunked is not None
            result["chunks"] = len(chunked.seq_tot)
        else:
            assert chunked is None
        q, kv_c, k_pe, output, expected = inputs.step(new_lens, ctx_lens, batch.slot_mapping)
        with (
            cpu_kernels(mla_module),
            recording(type(layer.prefill_backend), "run_prefill_context_chunk") as ran,
        ):
            impl.forward_mha(q, kv_c, k_pe, inputs.cache, metadata, torch.ones(()), output=output)
        if step == 1:
            result["chunk_calls"] = len(ran)
        assert torch.isfinite(output).all(), f"step {step + 1}: non-finite output"
        result["errors"].append(((output.double() - expected).abs().max() / expected.abs().max()).item())
    return result


def test_forward_mha_with_context_chunks_matches_the_reference(shim, clean_selection, model_dirs):
    """Two steps through vLLM's real builder and ``forward_mha``; the second over cached context.

    The context branch (``_compute_prefill_context``) gathers each context chunk from the
    paged KV cache with a CUDA kernel and merges chunks with another: on the CPU both are
    replaced by torch versions of exactly those operations (:func:`cpu_kernels`). So vLLM's
    own chunking, gather addressing (block tables, chunk starts), ``kv_b_proj`` of the
    context and merge order run, with the add-on's backend (TORCH_SDPA here) computing each
    chunk, and the result is checked against float64 attention over context + new tokens.
    """
    from mla_prefill_ext.backends.torch_sdpa import TorchSDPAPrefillBackend

    cfg = host.make_vllm_config(model_dirs["yarn"])
    layer = build(cfg, None)
    assert type(layer.prefill_backend) is TorchSDPAPrefillBackend
    result = two_steps_with_context(cfg, layer)
    print("TORCH_SDPA, two steps with context:", result)
    assert result["chunks"] == 3 and result["chunk_calls"] == 3  # A's 37 tokens, 16 per chunk
    assert max(result["errors"]) <= TOLERANCE, result


@pytest.mark.parametrize("mutant", ["SdpaScaleOffBackend", "SdpaBase2LseBackend"])
def test_forward_mha_with_context_catches_a_wrong_backend(shim, clean_selection, model_dirs, mutant):
    """The check above fails a backend with the softmax scale 2% off or the LSE in base 2.

    The mutants (scripts/gpu_harness/doubles/mutant_backends.py, the GPU suite's mutation scenarios on the
    portable kernel) are registered as CUSTOM and selected as a user would.
    """
    from mla_prefill_ext import MLAPrefillBackendEnum, register_mla_prefill_backend

    clean_selection.syspath_prepend(str(Path(__file__).parents[3] / "scripts" / "gpu_harness" / "doubles"))
    register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, f"mutant_backends.{mutant}")
    clean_selection.setenv("MLA_PREFILL_BACKEND", "CUSTOM")
    cfg = host.make_vllm_config(model_dirs["yarn"])
    layer = build(cfg, None)
    assert type(layer.prefill_backend).__name__ == mutant
    result = two_steps_with_context(cfg, layer)
    print(f"{mutant}, two steps with context:", result)
    assert result["chunks"] == 3
    # The step with context fails the check above (measured: 0.017 for the scale, 0.12 for
    # the LSE base, against 0.004 for the correct backend and the bound 0.0078).
    assert result["errors"][1] > TOLERANCE, result


def test_context_chunk_hook_calls_the_layer_backend(shim, clean_selection, model_dirs):
    """_compute_prefill_context gathers the KV cache with a CUDA kernel; its per-chunk hook is ours."""
    from mla_prefill_ext.testing.problem import make_problem

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
    from mla_prefill_ext.hosts import vllm_0_20 as patches

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


def test_gpu_runner_context_chunk_wrapper_lowers_the_workspace_under_the_addon(
    shim, clean_selection, model_dirs, tmp_path
):
    """engine_runner.py --context-chunk-tokens: its wrapper on vLLM's builder, installed before
    the add-on activates (as in the runner, before LLM(...)), with the add-on's own wrappers
    on top: the add-on still patches, the builder chunks the context by the lowered size,
    and the evidence file records it (here from this process; on the GPU, the engine's)."""
    import mla_prefill_ext
    from mla_prefill_ext.hosts import vllm_0_20 as patches
    from scripts.gpu_harness import engine_runner

    evidence = tmp_path / "r.chunks"
    mla_prefill_ext.deactivate()
    installed = engine_runner.install_builder_wrappers(evidence, chunk_tokens=CHUNK_WORKSPACE)
    try:
        mla_prefill_ext.activate()
        assert patches.is_instrumented(), patches.state().skipped_reason
        cfg = host.make_vllm_config(model_dirs["yarn"])
        layer = build(cfg, None)
        result = two_steps_with_context(cfg, layer, chunk_workspace=None)
    finally:
        mla_prefill_ext.deactivate()
        engine_runner.uninstall(installed)
        mla_prefill_ext.activate()
    assert result["chunks"] == 3 and max(result["errors"]) <= TOLERANCE, result
    summary = engine_runner.chunk_evidence(evidence, CHUNK_WORKSPACE)
    assert summary["builder_inits"] == 1 and summary["stock_workspace_tokens"][0] > CHUNK_WORKSPACE
    assert summary["chunks_per_step"] == [3] and summary["max_chunk_tokens"] == 16
    assert summary["ran_in_engine_process"] is False  # in-process here: the runner would refuse it
