"""Whether the add-on serves MLA prefill on this process's platform (what ``info`` reports on every vLLM).

On CUDA, and where vLLM has no MLA prefill kernel at all (CPU, no platform), the add-on
serves; on ROCm, XPU and others vLLM's own prefill kernels stay unless a backend is chosen
explicitly (the 0.20 patch's scope, ``hosts/vllm_0_20/scope.py``).
"""

from __future__ import annotations


def platform_reason() -> str | None:
    """Why this process's platform keeps vLLM's stock MLA prefill (None: the add-on serves it)."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda() or current_platform.is_cpu() or current_platform.is_unspecified():
        return None
    return (
        f"platform {type(current_platform).__name__} has its own MLA prefill kernels in "
        "vLLM; the add-on's backends are verified on CUDA only"
    )
