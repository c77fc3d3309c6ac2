"""TRTLLM_RAGGED without an SM100 GPU: its validation, and what it hands the kernel.

The backend calls FlashInfer's real ``trtllm_ragged_attention_deepseek``: its argument
checks, its output and LSE allocation and its call into the compiled op all run. Only the
compiled op (SM100 cubins) is replaced, by a stand-in that takes its arguments in the order
of the op's C++ declaration in FlashInfer's own source, checks them against the kernel's
contract and computes the attention from exactly those arguments. The values are checked
against a float64 attention written out in this module from each request's whole sequence,
not from what the kernel was handed: a wrong length, offset, flag, scale or LSE handling
shows up as a wrong result. What stays an assumption until an SM100 run: the compiled
kernel's LSE is the natural log, as vLLM 0.20 merges it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import flashinfer
import flashinfer.prefill
import pytest
import torch
from vllm.platforms.interface import DeviceCapability

from mla_prefill_ext.backends.base import context_chunks
from mla_prefill_ext.backends.trtllm_ragged import TrtllmRaggedPrefillBackend
from mla_prefill_ext.registry import MLAPrefillBackendEnum
from mla_prefill_ext.selector import MLAPrefillSelectorConfig
from mla_prefill_ext.testing.problem import PrefillProblem, deepseek_yarn_scale, make_problem, run_backend
from mla_prefill_ext.testing.reference import reference_attention

OP_SOURCE = Path(flashinfer.__file__).parent / "data" / "csrc" / "trtllm_fmha_kernel_launcher.cu"
SM_COUNT = 148  # an SM100's; the op stand-in only checks it is passed through
WORKSPACE_BYTES = 4096
NUM_HEADS = 4


@pytest.fixture(autouse=True)
def small_workspace(clean_selection: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch = clean_selection
    # A small workspace: the default is 394 MiB.
    monkeypatch.setenv("VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE", str(WORKSPACE_BYTES))
    yield


# Validation


def cap(major_minor: tuple[int, int] | None) -> DeviceCapability | None:
    return None if major_minor is None else DeviceCapability(*major_minor)


@pytest.mark.parametrize("capability", [(10, 0), (10, 3)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_valid_on_sm100_with_r1_dims(capability: tuple[int, int], dtype: torch.dtype) -> None:
    config = MLAPrefillSelectorConfig(dtype, True)
    assert TrtllmRaggedPrefillBackend.validate_configuration(cap(capability), config) == []


@pytest.mark.parametrize(
    ("capability", "dtype", "is_r1", "expected"),
    [
        ((9, 0), torch.bfloat16, True, ["compute capability 9.0 not supported"]),
        ((12, 0), torch.bfloat16, True, ["compute capability 12.0 not supported"]),
        ((8, 0), torch.float16, True, ["compute capability 8.0 not supported"]),
        (
            None,
            torch.bfloat16,
            True,
            ["needs a GPU (this is a CPU or a platform that reports no compute capability)"],
        ),
        ((10, 0), torch.float32, True, ["dtype float32 not supported (supports float16, bfloat16)"]),
        (
            (10, 0),
            torch.bfloat16,
            False,
            [
                "model does not have DeepSeek-R1 MLA dimensions "
                "(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)"
            ],
        ),
    ],
)
def test_invalid_configurations_give_reasons(
    capability: tuple[int, int] | None, dtype: torch.dtype, is_r1: bool, expected: list[str]
) -> None:
    config = MLAPrefillSelectorConfig(dtype, is_r1)
    assert TrtllmRaggedPrefillBackend.validate_configuration(cap(capability), config) == expected


def test_every_reason_is_listed() -> None:
    reasons = TrtllmRaggedPrefillBackend.validate_configuration(
        DeviceCapability(9, 0), MLAPrefillSelectorConfig(torch.float32, False)
    )
    assert len(reasons) == 3
    assert reasons[0] == "compute capability 9.0 not supported"
    assert reasons[1].startswith("dtype float32 not supported")
    assert reasons[2].startswith("model does not have DeepSeek-R1 MLA dimensions")


def test_unavailable_kernel_is_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    assert TrtllmRaggedPrefillBackend.is_available()
    monkeypatch.delattr(flashinfer.prefill, "trtllm_ragged_attention_deepseek")
    assert not TrtllmRaggedPrefillBackend.is_available()
    reasons = TrtllmRaggedPrefillBackend.validate_configuration(
        DeviceCapability(10, 0), MLAPrefillSelectorConfig(torch.bfloat16, True)
    )
    assert reasons == ["flashinfer.prefill.trtllm_ragged_attention_deepseek is not importable"]


def test_name_and_registry_entry() -> None:
    assert TrtllmRaggedPrefillBackend.get_name() == "TRTLLM_RAGGED"
    assert MLAPrefillBackendEnum.TRTLLM_RAGGED.get_class() is TrtllmRaggedPrefillBackend
    assert TrtllmRaggedPrefillBackend.requires_r1_mla_dimensions
    assert TrtllmRaggedPrefillBackend.supports_fp8_query


# Argument plumbing


def op_parameters() -> list[str]:
    """The parameter names of the compiled op ``trtllm_ragged_attention``, in its C++ declaration's order."""
    text = OP_SOURCE.read_text()
    (decl,) = re.findall(r"void trtllm_ragged_attention\((.*?)\)\s*\{", text, re.S)
    params, depth, current = [], 0, ""
    for ch in decl:  # split at top-level commas: Variant<double, ffi::Tensor> holds one
        depth += {"<": 1, ">": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            params.append(current)
            current = ""
        else:
            current += ch
    return [p.split()[-1] for p in [*params, current]]


@dataclass
class OpStandIn:
    """The compiled ``trtllm_ragged_attention`` op as its contract describes it, on CPU.

    Called by FlashInfer's real Python wrapper; writes ``out`` (and ``lse``) in place, as the op does.
    """

    backend: TrtllmRaggedPrefillBackend
    metadata: Any
    calls: list[dict[str, Any]] = field(default_factory=list)

    def __call__(self, *args: Any) -> None:
        names = op_parameters()
        assert len(args) == len(names), f"the wrapper passed {len(args)} arguments, the op declares {names}"
        a = dict(zip(names, args, strict=True))
        self.calls.append(a)
        q, k, v, out, lse = a["query"], a["key"], a["value"], a["out"], a["lse"]
        cum_q, cum_kv, seq_lens = a["cum_seq_lens_q"], a["cum_seq_lens_kv"], a["seq_lens"]
        q_lens = (cum_q[1:] - cum_q[:-1]).tolist()

        assert a["bmm1_scale"] == self.backend.scale
        assert (a["bmm2_scale"], a["o_sf_scale"], a["window_left"]) == (1.0, 1.0, -1)
        assert a["attention_sinks"] is None and a["skip_softmax_threshold_scale_factor"] is None
        assert a["sm_count"] == SM_COUNT and a["enable_pdl"] is False
        assert torch.equal(cum_q.cpu(), self.metadata.query_start_loc.cpu())
        assert a["batch_size"] == seq_lens.shape[0] == len(q_lens) == cum_kv.shape[0] - 1
        assert seq_lens.tolist() == (cum_kv[1:] - cum_kv[:-1]).tolist()
        assert a["max_q_len"] == max(q_lens)
        assert a["max_kv_len"] == max(seq_lens.tolist())
        assert q.shape[0] == cum_q[-1].item()
        assert k.shape[0] == v.shape[0] == cum_kv[-1].item()
        if a["is_causal"]:  # new tokens attend to themselves
            assert seq_lens.tolist() == q_lens
        ws = a["workspace_buffer"]
        assert ws.dtype == torch.uint8 and ws.numel() == WORKSPACE_BYTES and ws.device == q.device
        assert a["workspace_size"] == WORKSPACE_BYTES
        assert out.dtype == self.metadata.output_dtype
        assert lse is None or (lse.shape == (q.shape[0], q.shape[1]) and lse.dtype == torch.float32)

        for b, n_kv in enumerate(seq_lens.tolist()):
            qs, qe, ks = cum_q[b].item(), cum_q[b + 1].item(), cum_kv[b].item()
            if n_kv == 0:
                out[qs:qe] = 0
                if lse is not None:
                    lse[qs:qe] = float("-inf")
                continue
            o, l_ = reference_attention(
                q[qs:qe], k[ks : ks + n_kv], v[ks : ks + n_kv], a["bmm1_scale"], causal=a["is_causal"]
            )
            out[qs:qe] = o.to(out.dtype)
            if lse is not None:
                lse[qs:qe] = l_.transpose(0, 1).float()  # the layout the wrapper allocated: [tokens, heads]


def expected_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 attention of one request, written out here: out [Lq, H, Dv], natural-log LSE [H, Lq].

    Independent of the stand-in and of ``mla_prefill_ext.testing.reference``; causal masking
    is bottom-right aligned (the new tokens are the last ``Lq`` of the ``Lk`` keys).
    """
    logits = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    if causal:
        lq, lk = q.shape[0], k.shape[0]
        visible = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
        logits = logits.masked_fill(~visible, float("-inf"))
    peak = logits.amax(dim=-1, keepdim=True)
    weights = torch.exp(logits - peak)
    total = weights.sum(dim=-1, keepdim=True)
    out = torch.einsum("hqk,khd->qhd", weights / total, v.double())
    return out, (peak + total.log()).squeeze(-1)


def expected_step(problem: PrefillProblem, scale: float) -> torch.Tensor:
    """Each request's new tokens over its whole sequence (context and new tokens), from the problem."""
    outs, start = [], 0
    for i, n in enumerate(problem.new_lens):
        q = problem.q[start : start + n]
        outs.append(expected_attention(q, problem.full_k[i], problem.full_v[i], scale, causal=True)[0])
        start += n
    return torch.cat(outs)


def r1_problem(
    new_lens: list[int], context_lens: list[int] | None, num_chunks: int, dtype: torch.dtype
) -> PrefillProblem:
    return make_problem(new_lens, context_lens, num_chunks=num_chunks, num_heads=NUM_HEADS, dtype=dtype)


def install(monkeypatch: pytest.MonkeyPatch, problem: PrefillProblem, scale: float) -> OpStandIn:
    """A backend whose calls reach FlashInfer's real wrapper, and the stand-in of the compiled op under it."""
    backend = TrtllmRaggedPrefillBackend(NUM_HEADS, scale, 512, 128, 64, 128, None)
    kernel = OpStandIn(backend, problem.metadata)
    # The compiled module (SM100 cubins) and the SM count of the device: the two things a CPU lacks.
    module = SimpleNamespace(trtllm_ragged_attention=kernel)
    monkeypatch.setattr(flashinfer.prefill, "get_trtllm_gen_fmha_module", lambda: module)
    monkeypatch.setattr(flashinfer.prefill, "get_device_sm_count", lambda device: SM_COUNT)
    return kernel


def output_atol(dtype: torch.dtype, ref: torch.Tensor) -> float:
    # 16-bit outputs (fp16: 11 significant bits, bf16: 8) rounded by the stand-in and by
    # each LSE merge: 2e-2 of the largest value bounds bf16's up to 5 roundings of 2**-8.
    return 2e-2 * ref.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_run_backend_with_context_chunks_matches_reference(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    # Request 1 has no context; with 3 chunks of 24, request 2 has none in chunks 1 and 2.
    problem = r1_problem([5, 17, 1, 9], [33, 0, 12, 70], num_chunks=3, dtype=dtype)
    scale = deepseek_yarn_scale()
    kernel = install(monkeypatch, problem, scale)
    out = run_backend(kernel.backend, problem)

    assert [(c["is_causal"], c["lse"] is not None) for c in kernel.calls] == [(True, True)] + [
        (False, True)
    ] * 3
    chunks = context_chunks(problem.metadata)  # vLLM 0.29+ problems carry only this view
    for i, call in enumerate(kernel.calls[1:]):
        assert call["seq_lens"].tolist() == chunks[i].seq_lens.tolist()
        assert call["max_kv_len"] == chunks[i].max_seq_len
        assert torch.equal(call["cum_seq_lens_kv"], chunks[i].cu_seq_lens)
        assert call["key"] is problem.chunk_k[i]
    assert kernel.calls[0]["key"] is problem.k

    assert out.shape == (32, NUM_HEADS, 128)
    assert out.dtype == dtype
    ref = expected_step(problem, scale)
    torch.testing.assert_close(out.double(), ref, atol=output_atol(dtype, ref), rtol=0)
    # The scale matters: the expected values at the plain scale are far off.
    assert (out.double() - expected_step(problem, 192**-0.5)).abs().max().item() > output_atol(dtype, ref)


def test_new_tokens_without_context_return_a_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    problem = r1_problem([3, 11, 6], None, num_chunks=2, dtype=torch.bfloat16)
    kernel = install(monkeypatch, problem, 192**-0.5)
    out = run_backend(kernel.backend, problem)
    assert isinstance(out, torch.Tensor)
    assert [(c["is_causal"], c["lse"] is not None) for c in kernel.calls] == [(True, False)]
    assert kernel.calls[0]["seq_lens"].tolist() == [3, 11, 6]
    assert kernel.calls[0]["max_kv_len"] == kernel.calls[0]["max_q_len"] == 11
    ref = expected_step(problem, 192**-0.5)
    torch.testing.assert_close(out.double(), ref, atol=output_atol(torch.bfloat16, ref), rtol=0)


def test_new_tokens_lse_is_heads_by_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    new_lens = [4, 9]
    problem = r1_problem(new_lens, None, num_chunks=2, dtype=torch.bfloat16)
    kernel = install(monkeypatch, problem, 0.1)
    kernel.backend.prepare_metadata(problem.metadata)
    out, lse = kernel.backend.run_prefill_new_tokens(problem.q, problem.k, problem.v, True)
    assert out.shape == (13, NUM_HEADS, 128)
    assert lse.shape == (NUM_HEADS, 13)
    assert lse.is_contiguous()
    assert lse.dtype == torch.float32
    start = 0
    for n in new_lens:
        sl = slice(start, start + n)
        _, ref_lse = expected_attention(problem.q[sl], problem.k[sl], problem.v[sl], 0.1, causal=True)
        torch.testing.assert_close(lse[:, sl].double(), ref_lse, atol=1e-4, rtol=0)
        start += n


def test_context_chunk_lse_is_heads_by_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    problem = r1_problem([2, 5], [0, 20], num_chunks=1, dtype=torch.bfloat16)
    kernel = install(monkeypatch, problem, 0.1)
    kernel.backend.prepare_metadata(problem.metadata)
    out, lse = kernel.backend.run_prefill_context_chunk(0, problem.q, problem.chunk_k[0], problem.chunk_v[0])
    assert out.shape == (7, NUM_HEADS, 128)
    assert (out[:2] == 0).all()
    assert lse.shape == (NUM_HEADS, 7)
    assert torch.isneginf(lse[:, :2]).all()  # request 0 has no context
    _, ref_lse = expected_attention(
        problem.q[2:], problem.full_k[1][:20], problem.full_v[1][:20], 0.1, causal=False
    )
    torch.testing.assert_close(lse[:, 2:].double(), ref_lse, atol=1e-4, rtol=0)


def test_workspace_reserved_once_sized_by_vllm_env(monkeypatch: pytest.MonkeyPatch) -> None:
    problem = r1_problem([3], [5], num_chunks=1, dtype=torch.bfloat16)
    a = TrtllmRaggedPrefillBackend(NUM_HEADS, 0.1, 512, 128, 64, 128, None)
    assert a._workspace_buffer is None  # the layers' own instances never allocate one
    a.reserve_workspace(torch.device("cpu"))  # what the metadata builder does for its instance
    reserved = a._workspace_buffer
    assert reserved.numel() == WORKSPACE_BYTES
    assert reserved.dtype == torch.uint8
    assert not reserved.any()  # zeroed, as vLLM 0.20 gives this kernel
    a.prepare_metadata(problem.metadata)
    a.prepare_metadata(problem.metadata)
    assert a._workspace_buffer is reserved


def test_context_chunk_without_chunked_context_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    problem = r1_problem([3, 4], None, num_chunks=1, dtype=torch.bfloat16)
    kernel = install(monkeypatch, problem, 0.1)
    kernel.backend.prepare_metadata(problem.metadata)
    with pytest.raises(RuntimeError, match="without chunked_context"):
        kernel.backend.run_prefill_context_chunk(0, problem.q, problem.k, problem.v)
    assert kernel.calls == []


def test_prefill_before_prepare_metadata_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    problem = r1_problem([3], None, num_chunks=1, dtype=torch.bfloat16)
    kernel = install(monkeypatch, problem, 0.1)
    with pytest.raises(RuntimeError, match="prepare_metadata"):
        kernel.backend.run_prefill_new_tokens(problem.q, problem.k, problem.v, False)
    assert kernel.calls == []
