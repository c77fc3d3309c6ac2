"""Backend warm-up at engine start: declared variants run once per process and configuration.

With vLLM 0.20.2's real DeepSeek-V2 layers and MLA metadata builder on the CPU (testing/vllm_host.py);
vLLM creates its builders while it sets up the KV cache, before the engine reports ready.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch
from custom_backends import WarmingSDPABackend
from mla_layer_on_cpu import build_layer, make_builder

from mla_prefill_ext import settings
from mla_prefill_ext.backends import warmup
from mla_prefill_ext.backends.base import KernelWarmup
from mla_prefill_ext.testing import vllm_host as host


@pytest.fixture
def fresh_process_record() -> Iterator[None]:
    """This process's record of warm-ups emptied, as in a fresh engine process."""
    saved = dict(warmup._DONE)
    warmup._DONE.clear()
    WarmingSDPABackend.calls.clear()
    yield
    warmup._DONE.clear()
    warmup._DONE.update(saved)
    WarmingSDPABackend.calls.clear()


@pytest.fixture
def addon_info(addon_log) -> Iterator[list[logging.LogRecord]]:
    """The add-on's records with its logger at INFO (the tests run vLLM at WARNING)."""
    addon_logger = logging.getLogger("vllm.mla_prefill_ext")
    level = addon_logger.level
    addon_logger.setLevel(logging.INFO)
    yield addon_log
    addon_logger.setLevel(level)


def select_custom(monkeypatch: pytest.MonkeyPatch, class_path: str) -> None:
    from mla_prefill_ext import MLAPrefillBackendEnum, register_mla_prefill_backend

    register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, class_path)
    monkeypatch.setenv(settings.BACKEND_ENV, "CUSTOM")


def test_declared_warmup_runs_once_per_process_when_the_builder_is_created(
    shim, clean_selection, model_dirs, fresh_process_record, addon_info
):
    select_custom(clean_selection, "custom_backends.WarmingSDPABackend")
    cfg = host.make_vllm_config(model_dirs["plain"])
    layers = [build_layer(cfg, None, f"model.layers.{i}.self_attn") for i in range(2)]
    assert WarmingSDPABackend.calls == []  # building the layers runs nothing

    first = make_builder(cfg, layers, None)  # vLLM's first builder: KV-cache set-up, engine start
    calls = WarmingSDPABackend.calls
    assert [(what, arg) for _, what, arg in calls] == [
        ("prepare_metadata", "WarmupPrefillMetadata"),
        ("new_tokens", False),
        ("new_tokens", True),
        ("context_chunk", 0),
    ]
    (probe,) = {id(instance) for instance, _, _ in calls}  # one instance ran the whole synthetic step...
    (runner,) = first._mla_prefill_runners.values()
    # ...of its own (the recorded instances stay alive, so their ids cannot be reused meanwhile)
    assert probe not in {id(runner), *(id(layer.prefill_backend) for layer in layers)}

    # The profiling builder and then the real one, or dual-batch overlap's two: no second warm-up.
    make_builder(cfg, layers, None)
    make_builder(cfg, layers, None)
    assert len(WarmingSDPABackend.calls) == 4

    (record,) = warmup.completed()
    assert (record.backend, record.variants) == (
        "WARMING_SDPA",
        ("new_tokens", "new_tokens_lse", "context_chunk"),
    )
    assert (record.num_heads, record.qk_nope_head_dim, record.qk_rope_head_dim, record.v_head_dim) == (
        4,
        128,
        64,
        128,
    )
    assert (record.q_data_type, record.output_dtype, record.device) == ("bfloat16", "bfloat16", "cpu")

    infos = [r.getMessage() for r in addon_info if r.levelno == logging.INFO]
    before = [m for m in infos if "building or loading the MLA prefill kernels" in m]
    after = [m for m in infos if "MLA prefill kernels ready in" in m]
    assert len(before) == 1 and len(after) == 1, infos
    assert before[0].startswith("WARMING_SDPA: ")
    assert (
        "(new tokens, new tokens with LSE, context chunks; bfloat16, 4 heads, qk 128+64, v 128)" in before[0]
    )
    assert before[0].endswith("; a test backend that warms every variant")
    assert after[0].startswith("WARMING_SDPA: MLA prefill kernels ready in ") and after[0].endswith(" s")
    assert infos.index(before[0]) < infos.index(after[0])


def test_warmup_leaves_nothing_a_step_could_see(shim, clean_selection, model_dirs, fresh_process_record):
    """The builder's instances are as a fresh clone leaves them; its first step runs as without a warm-up."""
    from vllm.config import set_current_vllm_config

    from mla_prefill_ext.backends.torch_sdpa import TorchSDPAPrefillBackend

    select_custom(clean_selection, "custom_backends.WarmingSDPABackend")
    cfg = host.make_vllm_config(model_dirs["plain"])
    layer = build_layer(cfg, None)
    builder = make_builder(cfg, [layer], None)
    assert warmup.completed(), "the warm-up did not run"
    (runner,) = builder._mla_prefill_runners.values()
    fresh = layer.prefill_backend.clone()
    # TORCH_SDPA keeps per-step bounds on the instance it prepares: a warm-up on the runner would show.
    assert vars(runner).keys() == vars(fresh).keys() and runner._prefill_metadata is None
    assert layer.prefill_backend._prefill_metadata is None

    with host.gpu_view(None), set_current_vllm_config(cfg):
        metadata = builder.build(0, host.prefill_batch([5, 3]))
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(8, 4, 192, generator=gen, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(8, 4, 128, generator=gen, dtype=torch.bfloat16)
    out, lse = layer.impl._run_prefill_new_tokens(metadata.prefill, q, k, v, True)
    plain = TorchSDPAPrefillBackend(**layer.prefill_backend._init_kwargs)
    plain.prepare_metadata(metadata.prefill)
    ref_out, ref_lse = plain.run_prefill_new_tokens(q, k, v, True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


def test_each_distinct_configuration_warms_up_once(shim, clean_selection, model_dirs, fresh_process_record):
    select_custom(clean_selection, "custom_backends.WarmingSDPABackend")
    for model, dtype in (
        ("plain", "bfloat16"),
        ("non_r1", "bfloat16"),
        ("plain", "float32"),
        ("plain", "bfloat16"),
    ):
        cfg = host.make_vllm_config(model_dirs[model], dtype=dtype)
        make_builder(cfg, [build_layer(cfg, None)], None)
    seen = [(r.qk_nope_head_dim, r.v_head_dim, r.q_data_type) for r in warmup.completed()]
    assert seen == [(128, 128, "bfloat16"), (64, 64, "bfloat16"), (128, 128, "float32")]


def test_a_backend_that_declares_nothing_runs_and_says_nothing(
    shim, clean_selection, model_dirs, fresh_process_record, addon_info
):
    clean_selection.setenv(settings.BACKEND_ENV, "TORCH_SDPA")
    cfg = host.make_vllm_config(model_dirs["plain"])
    make_builder(cfg, [build_layer(cfg, None)], None)
    assert warmup.completed() == []
    assert not [r for r in addon_info if "prefill kernels" in r.getMessage()]


def test_a_failed_warmup_stops_the_engine_at_start_naming_the_backend(
    shim, clean_selection, model_dirs, fresh_process_record, addon_info
):
    select_custom(clean_selection, "custom_backends.FailingWarmupBackend")
    cfg = host.make_vllm_config(model_dirs["plain"])
    layer = build_layer(cfg, None)
    with pytest.raises(RuntimeError, match="no compiler on this host"):
        make_builder(cfg, [layer], None)
    errors = [r.getMessage() for r in addon_info if r.levelno == logging.ERROR]
    assert errors == [
        "FAILING_WARMUP: warming up its MLA prefill kernels failed; its first prefill would fail the same "
        "way, so the engine stops here"
    ]
    assert warmup.completed() == []  # not recorded as done: a second builder would try again


def test_which_built_in_backends_declare_a_warmup():
    """FlashInfer builds its kernels on first use (JIT); FlashAttention and PyTorch ship them compiled."""
    from mla_prefill_ext.registry import MLAPrefillBackendEnum

    declared = {
        member.name: member.get_class().kernel_warmup
        for member in (
            MLAPrefillBackendEnum.FLASH_ATTN,
            MLAPrefillBackendEnum.FLASHINFER,
            MLAPrefillBackendEnum.TRTLLM_RAGGED,
            MLAPrefillBackendEnum.TORCH_SDPA,
        )
    }
    assert declared["FLASH_ATTN"] is None and declared["TORCH_SDPA"] is None
    for name in ("FLASHINFER", "TRTLLM_RAGGED"):
        assert declared[name].variants == ("new_tokens", "new_tokens_lse", "context_chunk"), name
        assert "first start" in declared[name].note


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn])
def test_synthetic_step_is_laid_out_as_vllm_hands_a_step_over(dtype):
    from mla_prefill_ext.backends.base import context_chunks, host_query_start_loc
    from mla_prefill_ext.backends.torch_sdpa import TorchSDPAPrefillBackend

    backend = TorchSDPAPrefillBackend(16, 0.1, 512, 128, 64, 128, None)
    step = warmup.synthetic_step(backend, torch.device("cpu"), dtype, torch.bfloat16)
    new, ctx = sum(warmup.NEW_TOKENS), sum(warmup.CONTEXT_TOKENS)
    assert step.q.shape == step.k.shape == (new, 16, 192) and step.v.shape == (new, 16, 128)
    assert step.chunk_k.shape == (ctx, 16, 192) and step.chunk_v.shape == (ctx, 16, 128)
    assert {t.dtype for t in (step.q, step.k, step.v, step.chunk_k, step.chunk_v)} == {dtype}
    assert step.v.stride(1) == 128 + 128 and step.v.storage_offset() == 128  # the tail of [k_nope | v]
    m = step.metadata
    assert (m.q_data_type, m.output_dtype, m.max_query_len) == (dtype, torch.bfloat16, 16)
    assert host_query_start_loc(m).tolist() == [0, 16, 24] and m.query_start_loc.dtype == torch.int32
    (chunk,) = context_chunks(m)
    assert chunk.cu_seq_lens_cpu.tolist() == [0, 32, 48] and chunk.cu_seq_lens.dtype == torch.int32
    assert (chunk.index, chunk.max_seq_len, chunk.seq_lens.tolist()) == (0, 32, [32, 16])


def test_variants_are_named_in_the_order_they_run():
    assert KernelWarmup().variants == ("new_tokens", "new_tokens_lse", "context_chunk")
    assert KernelWarmup(new_tokens=False, new_tokens_lse=False).variants == ("context_chunk",)
    assert KernelWarmup(False, False, False).variants == ()
