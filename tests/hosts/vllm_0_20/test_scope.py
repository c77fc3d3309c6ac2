"""Where the add-on takes over vLLM's MLA prefill, and where vLLM keeps its own (patches/scope.py).

The platform is vLLM's real one with its is_* answers patched (the test kit's vllm_host rule: device
facts only); the attention implementations are vLLM's real classes.
"""

from __future__ import annotations

import pytest
from platform_views import platform_view

from mla_prefill_ext import settings
from mla_prefill_ext.hosts.core import refusal
from mla_prefill_ext.hosts.vllm_0_20 import scope


def decision(name: str, impl_cls: type, explicit: bool) -> str | None:
    """scope.stock_reason for an implementation of ``impl_cls`` on the platform ``name``."""
    from vllm.model_executor.layers.attention.mla_attention import MLACommonImpl

    impl = impl_cls.__new__(impl_cls)  # the decision reads the class only
    stack = platform_view(name)
    for p in stack:
        p.start()
    try:
        return scope.stock_reason(impl, MLACommonImpl, explicit=explicit)
    finally:
        for p in reversed(stack):
            p.stop()


@pytest.mark.vllm_patch  # vLLM 0.20's MLACommonImpl prefill methods
def test_impl_classes_with_their_own_prefill_are_recognised():
    from vllm.model_executor.layers.attention.mla_attention import MLACommonImpl
    from vllm.v1.attention.backends.mla.aiter_triton_mla import AiterTritonMLAImpl
    from vllm.v1.attention.backends.mla.flashattn_mla import FlashAttnMLAImpl
    from vllm.v1.attention.backends.mla.rocm_aiter_mla import AiterMLAImpl
    from vllm.v1.attention.backends.mla.triton_mla import TritonMLAImpl

    assert scope.own_prefill_method(FlashAttnMLAImpl, MLACommonImpl) is None
    assert scope.own_prefill_method(TritonMLAImpl, MLACommonImpl) is None  # its override calls vLLM's own
    assert (
        scope.own_prefill_method(AiterMLAImpl, MLACommonImpl)
        == "AiterMLAImpl._flash_attn_varlen_diff_headdims"
    )
    # A subclass of AiterMLAImpl whose override runs Triton's kernel, not its parent's nor vLLM's.
    assert (
        scope.own_prefill_method(AiterTritonMLAImpl, MLACommonImpl)
        == "AiterTritonMLAImpl._flash_attn_varlen_diff_headdims"
    )


@pytest.mark.parametrize(("name", "served"), [("cuda-h200", True), ("rocm-mi300", False), ("xpu", False)])
def test_platform_decision(name, served):
    from vllm.v1.attention.backends.mla.triton_mla import TritonMLAImpl

    reason = decision(name, TritonMLAImpl, explicit=False)
    assert (reason is None) == served, reason
    if not served:
        assert "has its own MLA prefill kernels" in reason
    # An explicit choice is honoured where a backend can serve it: the selector decides then.
    assert decision(name, TritonMLAImpl, explicit=True) is None


def test_an_impl_with_its_own_kernel_keeps_it_unless_chosen_explicitly():
    from vllm.v1.attention.backends.mla.rocm_aiter_mla import AiterMLAImpl

    reason = decision("cuda-h200", AiterMLAImpl, explicit=False)
    # vLLM 0.34's AiterMLAImpl.forward_mha runs its own kernels too (0.33's delegates): the first one found
    owns = ("forward_mha", "_flash_attn_varlen_diff_headdims")
    assert reason in [f"AiterMLAImpl brings its own prefill kernel (AiterMLAImpl.{own})" for own in owns]
    assert decision("cuda-h200", AiterMLAImpl, explicit=True) is None


def test_the_explicit_choice_is_the_configuration_being_built(clean_selection, model_dirs):
    from vllm.config import set_current_vllm_config

    from mla_prefill_ext.testing import vllm_host as host

    assert refusal.explicit_choice() is None  # no configuration, nothing set
    clean_selection.setenv(settings.BACKEND_ENV, "flash_attn")
    assert refusal.explicit_choice().source == settings.BACKEND_ENV
    clean_selection.delenv(settings.BACKEND_ENV)
    cfg = host.make_vllm_config(model_dirs["plain"], additional_config={"mla_prefill_backend": "torch_sdpa"})
    with set_current_vllm_config(cfg):
        choice = refusal.explicit_choice()
    assert (choice.name, choice.source) == ("torch_sdpa", "additional_config['mla_prefill_backend']")
