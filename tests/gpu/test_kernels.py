"""Kernel numerics of every backend that runs on the GPU, against a float32 reference.

Run on a CUDA machine: ``python -m pytest tests/gpu -m gpu``. Skipped elsewhere.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mla_prefill_ext.backends.flash_attn import widened_v
from mla_prefill_ext.registry import MLAPrefillBackendEnum
from mla_prefill_ext.selector import MLAPrefillSelectorConfig, current_device_capability
from mla_prefill_ext.testing.problem import make_problem, run_backend
from mla_prefill_ext.testing.reference import reference_attention

pytestmark = pytest.mark.gpu

R1 = (128, 64, 128)  # DeepSeek-V3/R1: qk 128+64, v 128
NON_R1 = (64, 32, 64)  # a smaller MLA shape (qk 96, v 64)
WIDE = (192, 64, 256)  # a wider MLA shape: qk 192+64 = 256, v 256 (equal head dims)
# (dims, heads): R1 at 16 heads (e.g. TP 8), 64 (TP 2) and 128 (all of DeepSeek-V3's heads).
CASES = [(R1, 16), (R1, 64), (R1, 128), (NON_R1, 16), (NON_R1, 128), (WIDE, 16), (WIDE, 64), (WIDE, 128)]
CASE_IDS = [f"{'r1' if d == R1 else 'non-r1' if d == NON_R1 else 'wide'}-{h}h" for d, h in CASES]
# Backends that claim every MLA shape: a skip for them would hide a gap, so it fails instead.
ANY_DIMS = {"FLASH_ATTN", "TORCH_SDPA"}
SHAPES = {
    "single-long": ([4096], [0]),
    "many-short": ([97, 128, 1, 300, 64, 255, 17, 128] * 4, [0] * 32),
}
CONTEXT_SHAPES = {
    "single-long": ([1024], [6144]),
    "many-short": ([64, 1, 200, 33] * 4, [512, 0, 1000, 37] * 4),
}
SCALE = 0.1147  # DeepSeek-V2-Lite's YaRN-scaled softmax scale, rounded


def make_backend(name: str, heads: int, dims: tuple[int, int, int]):
    cls = MLAPrefillBackendEnum[name].get_class()
    config = MLAPrefillSelectorConfig.from_dims(torch.bfloat16, *dims)
    reasons = cls.validate_configuration(current_device_capability(), config)
    if reasons:
        message = f"{name} cannot serve {dims}: {'; '.join(reasons)}"
        if name in ANY_DIMS:
            pytest.fail(message)
        pytest.skip(message)
    return cls(heads, SCALE, 512, dims[0], dims[1], dims[2], None)


def tolerance(ref: torch.Tensor) -> float:
    # bf16 output rounding is half an ulp (2^-9 relative); allow 4x for accumulation order.
    return 2.0**-7 * ref.abs().max().item()


BACKENDS = ["FLASH_ATTN", "FLASHINFER", "TORCH_SDPA"]


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize(("dims", "heads"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("with_lse", [False, True], ids=["out", "out+lse"])
def test_new_tokens(name, dims, heads, shape, with_lse):
    new_lens, ctx = SHAPES[shape]
    backend = make_backend(name, heads, dims)
    p = make_problem(new_lens, ctx, 1, heads, *dims, device="cuda", seed=1)
    backend.prepare_metadata(p.metadata)
    ret = backend.run_prefill_new_tokens(p.q, p.k, p.v, with_lse)
    out, lse = ret if with_lse else (ret, None)
    assert not with_lse or isinstance(ret, tuple)
    assert out.shape == (p.q.shape[0], heads, dims[2]) and out.dtype == torch.bfloat16
    refs, ref_lses, start = [], [], 0
    for n in new_lens:
        sl = slice(start, start + n)
        r, rl = reference_attention(p.q[sl], p.k[sl], p.v[sl], SCALE, True, dtype=torch.float32)
        refs.append(r)
        ref_lses.append(rl)
        start += n
    ref = torch.cat(refs)
    err = (out.float() - ref).abs().max().item()
    assert err <= tolerance(ref), err
    if with_lse:
        ref_lse = torch.cat(ref_lses, dim=1)
        assert lse.shape == (heads, p.q.shape[0]) and lse.dtype == torch.float32
        assert lse.is_contiguous()
        # Natural log: a base-2 LSE would be off by a factor 1/ln 2 = 1.44.
        assert (lse - ref_lse).abs().max().item() <= 2e-3


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize(("dims", "heads"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize("shape", list(CONTEXT_SHAPES))
def test_context_chunks_merge_to_whole_sequence(name, dims, heads, shape):
    """New tokens + context chunks merged by vLLM's merge_attn_states == attention over all."""
    new_lens, ctx = CONTEXT_SHAPES[shape]
    backend = make_backend(name, heads, dims)
    p = make_problem(new_lens, ctx, 3, heads, *dims, device="cuda", seed=2)
    out = run_backend(backend, p)
    ref = p.reference(SCALE, dtype=torch.float32)
    assert torch.isfinite(out).all()
    err = (out.float() - ref).abs().max().item()
    assert err <= tolerance(ref), err


@pytest.mark.parametrize("name", sorted(ANY_DIMS))
@pytest.mark.parametrize("dims", [R1, NON_R1, WIDE], ids=["r1", "non-r1", "wide"])
def test_any_dims_backends_serve_every_mla_shape(name, dims):
    """FLASH_ATTN and TORCH_SDPA take every MLA shape here, without padding for equal dims."""
    backend = make_backend(name, 16, dims)  # fails (not skips) if it refuses
    if name == "FLASH_ATTN" and dims == WIDE:
        assert backend.requires_v_padding is False  # qk 256 == v 256: FA takes it as it is
    print(name, dims, getattr(backend, "fa_version", None), getattr(backend, "requires_v_padding", None))


def test_flash_attn_padded_v_paths_on_fa3():
    """The FA2 path run through FA3 kernels: V widened to the qk dim, output sliced back, dense.

    Both ways of widening: in place over vLLM's ``[k_nope | v]`` rows (NaN in front of V in
    the problem, so a leak would show) and a zero-padded copy where V is a dense tensor.
    """
    heads, dims = 16, R1
    padded = make_backend("FLASH_ATTN", heads, dims)
    native = make_backend("FLASH_ATTN", heads, dims)
    assert native.requires_v_padding is False  # FA3 on Hopper takes qk 192 / v 128
    padded.requires_v_padding = True
    p = make_problem([700, 300], [900, 0], 2, heads, *dims, device="cuda", seed=3)
    dense = dataclasses.replace(p, v=p.v.contiguous(), chunk_v=[c.contiguous() for c in p.chunk_v])
    pad = dims[0] + dims[1] - dims[2]
    assert widened_v(p.v, pad) is not None and widened_v(dense.v, pad) is None
    in_place, zero_padded, ref_kernel = (
        run_backend(padded, p),
        run_backend(padded, dense),
        run_backend(native, p),
    )
    ref = p.reference(SCALE, torch.float32)
    for out in (in_place, zero_padded):
        assert out.shape == ref_kernel.shape and out.is_contiguous() and torch.isfinite(out).all()
        assert (out.float() - ref).abs().max().item() <= tolerance(ref_kernel.float())
    torch.testing.assert_close(in_place, zero_padded, rtol=0, atol=0)  # same kernel, same math


def test_flashinfer_matches_flash_attn_bitwise_on_hopper():
    if current_device_capability() is None or current_device_capability().major != 9:
        pytest.skip("FlashInfer's fa3 kernels: Hopper only")
    fa, fi = make_backend("FLASH_ATTN", 16, R1), make_backend("FLASHINFER", 16, R1)
    p = make_problem([4096], [0], 1, 16, *R1, device="cuda", seed=4)
    fa.prepare_metadata(p.metadata)
    fi.prepare_metadata(p.metadata)
    a, la = fa.run_prefill_new_tokens(p.q, p.k, p.v, True)
    b, lb = fi.run_prefill_new_tokens(p.q, p.k, p.v, True)
    record = {
        "max_out_diff": (a.float() - b.float()).abs().max().item(),
        "max_lse_diff": (la - lb).abs().max().item(),
    }
    print("FA3 vs FlashInfer fa3:", record)
    assert record["max_lse_diff"] <= 1e-4  # same natural-log LSE after conversion
    assert record["max_out_diff"] <= tolerance(a.float())
