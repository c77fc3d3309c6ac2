"""vLLM's MLA layer and metadata builder, built for real and run on a CPU (either host).

Shared by the layer tests of both hosts (tests/hosts/vllm_0_20/test_layer.py and
tests/hosts/vllm_0_23/test_bridge.py) and the per-builder tests (test_deployment, test_warmup):
a layer and its builder under a real VllmConfig, the CUDA-only kernels of the context path done
in torch, seeded requests with their float64 reference, and a spy on a backend's methods.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch

from mla_prefill_ext.testing import vllm_host as host
from mla_prefill_ext.testing.reference import reference_attention

# The context branch's KV cache and workspace (tests/hosts/vllm_0_20/test_layer.py's two steps).
BLOCK_SIZE = 16  # host.make_vllm_config's CacheConfig
BLOCKS = [[5, 2, 7], [0, 6], [3]]  # physical KV-cache blocks of A, B, C, deliberately out of order
NUM_BLOCKS = 8
# The builder's chunked-context workspace lowered (as the GPU suite's --context-chunk-tokens
# does) to 32 tokens: 16 per request with context, so A's 37 cached tokens take 3 chunks.
CHUNK_WORKSPACE = 32
TOLERANCE = 2.0**-7  # of the largest |reference| value: bf16 rounding with 4x margin


MLA_MODULE = "vllm.model_executor.layers.attention.mla_attention"


def activate_on_this_vllm(monkeypatch: Any) -> Any:
    """The add-on active on this vLLM's host with TORCH_SDPA, vLLM's MLA module loaded (what wraps it
    then has wrapped it): a layer is then buildable on a CPU on every vLLM of the matrix (on 0.23+ stock
    vLLM's own prefill pick imports FA utilities a CPU wheel lacks). Returns the MLA module."""
    import importlib

    import pytest

    import mla_prefill_ext
    from mla_prefill_ext import versions

    decision = versions.decide()
    if decision.mode == versions.NONE:
        pytest.skip(f"vLLM {decision.vllm_version} has no host")
    mla_prefill_ext.activate()
    if decision.mode == versions.BRIDGE:
        from mla_prefill_ext.hosts import vllm_0_23

        importlib.import_module(vllm_0_23.PREFILL_PACKAGE)
    module = importlib.import_module(MLA_MODULE)
    monkeypatch.setenv("MLA_PREFILL_BACKEND", "TORCH_SDPA")
    return module


def build_layer(
    cfg: Any, capability: tuple[int, int] | None, prefix: str = "model.layers.0.self_attn"
) -> Any:
    with host.gpu_view(capability):
        return host.mla_layer(host.build_deepseek_attention(cfg, prefix=prefix))


def make_builder(cfg: Any, layers: list[Any], capability: tuple[int, int] | None) -> Any:
    from vllm.config import set_current_vllm_config

    builder_cls = layers[0].attn_backend.get_builder_cls()
    with host.gpu_view(capability), set_current_vllm_config(cfg):
        return builder_cls(
            layers[0].get_kv_cache_spec(cfg), [layer.layer_name for layer in layers], cfg, torch.device("cpu")
        )


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


@contextlib.contextmanager
def cpu_step_kernels(mla_module: Any) -> Iterator[None]:
    """cpu_kernels (the context gather and merge in torch), and unpinned host tensors.

    Pinning needs a CUDA driver: vLLM 0.25's builder pins ``torch.empty`` host tensors (as
    ``torch.zeros``, which cpu_kernels already covers), and 0.29+ builds its chunk metadata
    with ``pin_memory=PIN_MEMORY``, a constant read from the platform at import (True here).
    """
    from vllm.utils import torch_utils

    empty = torch.empty

    def empty_unpinned(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        return empty(*args, **kwargs)

    with contextlib.ExitStack() as stack:
        stack.enter_context(cpu_kernels(mla_module))
        stack.enter_context(mock.patch.object(torch, "empty", empty_unpinned))
        for module in (mla_module, torch_utils):
            if hasattr(module, "PIN_MEMORY"):
                stack.enter_context(mock.patch.object(module, "PIN_MEMORY", False))
        yield


def cpu_flash_attn_varlen_func(**kw: Any) -> Any:
    """vLLM's FA3 paged call as FLASH_ATTN_MLA's decode makes it (``q`` = rope part, ``q_v`` = latent part,
    ``k``/``v`` = the cache's rope and latent views), in float64 torch (FA3 needs a Hopper GPU)."""
    from mla_prefill_ext.testing.reference import paged_latent_attention

    cache = torch.cat([kw["v"].squeeze(-2), kw["k"].squeeze(-2)], dim=-1)
    attend = paged_latent_attention(cache, kw["softmax_scale"])
    out, lse = attend(
        kw["q"], kw["q_v"], kw["block_table"], kw["seqused_k"], kw["cu_seqlens_q"], kw["max_seqlen_q"],
        kw["max_seqlen_k"], kw["causal"],
    )  # fmt: skip
    return (out, lse) if kw.get("return_softmax_lse") else out
