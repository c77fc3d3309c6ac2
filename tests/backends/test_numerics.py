"""TORCH_SDPA against the float64 reference, and the LSE merge rule the layer relies on."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_prefill_ext.backends.torch_sdpa import TorchSDPAPrefillBackend
from mla_prefill_ext.testing.problem import PrefillProblem, deepseek_yarn_scale, make_problem, run_backend
from mla_prefill_ext.testing.reference import merge_attn_states_torch, reference_attention

R1_DIMS = (128, 64, 128)
SMALL_DIMS = (64, 32, 64)  # an MLA shape other than DeepSeek-R1's
KV_LORA_RANK = 512


pytestmark = pytest.mark.usefixtures("clean_selection")


def output_atol(dtype: torch.dtype, ref: torch.Tensor) -> float:
    """Absolute tolerance for an attention output, relative to the largest reference value.

    float32: the kernel accumulates in float32 (unit roundoff 6e-8); 1e-5 leaves room
    for the dot products over up to 192 dims and the float32 LSE merges.
    bfloat16: 8 significant bits, unit roundoff 2**-8 = 3.9e-3. The output is rounded
    to bf16 by the kernel and again by each merge (up to 3 chunks + new tokens: 4
    roundings), and the kernel may round the probabilities to bf16 before P @ V, so
    about 5 * 2**-8 = 2e-2 of the largest value bounds the error.
    """
    scale = max(1.0, ref.abs().max().item()) if dtype == torch.float32 else ref.abs().max().item()
    return (1e-5 if dtype == torch.float32 else 2e-2) * scale


def lse_atol(dtype: torch.dtype) -> float:
    # The LSE is accumulated in float32 from the inputs, which the float64 reference
    # sees exactly; for bf16 inputs allow for the kernel's blockwise rescaling. Either
    # way far below ln(2) - 1 = -0.31 relative, which a base-2 LSE would be off by.
    return 1e-5 if dtype == torch.float32 else 1e-3


def backend_for(problem: PrefillProblem, dims: tuple[int, int, int], scale: float) -> TorchSDPAPrefillBackend:
    return TorchSDPAPrefillBackend(problem.q.shape[1], scale, KV_LORA_RANK, *dims, None)


def default_scale(dims: tuple[int, int, int]) -> float:
    return (dims[0] + dims[1]) ** -0.5


@dataclass
class Case:
    new_lens: list[int]
    context_lens: list[int]
    num_chunks: int
    num_heads: int
    dtype: torch.dtype
    dims: tuple[int, int, int]
    seed: int

    def problem(self) -> PrefillProblem:
        nope, rope, v = self.dims
        return make_problem(
            self.new_lens,
            self.context_lens,
            num_chunks=self.num_chunks,
            num_heads=self.num_heads,
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope,
            v_head_dim=v,
            dtype=self.dtype,
            seed=self.seed,
        )


@st.composite
def cases(draw: st.DrawFn) -> Case:
    n = draw(st.integers(1, 4))
    return Case(
        new_lens=draw(st.lists(st.integers(1, 64), min_size=n, max_size=n)),
        context_lens=draw(st.lists(st.integers(0, 96), min_size=n, max_size=n)),
        num_chunks=draw(st.integers(1, 3)),
        num_heads=draw(st.integers(1, 4)),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
        dims=draw(st.sampled_from([R1_DIMS, SMALL_DIMS])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@given(case=cases())
@settings(max_examples=25, deadline=None)
def test_matches_float64_reference(case: Case) -> None:
    # New tokens causally, each context chunk, LSE merges: attention over whole sequences.
    problem = case.problem()
    scale = default_scale(case.dims)
    out = run_backend(backend_for(problem, case.dims, scale), problem)
    assert out.shape == (sum(case.new_lens), case.num_heads, case.dims[2])
    assert out.dtype == case.dtype
    ref = problem.reference(scale)
    torch.testing.assert_close(out.double(), ref, atol=output_atol(case.dtype, ref), rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dims", [R1_DIMS, SMALL_DIMS])
def test_new_tokens_lse(dtype: torch.dtype, dims: tuple[int, int, int]) -> None:
    new_lens = [7, 1, 30]
    nope, rope, v = dims
    problem = make_problem(
        new_lens, num_heads=3, qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v, dtype=dtype
    )
    backend = backend_for(problem, dims, default_scale(dims))
    backend.prepare_metadata(problem.metadata)
    out, lse = backend.run_prefill_new_tokens(problem.q, problem.k, problem.v, return_softmax_lse=True)
    assert lse.shape == (3, sum(new_lens))
    assert lse.dtype == torch.float32
    assert out.shape == (sum(new_lens), 3, v)

    start = 0
    for n in new_lens:
        sl = slice(start, start + n)
        ref_out, ref_lse = reference_attention(
            problem.q[sl], problem.k[sl], problem.v[sl], backend.scale, causal=True
        )
        # Natural log: the reference is torch.logsumexp in float64.
        torch.testing.assert_close(lse[:, sl].double(), ref_lse, atol=lse_atol(dtype), rtol=0)
        torch.testing.assert_close(out[sl].double(), ref_out, atol=output_atol(dtype, ref_out), rtol=0)
        start += n

    without = backend.run_prefill_new_tokens(problem.q, problem.k, problem.v, return_softmax_lse=False)
    assert isinstance(without, torch.Tensor)
    torch.testing.assert_close(without, out, atol=output_atol(dtype, out.double()), rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merged_context_chunks_equal_attention_over_the_context(dtype: torch.dtype) -> None:
    new_lens, context_lens = [5, 12, 3], [70, 0, 33]
    problem = make_problem(
        new_lens,
        context_lens,
        num_chunks=3,
        num_heads=2,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        dtype=dtype,
    )
    backend = backend_for(problem, SMALL_DIMS, 0.2)
    backend.prepare_metadata(problem.metadata)
    ctx_out = ctx_lse = None
    for i in range(3):
        out, lse = backend.run_prefill_context_chunk(i, problem.q, problem.chunk_k[i], problem.chunk_v[i])
        if ctx_out is None:
            ctx_out, ctx_lse = out, lse
        else:
            ctx_out, ctx_lse = merge_attn_states_torch(ctx_out, ctx_lse, out, lse)
    assert ctx_out is not None and ctx_lse is not None

    start = 0
    for n, c, fk, fv in zip(new_lens, context_lens, problem.full_k, problem.full_v, strict=True):
        sl = slice(start, start + n)
        start += n
        if c == 0:  # no keys anywhere: nothing to attend to
            assert torch.isneginf(ctx_lse[:, sl]).all()
            assert (ctx_out[sl] == 0).all()
            continue
        ref_out, ref_lse = reference_attention(problem.q[sl], fk[:c], fv[:c], 0.2, causal=False)
        torch.testing.assert_close(ctx_lse[:, sl].double(), ref_lse, atol=lse_atol(dtype), rtol=0)
        torch.testing.assert_close(ctx_out[sl].double(), ref_out, atol=output_atol(dtype, ref_out), rtol=0)


@pytest.mark.parametrize("split", [0, 1, 17, 40])
def test_merge_rule_of_two_key_sets(split: int) -> None:
    gen = torch.Generator().manual_seed(split)
    lq, lk, heads, d, dv = 9, 40, 3, 48, 32
    q = torch.randn(lq, heads, d, generator=gen, dtype=torch.float64)
    k = torch.randn(lk, heads, d, generator=gen, dtype=torch.float64)
    v = torch.randn(lk, heads, dv, generator=gen, dtype=torch.float64)
    scale = 0.3
    a_out, a_lse = reference_attention(q, k[:split], v[:split], scale, causal=False)
    b_out, b_lse = reference_attention(q, k[split:], v[split:], scale, causal=False)
    out, lse = merge_attn_states_torch(a_out, a_lse, b_out, b_lse)
    ref_out, ref_lse = reference_attention(q, k, v, scale, causal=False)
    # The merge weights are computed in float32.
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=0)
    # Symmetric in its two parts.
    out_ba, lse_ba = merge_attn_states_torch(b_out, b_lse, a_out, a_lse)
    torch.testing.assert_close(out_ba, ref_out, atol=1e-6, rtol=0)
    torch.testing.assert_close(lse_ba, lse, atol=1e-6, rtol=0)


def test_merge_of_two_empty_parts_keeps_the_prefix() -> None:
    prefix = torch.zeros(4, 2, 8)
    suffix = torch.ones(4, 2, 8)
    empty = torch.full((2, 4), float("-inf"))
    out, lse = merge_attn_states_torch(prefix, empty, suffix, empty)
    assert torch.equal(out, prefix)
    assert torch.isneginf(lse).all()


def test_request_without_context_in_a_chunk_gets_empty_attention() -> None:
    # ceil(40 / 2) = 20 tokens per chunk: request 0 has no context at all, request 2
    # only 5 tokens (all in chunk 0), request 1 has context in both chunks.
    new_lens, context_lens = [4, 6, 3], [0, 40, 5]
    problem = make_problem(
        new_lens,
        context_lens,
        num_chunks=2,
        num_heads=2,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        dtype=torch.float32,
    )
    backend = backend_for(problem, SMALL_DIMS, default_scale(SMALL_DIMS))
    backend.prepare_metadata(problem.metadata)
    out, lse = backend.run_prefill_context_chunk(1, problem.q, problem.chunk_k[1], problem.chunk_v[1])
    assert out.shape == (13, 2, 64)
    assert lse.shape == (2, 13)
    assert lse.dtype == torch.float32
    empty_rows = [*range(0, 4), *range(10, 13)]
    assert torch.isneginf(lse[:, empty_rows]).all()
    assert (out[empty_rows] == 0).all()

    rows = slice(4, 10)
    ref_out, ref_lse = reference_attention(
        problem.q[rows], problem.full_k[1][20:40], problem.full_v[1][20:40], backend.scale, causal=False
    )
    assert torch.isfinite(lse[:, rows]).all()
    torch.testing.assert_close(lse[:, rows].double(), ref_lse, atol=1e-5, rtol=0)
    torch.testing.assert_close(out[rows].double(), ref_out, atol=output_atol(torch.float32, ref_out), rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_scale_is_the_softmax_scale(dtype: torch.dtype) -> None:
    problem = make_problem([9, 21], [30, 0], num_chunks=2, num_heads=2, dtype=dtype)
    plain, yarn = default_scale(R1_DIMS), deepseek_yarn_scale()
    assert not math.isclose(plain, yarn)
    out_plain = run_backend(backend_for(problem, R1_DIMS, plain), problem)
    yarn_backend = backend_for(problem, R1_DIMS, yarn)
    assert yarn_backend.scale == yarn
    out_yarn = run_backend(yarn_backend, problem)

    ref_plain, ref_yarn = problem.reference(plain), problem.reference(yarn)
    atol = output_atol(dtype, ref_yarn)
    assert (ref_plain - ref_yarn).abs().max().item() > 10 * atol  # the scales are distinguishable
    torch.testing.assert_close(out_yarn.double(), ref_yarn, atol=atol, rtol=0)
    torch.testing.assert_close(out_plain.double(), ref_plain, atol=output_atol(dtype, ref_plain), rtol=0)
    assert (out_yarn.double() - ref_plain).abs().max().item() > atol


def test_fa3_head_dim_ranges() -> None:
    """FA3's own limits for unequal q/k and v head dims (measured on an H200: (96, 64) is refused)."""
    from mla_prefill_ext.backends.flash_attn import fa3_takes_head_dims

    assert fa3_takes_head_dims(192, 128)  # DeepSeek-V3/R1
    assert fa3_takes_head_dims(64, 512)
    assert fa3_takes_head_dims(96, 96)
    assert not fa3_takes_head_dims(96, 64)
    assert not fa3_takes_head_dims(256, 128)
    assert not fa3_takes_head_dims(192, 64)


def test_flashinfer_lse_conversion_is_natural_log_heads_first() -> None:
    from mla_prefill_ext.backends.flashinfer import FlashInferPrefillBackend

    natural = torch.randn(37, 5, dtype=torch.float32)  # [tokens, heads]
    base2 = natural / math.log(2.0)
    out = FlashInferPrefillBackend._natural_lse(base2)
    assert out.shape == (5, 37) and out.is_contiguous()
    torch.testing.assert_close(out, natural.T.contiguous())


def test_problem_hands_v_over_as_vllm_does() -> None:
    p = make_problem([5, 3], [4, 0], 2, 2, 8, 4, 6)
    for v in (p.v, *p.chunk_v):
        assert v.stride(-1) == 1 and v.stride(-2) == 8 + 6 and v.storage_offset() == 8
        assert torch.isfinite(v).all()
        lead = v.as_strided((*v.shape[:-1], 8), v.stride(), 0)  # the k_nope columns before V
        assert torch.isnan(lead).all()


def test_widened_v_reads_back_into_the_row_without_copying() -> None:
    from mla_prefill_ext.backends.flash_attn import widened_v

    rows = torch.arange(3 * 2 * 24, dtype=torch.bfloat16).view(3, 2, 24)
    v = rows[..., 16:]  # [k_nope(16) | v(8)]
    wide = widened_v(v, 8)
    assert wide is not None and wide.shape == (3, 2, 16)
    assert wide.data_ptr() == rows[..., 8:].data_ptr()  # a view, no copy
    torch.testing.assert_close(wide[..., 8:], v)
    torch.testing.assert_close(wide, rows[..., 8:])


@pytest.mark.parametrize(
    ("make_v", "pad", "why"),
    [
        (lambda: torch.zeros(3, 2, 8, dtype=torch.bfloat16), 4, "no storage before V"),
        (lambda: torch.zeros(3, 2, 16, dtype=torch.bfloat16)[..., 8:], 12, "fewer than pad elements before"),
        (lambda: torch.zeros(3, 2, 16, dtype=torch.bfloat16)[..., 8:], 3, "base pointer off 16 bytes"),
        (lambda: torch.zeros(3, 2, 19, dtype=torch.bfloat16)[..., 11:], 3, "row stride off 16 bytes"),
        (lambda: torch.zeros(3, 8, 2, dtype=torch.bfloat16).transpose(1, 2), 4, "last dim not dense"),
    ],
)
def test_widened_v_declines_what_fa_cannot_take(make_v, pad: int, why: str) -> None:
    from mla_prefill_ext.backends.flash_attn import widened_v

    assert widened_v(make_v(), pad) is None, why
