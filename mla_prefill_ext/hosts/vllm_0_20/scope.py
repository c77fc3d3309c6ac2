"""Where the add-on takes over vLLM's MLA prefill, and where vLLM's own stays.

The add-on replaces vLLM 0.20's prefill only where one of its backends serves at
least as well as stock: on CUDA (vLLM's stock prefill there is FlashAttention, or a
Blackwell-only kernel the add-on also carries) and where vLLM has no MLA prefill
kernel at all (CPU, no platform). It leaves vLLM's own prefill in place, with one
INFO line saying why:

* on ROCm, XPU and any other platform, whose MLA implementations bring their own
  prefill kernels (ROCm AITER, XPU flash attention);
* for an ``MLACommonImpl`` subclass that brings its own prefill kernel (it
  overrides a prefill method with code that does not delegate to vLLM's).

An explicit choice (``MLA_PREFILL_BACKEND`` or ``additional_config``) is honoured
there too when a backend can serve it, and refused with the reasons when none can:
the user asked for it by name.
"""

from __future__ import annotations

import functools
from typing import Any

from mla_prefill_ext.hosts.core.platform import platform_reason

# MLACommonImpl's prefill methods: a subclass that re-implements one of them runs its own kernel.
PREFILL_METHODS = (
    "forward_mha",
    "_flash_attn_varlen_diff_headdims",
    "_compute_prefill_context",
    "_run_prefill_new_tokens_fa",
    "_run_prefill_new_tokens_fi",
    "_run_prefill_new_tokens_cudnn",
    "_run_prefill_new_tokens_trtllm_ragged",
    "_run_prefill_context_chunk_fa",
    "_run_prefill_context_chunk_fi",
    "_run_prefill_context_chunk_cudnn",
    "_run_prefill_context_chunk_trtllm_ragged",
)


@functools.cache
def own_prefill_method(impl_cls: type, common_impl: type) -> str | None:
    """The first prefill method ``impl_cls`` re-implements without delegating to vLLM's (or None)."""
    for klass in impl_cls.__mro__:
        if klass is common_impl:
            break
        for name in PREFILL_METHODS:
            func = klass.__dict__.get(name)
            code = getattr(func, "__code__", None)
            if code is None:
                continue
            if "super" in code.co_names:  # a thin override that calls vLLM's own (TritonMLAImpl)
                continue
            return f"{klass.__qualname__}.{name}"
    return None


def stock_reason(impl: Any, common_impl: type, explicit: bool) -> str | None:
    """Why this attention implementation keeps vLLM's stock prefill (None: the add-on takes over)."""
    if explicit:
        return None
    reason = platform_reason()
    if reason is not None:
        return reason
    method = own_prefill_method(type(impl), common_impl)
    if method is not None:
        return f"{type(impl).__name__} brings its own prefill kernel ({method})"
    return None
