"""Diagnostics: ``mla-prefill-ext info | select | check`` (also ``python -m mla_prefill_ext``)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

EXIT_OK, EXIT_FAIL = 0, 1


def _capability(text: str | None) -> Any:
    from vllm.platforms.interface import DeviceCapability

    from mla_prefill_ext.selector import current_device_capability

    if text is None:
        return current_device_capability()
    if text.lower() in ("none", "cpu"):
        return None
    try:
        major, minor = (int(x) for x in text.split("."))
    except ValueError:
        raise SystemExit(f"--capability takes MAJOR.MINOR (e.g. 9.0) or 'cpu', not {text!r}") from None
    return DeviceCapability(major, minor)


def _dtype(text: str) -> Any:
    import torch

    dtype = getattr(torch, text, None)
    if not isinstance(dtype, torch.dtype):
        raise SystemExit(f"--dtype takes a torch dtype name (bfloat16, float16, float32), not {text!r}")
    return dtype


def _dims(text: str) -> tuple[int, int, int]:
    from mla_prefill_ext.backends.base import R1_MLA_DIMS

    if text.lower() == "r1":
        return R1_MLA_DIMS
    try:
        nope, rope, v = (int(x) for x in text.split(","))
    except ValueError:
        raise SystemExit(f"--dims takes 'r1' or NOPE,ROPE,V (e.g. 128,64,128), not {text!r}") from None
    return nope, rope, v


def _cap_str(cap: Any) -> str:
    return "none (CPU or unknown platform)" if cap is None else f"{cap.major}.{cap.minor}"


def _emit(args: argparse.Namespace, payload: dict[str, Any], lines: list[str]) -> None:
    if args.json:
        print(json.dumps(payload, indent=2, default=str))
    else:
        print("\n".join(lines))


def cmd_info(args: argparse.Namespace) -> int:
    import importlib

    import mla_prefill_ext
    from mla_prefill_ext import activation, patches
    from mla_prefill_ext.patches.version import SUPPORTED_VLLM, installed_vllm_version, unsupported_reason
    from mla_prefill_ext.registry import OVERRIDES_ENV, registered_backends
    from mla_prefill_ext.selector import BACKEND_ENV

    mla_prefill_ext.activate()  # what vLLM's plugin loader does in each of its processes
    importlib.import_module(patches.MLA_MODULE)  # lands the patch (post-import hook)
    st = patches.state()
    vllm_version = installed_vllm_version()
    backends = []
    for member, path in registered_backends():
        kind = "built-in" if member.is_builtin else "registered name"
        if member.name == "CUSTOM":
            kind = "out-of-tree placeholder"
        backends.append(
            {
                "name": member.name,
                "kind": kind,
                "overridden": member.is_overridden(),
                "class_path": path,
            }
        )
    payload = {
        "package_version": mla_prefill_ext.__version__,
        "vllm_version": vllm_version,
        "vllm_supported": unsupported_reason(vllm_version) is None,
        "supported_range": f"vllm{SUPPORTED_VLLM}",
        "disabled_by_env": activation.is_disabled(),
        "active": activation.is_active(),
        "patched": st.instrumented,
        "skipped_reason": st.skipped_reason,
        "targets": [{"target": t.path, "wrapped": t.wrapped, "problem": t.problem} for t in st.targets],
        "backends": backends,
        "environment": {
            name: os.environ.get(name) for name in (BACKEND_ENV, OVERRIDES_ENV, activation.DISABLE_ENV)
        },
    }
    shim_state = (
        f"disabled by {activation.DISABLE_ENV}"
        if payload["disabled_by_env"]
        else ("active" if payload["active"] else "inactive")
    )
    lines = [
        f"mla-prefill-ext {payload['package_version']}",
        f"vLLM {vllm_version}: {'supported' if payload['vllm_supported'] else 'NOT supported'} "
        f"(supported: vllm{SUPPORTED_VLLM})",
        f"shim: {shim_state}, "
        f"vLLM MLA layer {'patched' if st.instrumented else 'NOT patched'}"
        + (f" ({st.skipped_reason})" if st.skipped_reason else ""),
        "patch targets:",
        *(
            f"  {'ok     ' if t.ok else 'PROBLEM'} {t.path}{' (wrapped)' if t.wrapped else ''}"
            + (f": {t.problem}" if t.problem else "")
            for t in st.targets
        ),
        "backends:",
        *(
            f"  {b['name']:<14} {b['kind']}{', overridden' if b['overridden'] else ''}: "
            f"{b['class_path'] or '(not registered)'}"
            for b in backends
        ),
        "configuration:",
        *(f"  {k}={v if v is not None else '(unset)'}" for k, v in payload["environment"].items()),
    ]
    _emit(args, payload, lines)
    return EXIT_OK


def cmd_select(args: argparse.Namespace) -> int:
    from mla_prefill_ext.registry import MLAPrefillBackendEnum
    from mla_prefill_ext.selector import (
        Choice,
        MLAPrefillSelectorConfig,
        check_backend,
        mla_prefill_backend_priorities,
        requested_choice,
        select,
    )

    cap = _capability(args.capability)
    config = MLAPrefillSelectorConfig.from_dims(_dtype(args.dtype), *_dims(args.dims))
    choice = Choice(args.backend, "--backend", True) if args.backend else requested_choice(None)
    order = [m.name for m in mla_prefill_backend_priorities(cap)]
    candidates = []
    for member in MLAPrefillBackendEnum:
        if member.value is None and not member.is_overridden():
            continue  # CUSTOM-like, nothing registered
        _, reasons = check_backend(member, cap, config)
        candidates.append({"name": member.name, "valid": not reasons, "reasons": reasons})
    error = None
    try:
        selection = select(cap, config, choice)
        chosen, source = selection.name, selection.source
    except ValueError as e:
        chosen, source, error = None, (choice.source if choice else "automatic"), str(e)
    payload = {
        "capability": None if cap is None else f"{cap.major}.{cap.minor}",
        "dtype": str(config.dtype).removeprefix("torch."),
        "r1_dims": config.is_r1_compatible,
        "automatic_order": order,
        "requested": choice.name if choice else "AUTO",
        "source": source,
        "selected": chosen,
        "error": error,
        "candidates": candidates,
    }
    lines = [
        f"capability {_cap_str(cap)}, dtype {payload['dtype']}, DeepSeek-R1 MLA dims: "
        f"{'yes' if config.is_r1_compatible else 'no'}",
        f"automatic order: {' > '.join(order)}",
        f"requested: {payload['requested']} ({source})",
        f"selected: {chosen}" if chosen else f"selected: none\nerror: {error}",
        "candidates:",
        *(
            f"  {c['name']:<14} {'valid' if c['valid'] else 'invalid: ' + '; '.join(c['reasons'])}"
            for c in candidates
        ),
    ]
    _emit(args, payload, lines)
    return EXIT_OK if chosen else EXIT_FAIL


# The embedded problem: DeepSeek-V2-Lite's MLA prefill (16 heads, qk 128+64, v 128,
# YaRN-scaled softmax scale), three requests, two with cached context in two chunks.
CHECK_NEW_TOKENS = [384, 256, 128]
CHECK_CONTEXT = [1024, 512, 0]
CHECK_CHUNKS = 2
CHECK_HEADS = 16


def cmd_check(args: argparse.Namespace) -> int:
    import torch

    from mla_prefill_ext.problem import deepseek_yarn_scale, make_problem, run_backend
    from mla_prefill_ext.selector import (
        Choice,
        MLAPrefillSelectorConfig,
        current_device_capability,
        requested_choice,
        select,
    )

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = _dtype(args.dtype)
    cap = current_device_capability() if device == "cuda" else None
    config = MLAPrefillSelectorConfig.from_dims(dtype, 128, 64, 128)
    choice = Choice(args.backend, "--backend", True) if args.backend else requested_choice(None)
    try:
        selection = select(cap, config, choice)
    except ValueError as e:
        _emit(args, {"ok": False, "error": str(e)}, [f"FAIL: {e}"])
        return EXIT_FAIL
    scale = deepseek_yarn_scale()
    backend = selection.backend(CHECK_HEADS, scale, 512, 128, 64, 128, None)
    problem = make_problem(
        CHECK_NEW_TOKENS, CHECK_CONTEXT, CHECK_CHUNKS, CHECK_HEADS, dtype=dtype, device=device, seed=args.seed
    )

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    out = run_backend(backend, problem)  # warm-up (and JIT, where a backend compiles)
    sync()
    times = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        out = run_backend(backend, problem)
        sync()
        times.append(time.perf_counter() - t0)
    ref = problem.reference(scale).to(out.device)
    err = (out.to(torch.float64) - ref).abs()
    ref_max = ref.abs().max().item()
    max_err = err.max().item()
    # Output rounding alone costs half an ulp of the largest value: 2^-9 relative
    # in bf16, 2^-12 in fp16; allow four times that (accumulation order).
    rel_tol = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}.get(dtype, 1e-5)
    ok = bool(torch.isfinite(out).all()) and max_err <= rel_tol * ref_max
    median = statistics.median(times)
    payload = {
        "ok": ok,
        "backend": selection.name,
        "class": f"{selection.backend.__module__}.{selection.backend.__qualname__}",
        "source": selection.source,
        "device": device,
        "capability": None if cap is None else f"{cap.major}.{cap.minor}",
        "dtype": str(dtype).removeprefix("torch."),
        "problem": {
            "heads": CHECK_HEADS,
            "dims": [128, 64, 128],
            "scale": scale,
            "new_tokens": CHECK_NEW_TOKENS,
            "context_tokens": CHECK_CONTEXT,
            "context_chunks": CHECK_CHUNKS,
        },
        "max_abs_error": max_err,
        "mean_abs_error": err.mean().item(),
        "max_abs_reference": ref_max,
        "tolerance": rel_tol * ref_max,
        "time_ms_median": median * 1e3,
        "time_ms_all": [t * 1e3 for t in times],
        "tflops": problem.flops() / median / 1e12,
    }
    lines = [
        f"backend: {selection.name} ({payload['class']}, {selection.source})",
        f"device: {device}, capability {_cap_str(cap)}, dtype {payload['dtype']}",
        f"problem: DeepSeek-V2-Lite MLA prefill, {CHECK_HEADS} heads, qk 128+64, v 128, "
        f"scale {scale:.6f}; new tokens {CHECK_NEW_TOKENS}, context {CHECK_CONTEXT} "
        f"in {CHECK_CHUNKS} chunks",
        f"max |error| vs float64 reference: {max_err:.3e} (tolerance {rel_tol * ref_max:.3e}; "
        f"mean {payload['mean_abs_error']:.3e}; max |ref| {ref_max:.3f})",
        f"time: {median * 1e3:.2f} ms median of {args.repeat} ({payload['tflops']:.3f} TFLOP/s)",
        "PASS" if ok else "FAIL",
    ]
    _emit(args, payload, lines)
    return EXIT_OK if ok else EXIT_FAIL


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mla-prefill-ext",
        description="Diagnostics for the pluggable MLA prefill backends of vLLM 0.20.x.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="host vLLM, patch state, registered backends, configuration")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("select", help="which backend would serve, and why each other would not")
    p.add_argument("--capability", help="MAJOR.MINOR or 'cpu' (default: this machine)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--dims", default="r1", help="'r1' or NOPE,ROPE,V head dims (default r1)")
    p.add_argument("--backend", help="an explicit choice to validate (default: the environment)")
    p.set_defaults(func=cmd_select)

    p = sub.add_parser("check", help="run one MLA prefill through the selected backend")
    p.add_argument("--backend", help="an explicit choice (default: the environment, else automatic)")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_check)

    for p in sub.choices.values():
        p.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # vLLM logs to stdout by default; keep stdout for the report (and valid JSON).
    # Set before vLLM is first imported, which configures its logging once.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
