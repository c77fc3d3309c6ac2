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
import inspect
import types
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


class _ReachedVllm(BaseException):  # not an Exception: passes through an override's own handlers
    """Raised by the probe's stand-ins for vLLM's prefill methods: an override called vLLM's own."""


def _reached_vllm(*args: Any, **kwargs: Any) -> None:
    raise _ReachedVllm


def _unset_attribute(self: Any, name: str) -> None:
    """The probe skips ``__init__``: what it would have set reads as None (an unset option)."""
    return None


def _reaches_vllm(method: Any) -> bool:
    """Whether calling ``method`` (bound to a probe) with None for each required argument reaches vLLM's."""
    params = inspect.signature(method).parameters.values()
    required = [p for p in params if p.default is p.empty]
    args = [None for p in required if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    kwargs = {p.name: None for p in required if p.kind is p.KEYWORD_ONLY}
    try:
        method(*args, **kwargs)
    except _ReachedVllm:
        return True
    except Exception:  # its own code failed on the empty arguments before reaching vLLM's
        return False
    return False


@functools.cache
def own_prefill_method(impl_cls: type, common_impl: type) -> str | None:
    """The first prefill method ``impl_cls`` overrides without delegating to vLLM's (or None).

    Each override is called on a probe: an instance of ``impl_cls`` whose MRO has, just before
    ``common_impl``, stand-ins for vLLM's prefill methods that raise. A thin override that calls
    ``super()`` (TritonMLAImpl's, after reading its options) reaches them; one that runs its own
    kernel does not.
    """
    below = impl_cls.__mro__[: impl_cls.__mro__.index(common_impl)]
    overridden = [name for name in PREFILL_METHODS if any(name in klass.__dict__ for klass in below)]
    if not overridden:
        return None
    try:
        stand_in = types.new_class("VllmPrefillStandIn", (common_impl,))
        for name in PREFILL_METHODS:
            setattr(stand_in, name, _reached_vllm)
        stand_in.__getattr__ = _unset_attribute
        probe_cls = types.new_class("PrefillProbe", (impl_cls, stand_in))
        probe = probe_cls.__new__(probe_cls)
    except TypeError:  # no probe can be built for this class (its layout or metaclass): keep vLLM's
        probe = None
    for name in overridden:
        if probe is None or not _reaches_vllm(getattr(probe, name)):
            owner = next(klass for klass in below if name in klass.__dict__)
            return f"{owner.__qualname__}.{name}"
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
