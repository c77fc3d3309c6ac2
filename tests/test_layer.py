"""The patched vLLM MLA layer, built for real on CPU under a real VllmConfig."""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

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
    builder = make_builder(cfg, layers[0], (9, 0))
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


@contextlib.contextmanager
def recording(cls: type, name: str) -> Iterator[list[tuple[Any, tuple, dict]]]:
    """Records ``(instance, args, kwargs)`` of every call of method ``name`` on any instance of ``cls``.

    Patched on the class, so it sees whichever instance runs (the layer's own backend
    or an instance the metadata builder prepared for the step).
    """
    calls: list[tuple[Any, tuple, dict]] = []
    original = getattr(cls, name)

    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append((self, args, kwargs))
        return original(self, *args, **kwargs)

    with mock.patch.object(cls, name, spy):
        yield calls


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
BLOCK_SIZE = 16  # host.make_vllm_config's CacheConfig
BLOCKS = [[5, 2, 7], [0, 6], [3]]  # physical KV-cache blocks of A, B, C, deliberately out of order
NUM_BLOCKS = 8
# The builder's chunked-context workspace lowered (as the GPU suite's --context-chunk-tokens
# does) to 32 tokens: 16 per request with context, so A's 37 cached tokens take 3 chunks.
CHUNK_WORKSPACE = 32
TOLERANCE = 2.0**-7  # of the largest |reference| value: bf16 rounding with 4x margin


def cpu_gather_and_maybe_dequant_cache(
    src_cache: torch.Tensor,
    dst: torch.Tensor,
    block_table: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    token_to_seq: torch.Tensor,
    num_tokens: Any,
    kv_cache_dtype: str,
    scale: Any,
    seq_starts: torch.Tensor | None = None,
) -> None:
    """vLLM's CUDA kernel ``gather_and_maybe_dequant_cache``, in torch, for the CPU tests.

    As the kernel: token ``i < num_tokens`` of the chunk belongs to request
    ``s = token_to_seq[i]``, at position ``seq_starts[s] + i - cu_seq_lens[s]`` of that
    request; it is read from the paged cache through the request's block-table row
    (``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``) into ``dst[i]``,
    scaled only for a quantized cache (not used here: ``"auto"``).
    """
    n = int(num_tokens)
    i = torch.arange(n)
    seq = token_to_seq[:n].long()
    pos = i - cu_seq_lens.long()[seq]
    if seq_starts is not None:
        pos = pos + seq_starts.long()[seq]
    block_size = src_cache.shape[1]
    rows = src_cache[block_table.long()[seq, pos // block_size], pos % block_size]
    if kv_cache_dtype != "auto":
        rows = rows.float() * scale
    dst[:n] = rows.to(dst.dtype)


def cpu_merge_attn_states(
    output: torch.Tensor,
    prefix_output: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_output: torch.Tensor,
    suffix_lse: torch.Tensor,
    output_lse: torch.Tensor | None = None,
    prefill_tokens_with_context: int | None = None,
    output_scale: torch.Tensor | None = None,
) -> None:
    """vLLM's ``merge_attn_states`` (CUDA or Triton kernels) with the same arguments, in torch.

    The merge rule is the add-on's reference one (``merge_attn_states_torch``); tokens from
    ``prefill_tokens_with_context`` on have no context and take the suffix as they are.
    """
    from mla_prefill_ext.testing.reference import merge_attn_states_torch

    assert output_scale is None
    n = output.shape[0] if prefill_tokens_with_context is None else int(prefill_tokens_with_context)
    merged, lse = merge_attn_states_torch(
        prefix_output[:n], prefix_lse[:, :n], suffix_output[:n], suffix_lse[:, :n]
    )
    output[:n] = merged.to(output.dtype)
    output[n:] = suffix_output[n:].to(output.dtype)
    if output_lse is not None:
        output_lse[:, :n] = lse
        output_lse[:, n:] = suffix_lse[:, n:]


@contextlib.contextmanager
def cpu_kernels(mla_module: Any) -> Iterator[None]:
    """The three CUDA-only pieces of the context path, done on the CPU (test-only).

    * ``ops.gather_and_maybe_dequant_cache`` (the paged-cache gather of each context
      chunk in ``_compute_prefill_context``): :func:`cpu_gather_and_maybe_dequant_cache`;
    * ``merge_attn_states`` (chunk-by-chunk and context-with-new-tokens merges):
      :func:`cpu_merge_attn_states`;
    * the builder's pinned host tensors (``torch.zeros(..., pin_memory=True)``), which
      need a CUDA driver: allocated unpinned.
    Everything else (the builder's chunking, ``forward_mha``, ``_compute_prefill_context``,
    ``kv_b_proj``, the add-on's hooks and backend) runs as it is.
    """
    zeros = torch.zeros

    def zeros_unpinned(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        return zeros(*args, **kwargs)

    with (
        mock.patch.object(
            mla_module.ops, "gather_and_maybe_dequant_cache", cpu_gather_and_maybe_dequant_cache
        ),
        mock.patch.object(mla_module, "merge_attn_states", cpu_merge_attn_states),
        mock.patch.object(torch, "zeros", zeros_unpinned),
    ):
        yield


class SeededRequests:
    """The inputs of the requests A, B, C (see STEP2_*) as forward_mha takes them, and their reference.

    Draws from one seeded generator, in this order: kv_b_proj's weights (set on the layer),
    then each request's latent KV, rope K and queries over its whole sequence (``totals``
    tokens). The paged cache (blocks BLOCKS of NUM_BLOCKS) starts all NaN, so a read of a
    slot no step wrote shows.
    """

    LORA, ROPE, NOPE, DV = 512, 64, 128, 128

    def __init__(self, layer: Any, totals: list[int], dtype: torch.dtype = torch.bfloat16) -> None:
        gen = torch.Generator().manual_seed(7)
        self.layer, self.dtype, self.heads = layer, dtype, layer.num_heads
        lora, rope, nope = self.LORA, self.ROPE, self.NOPE
        self.w = (torch.randn(layer.kv_b_proj.weight.shape, generator=gen) * 0.05).to(dtype)
        layer.kv_b_proj.weight.data = self.w
        self.kv_c = [torch.randn(t, lora, generator=gen).to(dtype) for t in totals]
        self.k_pe = [torch.randn(t, 1, rope, generator=gen).to(dtype) for t in totals]
        self.q = [torch.randn(t, self.heads, nope + rope, generator=gen).to(dtype) for t in totals]
        self.table = torch.zeros(len(BLOCKS), 4, dtype=torch.int32)
        for r, blocks in enumerate(BLOCKS):
            self.table[r, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        self.cache = torch.full((NUM_BLOCKS, BLOCK_SIZE, lora + rope), float("nan"), dtype=dtype)

    def batch(self, new_lens: list[int], ctx_lens: list[int]) -> Any:
        return host.prefill_batch(new_lens, ctx_lens, self.table[: len(new_lens)], BLOCK_SIZE)

    def step(
        self, new_lens: list[int], ctx_lens: list[int], slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, kv_c, k_pe of a step's new tokens, its NaN output buffer, and the float64 expectation.

        Writes the step's latent KV rows into the paged cache at ``slots`` first, as
        forward_impl does before forward_mha (vLLM's concat_and_cache_mla).
        """
        reqs = range(len(new_lens))
        sl = [slice(c, c + n) for c, n in zip(ctx_lens, new_lens, strict=True)]
        q = torch.cat([self.q[r][sl[r]] for r in reqs])
        kv_c = torch.cat([self.kv_c[r][sl[r]] for r in reqs])
        k_pe = torch.cat([self.k_pe[r][sl[r]] for r in reqs])
        self.cache.view(-1, self.LORA + self.ROPE)[slots] = torch.cat([kv_c, k_pe.squeeze(1)], dim=-1)
        output = torch.full((q.shape[0], self.heads * self.DV), float("nan"), dtype=self.dtype)
        expected = torch.cat([self.reference(r, sl[r].start, sl[r].stop) for r in reqs])
        return q, kv_c, k_pe, output, expected.reshape(q.shape[0], -1)

    def reference(self, r: int, start: int, end: int) -> torch.Tensor:
        """Request r's tokens start:end attending causally to its whole sequence so far, in float64.

        K and V as the layer computes them (kv_b_proj in the model dtype), then attention in float64.
        """
        heads, nope, rope = self.heads, self.NOPE, self.ROPE
        kv = torch.nn.functional.linear(self.kv_c[r][:end], self.w).double().view(end, heads, nope + self.DV)
        k = torch.cat([kv[..., :nope], self.k_pe[r][:end].double().expand(end, heads, rope)], dim=-1)
        out, _ = reference_attention(
            self.q[r][start:end].double(), k, kv[..., nope:], self.layer.scale, causal=True
        )
        return out


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

    from mla_prefill_ext import patches

    mla_module = importlib.import_module(patches.MLA_MODULE)
    builder = make_builder(cfg, layer, None)
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

    The mutants (tests/gpu/mutant_backends.py, the GPU suite's mutation scenarios on the
    portable kernel) are registered as CUSTOM and selected as a user would.
    """
    from mla_prefill_ext import MLAPrefillBackendEnum, register_mla_prefill_backend

    sys.path.insert(0, str(Path(__file__).parent / "gpu"))
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


def test_gpu_runner_context_chunk_wrapper_lowers_the_workspace_under_the_addon(
    shim, clean_selection, model_dirs, tmp_path
):
    """engine_runner.py --context-chunk-tokens: its wrapper on vLLM's builder, installed before
    the add-on activates (as in the runner, before LLM(...)), with the add-on's own wrappers
    on top: the add-on still patches, the builder chunks the context by the lowered size,
    and the evidence file records it (here from this process; on the GPU, the engine's)."""
    import importlib

    import wrapt

    import mla_prefill_ext
    from mla_prefill_ext import patches
    from scripts.gpu_harness import engine_runner

    mla_module = importlib.import_module(patches.MLA_MODULE)
    evidence = tmp_path / "r.chunks"
    mla_prefill_ext.deactivate()
    handles = engine_runner.install_context_chunk_wrapper(CHUNK_WORKSPACE, evidence)
    try:
        mla_prefill_ext.activate()
        assert patches.is_instrumented(), patches.state().skipped_reason
        cfg = host.make_vllm_config(model_dirs["yarn"])
        layer = build(cfg, None)
        result = two_steps_with_context(cfg, layer, chunk_workspace=None)
    finally:
        mla_prefill_ext.deactivate()
        for path, handle in reversed(handles):
            wrapt.unwrap_object(mla_module, path, handle)
        mla_prefill_ext.activate()
    assert result["chunks"] == 3 and max(result["errors"]) <= TOLERANCE, result
    summary = engine_runner.chunk_evidence(evidence, CHUNK_WORKSPACE)
    assert summary["builder_inits"] == 1 and summary["stock_workspace_tokens"][0] > CHUNK_WORKSPACE
    assert summary["chunks_per_step"] == [3] and summary["max_chunk_tokens"] == 16
    assert summary["ran_in_engine_process"] is False  # in-process here: the runner would refuse it
