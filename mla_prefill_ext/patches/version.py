"""The vLLM versions this patch applies to: the patch row of :mod:`mla_prefill_ext.versions`."""

from __future__ import annotations

from mla_prefill_ext.versions import MODES, PATCH, installed_vllm_version, release

_PATCH_MODE = next(m for m in MODES if m.name == PATCH)

SUPPORTED_VLLM_RANGE = (_PATCH_MODE.low, _PATCH_MODE.high)
"""vLLM releases whose MLA layer the patch was written and tested against: [min, max)."""

SUPPORTED_VLLM = ">=0.20.0,<0.21"
"""The same range, as a requirement specifier (for messages and docs)."""

__all__ = ["SUPPORTED_VLLM", "SUPPORTED_VLLM_RANGE", "installed_vllm_version", "unsupported_reason"]


def unsupported_reason(vllm_version: str | None = None) -> str | None:
    """Why this vLLM version is not patched, or None when it is supported.

    Only the release numbers count, so dev and local builds of 0.20.x qualify;
    pre-releases of 0.21 do not (their release is 0.21.0).
    """
    v = installed_vllm_version() if vllm_version is None else vllm_version
    if v is None:
        return "vLLM is not installed"
    rel = release(v)
    if rel is None:
        return f"vLLM version '{v}' cannot be parsed"
    low, high = SUPPORTED_VLLM_RANGE
    if not (low <= rel < high):
        return f"vLLM {v} is not supported (supported: vllm{SUPPORTED_VLLM})"
    return None
