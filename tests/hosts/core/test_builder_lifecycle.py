"""The builder life cycle is the same on both hosts: a backend warms up for the step dtypes vLLM hands over.

vLLM's real MLA layer and metadata builder on the CPU, under whichever host the installed
vLLM gets: the patched 0.20 builder, or 0.25+'s builder cloning the bridged layer backend.
With an FP8 KV cache and prefill query quantization on a Blackwell-class device (the
platform's capability lookup patched to 10.0), vLLM's builder hands FP8 queries to a
backend that takes them, and the warm-up must be for that query dtype and the model's.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from custom_backends import DtypeRecordingBackend

import mla_prefill_ext
from mla_prefill_ext import MLAPrefillBackendEnum, register_mla_prefill_backend, settings, versions
from mla_prefill_ext.mla_layers import MLA_MODULE
from mla_prefill_ext.testing import vllm_host as host

BLACKWELL = (10, 0)


@pytest.fixture
def fp8_query_host(clean_selection: pytest.MonkeyPatch) -> Iterator[Any]:
    """The add-on active (its host lands), DtypeRecordingBackend chosen as FLASHINFER; vLLM's MLA module."""
    mla_prefill_ext.activate()
    if versions.decide().mode == versions.BRIDGE:
        from mla_prefill_ext.hosts import vllm_0_23

        importlib.import_module(vllm_0_23.PREFILL_PACKAGE)  # the bridge lands with vLLM's selector
    register_mla_prefill_backend(MLAPrefillBackendEnum.FLASHINFER, "custom_backends.DtypeRecordingBackend")
    clean_selection.setenv(settings.BACKEND_ENV, "FLASHINFER")
    module = importlib.import_module(MLA_MODULE)
    cached = getattr(module.backend_supports_prefill_query_quantization, "cache_clear", None)
    DtypeRecordingBackend.warmups.clear()
    if cached is not None:
        cached()  # vLLM's own cache of the answer, from an earlier configuration
    yield module
    if cached is not None:
        cached()
    DtypeRecordingBackend.warmups.clear()


def fp8_cache_config(model_dir: Any) -> Any:
    cfg = host.make_vllm_config(model_dir)
    cfg.cache_config.cache_dtype = "fp8"
    cfg.attention_config.use_prefill_query_quantization = True
    return cfg


def test_the_warmup_gets_the_builders_query_dtype_and_the_models(fp8_query_host, model_dirs):
    from vllm.config import set_current_vllm_config
    from vllm.platforms import current_platform

    cfg = fp8_cache_config(model_dirs["plain"])
    with host.gpu_view(BLACKWELL), set_current_vllm_config(cfg):
        layer = host.mla_layer(host.build_deepseek_attention(cfg))
        inner = getattr(layer.prefill_backend, "inner", layer.prefill_backend)  # bridged: the adapter's
        assert type(inner) is DtypeRecordingBackend
        builder_cls = layer.attn_backend.get_builder_cls()
        builder = builder_cls(layer.get_kv_cache_spec(cfg), [layer.layer_name], cfg, torch.device("cpu"))
    fp8 = current_platform.fp8_dtype()
    assert builder.q_data_type == fp8  # vLLM quantizes this configuration's prefill queries
    assert DtypeRecordingBackend.warmups == [(fp8, torch.bfloat16)]
