"""The suite's entry points: resolve the backend, list the cases, check each one it can serve, report."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from mla_prefill_ext.backends.base import MLAPrefillBackend
from mla_prefill_ext.testing.case_run import check_case
from mla_prefill_ext.testing.cases import (
    DEFAULT_DIMS,
    DEFAULT_NUM_HEADS,
    KV_LORA_RANK,
    ConformanceCase,
    make_cases,
    parse_dtypes,
)
from mla_prefill_ext.testing.conventions import CallingConvention
from mla_prefill_ext.testing.properties import FAIL
from mla_prefill_ext.testing.report import CheckResult, ConformanceReport


def resolve_backend(backend: Any) -> type[MLAPrefillBackend]:
    """A backend class from a class, an ``MLAPrefillBackendEnum`` member, a name or a class path."""
    from mla_prefill_ext.registry import MLAPrefillBackendEnum, load_backend_class, lookup

    if isinstance(backend, type):
        if not issubclass(backend, MLAPrefillBackend):
            raise TypeError(f"{backend!r} is not a subclass of mla_prefill_ext.MLAPrefillBackend")
        return backend
    if isinstance(backend, MLAPrefillBackendEnum):
        return backend.get_class()
    if isinstance(backend, str):
        if ":" in backend or "." in backend:  # a class path, 'pkg.mod.Class' or 'pkg.mod:Class'
            return load_backend_class(backend.replace(":", "."), backend)
        return lookup(backend).get_class()
    raise TypeError(
        "run_conformance() takes a backend class, an MLAPrefillBackendEnum member, a backend name or a "
        f"class path, not {type(backend).__name__}"
    )


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device to run on (default: CUDA when available), with a CUDA index."""
    dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("run_conformance(device='cuda'): CUDA is not available in this process")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def merge_description(device: torch.device) -> str:
    """Which merge_attn_states the merge check uses on ``device``."""
    if device.type == "cuda":
        return "vLLM's merge_attn_states (vllm.v1.attention.ops.merge_attn_states)"
    return (
        "merge_attn_states_torch: vLLM's merge_attn_states rule in torch, same float32 math "
        "(vLLM's op needs CUDA or Triton, which a CPU lacks)"
    )


def check_cases(
    cls: type[MLAPrefillBackend],
    cases: list[ConformanceCase],
    device: torch.device,
    capability: Any,
    seed: int,
    kv_lora_rank: int,
    convention: CallingConvention,
) -> tuple[list[CheckResult], dict[str, str]]:
    """The results of every case the backend accepts, and why it refused the others."""
    from mla_prefill_ext.selector import MLAPrefillSelectorConfig

    results: list[CheckResult] = []
    skipped: dict[str, str] = {}
    for case in cases:
        config = MLAPrefillSelectorConfig.from_dims(case.dtype, *case.dims)
        try:
            reasons = cls.validate_configuration(capability, config)
        except Exception as e:
            message = f"validate_configuration raised {type(e).__name__}: {e}"
            results.append(CheckResult("runs", case.label, FAIL, message))
            continue
        if reasons:
            skipped[case.label] = "; ".join(reasons)
            continue
        results.extend(check_case(cls, case, device, seed, kv_lora_rank, convention))
    return results, skipped


def run_conformance(
    backend: type[MLAPrefillBackend] | str | Any,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | Sequence[torch.dtype | str] | None = None,
    *,
    dims: Sequence[tuple[int, int, int]] = DEFAULT_DIMS,
    num_heads: Sequence[int] = DEFAULT_NUM_HEADS,
    scale: float | None = None,
    seed: int = 0,
    kv_lora_rank: int = KV_LORA_RANK,
    convention: CallingConvention | None = None,
) -> ConformanceReport:
    """Check ``backend`` against every property in :data:`PROPERTIES`; never raises for a bad backend.

    ``backend``: a backend class, an ``MLAPrefillBackendEnum`` member, a registered name
    (``"TORCH_SDPA"``) or a class path (``"pkg.mod.Class"`` or ``"pkg.mod:Class"``).
    ``device``: ``"cpu"`` or ``"cuda"`` (default: CUDA when available).
    ``dtype``: one dtype, several, or None for bfloat16, float16 and float32 (each case the
    backend's ``validate_configuration`` refuses is skipped with its reasons).
    ``dims``: (qk_nope_head_dim, qk_rope_head_dim, v_head_dim) triples; ``num_heads``: head
    counts. ``scale``: the softmax scale to construct the backend with (default:
    DeepSeek's YaRN-scaled scale for the qk head dim, about 1.59 / sqrt(qk_head_dim),
    so that a backend using 1/sqrt(qk_head_dim) is caught). ``convention``: how the backend is
    called (default: as the installed vLLM calls it; on vLLM 0.23+ through the bridge's adapter,
    :mod:`mla_prefill_ext.testing.conventions.bridged`).
    """
    from mla_prefill_ext.selector import current_device_capability

    t0 = time.perf_counter()
    cls = resolve_backend(backend)
    dev = resolve_device(device)
    cap = current_device_capability() if dev.type == "cuda" else None
    cases = make_cases(parse_dtypes(dtype), dims, num_heads, scale)
    if convention is None:
        from mla_prefill_ext.testing.conventions.bridged import installed_vllm_convention

        convention = installed_vllm_convention()
    results, skipped = check_cases(cls, cases, dev, cap, seed, kv_lora_rank, convention)
    return ConformanceReport(
        backend=cls.get_name(),
        backend_class=f"{cls.__module__}.{cls.__qualname__}",
        device=str(dev),
        capability=None if cap is None else f"{cap.major}.{cap.minor}",
        merge=merge_description(dev),
        cases=cases,
        skipped_cases=skipped,
        results=results,
        duration_s=time.perf_counter() - t0,
    )


def assert_conformant(backend: Any, *args: Any, **kwargs: Any) -> ConformanceReport:
    """:func:`run_conformance`, raising AssertionError with the formatted report unless it passed.

    Also raises when every case was skipped: a backend that runs nowhere here proves nothing.
    """
    report = run_conformance(backend, *args, **kwargs)
    if not report.ok:
        raise AssertionError("\n" + report.format())
    return report
