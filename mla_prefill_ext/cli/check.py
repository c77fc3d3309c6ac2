"""``check``: one MLA prefill against a float64 reference, or ``--conformance``: the conformance suite."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from abc import abstractmethod
from dataclasses import dataclass
from typing import Any

from mla_prefill_ext import settings
from mla_prefill_ext.cli.common import (
    DTYPES,
    EXIT_CANNOT_CHECK,
    EXIT_OK,
    EXIT_PROBLEM,
    PROG,
    CannotCheck,
    Report,
    backend_choice,
    cap_json,
    cap_str,
    chosen_automatically,
    describe_exception,
    disabled_lines,
    dtype,
    is_class_path,
    note_unsupported,
    probe_host,
)
from mla_prefill_ext.settings import is_disabled

DEFAULT_CHECK_REPEAT = 5
DEFAULT_CHECK_DTYPE = "bfloat16"  # check's dtype; check --conformance runs every dtype in DTYPES

# The embedded problem: DeepSeek-V2-Lite's MLA prefill (16 heads, qk 128+64, v 128,
# YaRN-scaled softmax scale), three requests, two with cached context in two chunks.
CHECK_NEW_TOKENS = [384, 256, 128]
CHECK_CONTEXT = [1024, 512, 0]
CHECK_CHUNKS = 2
CHECK_HEADS = 16
CHECK_DIMS = (128, 64, 128)


@dataclass
class CheckReport(Report):
    """What every ``check`` report holds: the facts known (device, dtype, backend, ...)."""

    facts: dict[str, Any]

    def text_lines(self) -> list[str]:
        consequence = "this check runs the backend directly; vLLM would not use it while the add-on is off"
        return [*disabled_lines(self.facts["disabled_by_env"], consequence), *self.body_lines()]

    @abstractmethod
    def body_lines(self) -> list[str]:
        """The report's own lines."""


@dataclass
class Stopped(CheckReport):
    """A check that stopped with one message: ``FAIL`` (exit code 1) or ``cannot check`` (2)."""

    message: str
    exit_code: int = EXIT_PROBLEM

    def to_json(self) -> dict[str, Any]:
        return {**self.facts, "ok": False, "error": self.message}

    def body_lines(self) -> list[str]:
        label = "FAIL" if self.exit_code == EXIT_PROBLEM else "cannot check"
        return [f"{label}: {self.message}"]


@dataclass
class PrefillCheck(CheckReport):
    """One prefill through a backend, compared with the float64 reference, and timed."""

    capability: Any
    class_path: str
    source: str
    scale: float
    max_abs_error: float
    mean_abs_error: float
    max_abs_reference: float
    tolerance: float
    finite: bool
    times: list[float]  # seconds, one per timed run
    flops: float

    @property
    def ok(self) -> bool:
        return self.finite and self.max_abs_error <= self.tolerance

    @property
    def exit_code(self) -> int:  # type: ignore[override]
        return EXIT_OK if self.ok else EXIT_PROBLEM

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    def to_json(self) -> dict[str, Any]:
        return {
            **self.facts,
            "ok": self.ok,
            "class": self.class_path,
            "source": self.source,
            "problem": {
                "heads": CHECK_HEADS,
                "dims": list(CHECK_DIMS),
                "scale": self.scale,
                "new_tokens": CHECK_NEW_TOKENS,
                "context_tokens": CHECK_CONTEXT,
                "context_chunks": CHECK_CHUNKS,
            },
            "max_abs_error": self.max_abs_error,
            "mean_abs_error": self.mean_abs_error,
            "max_abs_reference": self.max_abs_reference,
            "tolerance": self.tolerance,
            "time_ms_median": self.median * 1e3,
            "time_ms_all": [t * 1e3 for t in self.times],
            "tflops": self.flops / self.median / 1e12,
            **({} if self.ok else {"next": self.next_step().removeprefix("next: ")}),
        }

    def body_lines(self) -> list[str]:
        f = self.facts
        return [
            f"backend: {f['backend']} ({self.class_path}, {self.source})",
            f"device: {f['device']}, capability {cap_str(self.capability)}, dtype {f['dtype']}",
            f"problem: DeepSeek-V2-Lite MLA prefill, {CHECK_HEADS} heads, qk 128+64, v 128, "
            f"scale {self.scale:.6f}; new tokens {CHECK_NEW_TOKENS}, context {CHECK_CONTEXT} "
            f"in {CHECK_CHUNKS} chunks",
            f"max |error| vs float64 reference: {self.max_abs_error:.3e} (tolerance {self.tolerance:.3e}; "
            f"mean {self.mean_abs_error:.3e}; max |ref| {self.max_abs_reference:.3f})",
            f"time: {self.median * 1e3:.2f} ms median of {len(self.times)} "
            f"({self.flops / self.median / 1e12:.3f} TFLOP/s)",
            "PASS" if self.ok else "FAIL: the output is not within the tolerance of the float64 reference.",
            *([] if self.ok else [self.next_step()]),
        ]

    def next_step(self) -> str:
        """What to run to learn why the output is off (this check compares the output only)."""
        return (
            f"next: run `{PROG} check --backend {self.facts['backend']} --conformance`: it checks each "
            "property on its own (softmax scale, causal mask, LSE base and layout, context chunks, ...) "
            "and names the one that fails"
        )


@dataclass
class ConformanceCheck(CheckReport):
    """The conformance suite's report on one backend, with which backend and why that one."""

    report: Any  # mla_prefill_ext.testing's ConformanceReport

    @property
    def exit_code(self) -> int:  # type: ignore[override]
        return EXIT_OK if self.report.ok else EXIT_PROBLEM

    def to_json(self) -> dict[str, Any]:
        return {**self.report.to_dict(), **self.facts, "get_name": self.report.backend}

    def body_lines(self) -> list[str]:
        name, source = self.facts["backend"], self.facts["source"]
        where = "selected automatically here" if chosen_automatically(source) else f"from {source}"
        named = "" if self.report.backend == name else f"; its get_name() is {self.report.backend}"
        return [f"backend under test: {name} ({where}{named})", self.report.format()]


def cmd_check(args: argparse.Namespace) -> Report:
    host = probe_host(import_vllm=False)
    if host.problems:
        return CannotCheck("check", host)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        args.parser.error(
            "argument --device: cuda was asked for, but PyTorch sees no CUDA GPU here "
            "(torch.cuda.is_available() is False); use --device cpu, or leave --device out."
        )
    host = probe_host()
    if host.problems:
        return CannotCheck("check", host)
    note_unsupported(host)
    if args.conformance:
        return _check_conformance(args, host.vllm_version)
    return _check_prefill(args, host.vllm_version)


def _check_prefill(args: argparse.Namespace, vllm_version: str | None) -> Report:
    """One prefill through the backend in force, against the float64 reference."""
    import torch

    from mla_prefill_ext.selector import MLAPrefillSelectorConfig, current_device_capability, select
    from mla_prefill_ext.testing.problem import deepseek_yarn_scale, make_problem, run_backend

    choice = backend_choice(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dt = dtype(args.dtype or DEFAULT_CHECK_DTYPE)
    cap = current_device_capability() if device == "cuda" else None
    config = MLAPrefillSelectorConfig.from_dims(dt, *CHECK_DIMS)
    facts = {
        "device": device,
        "capability": cap_json(cap),
        "dtype": str(dt).removeprefix("torch."),
        "disabled_by_env": is_disabled(),
    }
    try:
        selection = select(cap, config, choice)
    except (TypeError, ValueError) as e:  # TypeError: a backend's malformed auto_select_claim
        return Stopped(facts, str(e))
    facts["backend"] = selection.name
    scale = deepseek_yarn_scale()
    try:
        problem = make_problem(
            CHECK_NEW_TOKENS,
            CHECK_CONTEXT,
            CHECK_CHUNKS,
            CHECK_HEADS,
            dtype=dt,
            device=device,
            seed=args.seed,
        )
    except Exception as e:  # e.g. vLLM's prefill metadata shaped differently (an unsupported vLLM)
        message = f"the test problem cannot be built with vLLM {vllm_version}: {describe_exception(e)}"
        return Stopped(facts, message, EXIT_CANNOT_CHECK)
    try:
        backend = selection.backend(CHECK_HEADS, scale, 512, *CHECK_DIMS, None)

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
    except Exception as e:  # the backend under test failed: that is the finding
        if getattr(args, "debug", False):  # the finding stays a report; --debug adds where it was raised
            traceback.print_exc(file=sys.stderr)
        return Stopped(facts, f"backend {selection.name} failed: {describe_exception(e)}")
    err = (out.to(torch.float64) - ref).abs()
    ref_max = ref.abs().max().item()
    # Output rounding alone costs half an ulp of the largest value: 2^-9 relative
    # in bf16, 2^-12 in fp16; allow four times that (accumulation order).
    rel_tol = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}.get(dt, 1e-5)
    return PrefillCheck(
        facts=facts,
        capability=cap,
        class_path=f"{selection.backend.__module__}.{selection.backend.__qualname__}",
        source=selection.source,
        scale=scale,
        max_abs_error=err.max().item(),
        mean_abs_error=err.mean().item(),
        max_abs_reference=ref_max,
        tolerance=rel_tol * ref_max,
        finite=bool(torch.isfinite(out).all()),
        times=times,
        flops=problem.flops(),
    )


def _check_conformance(args: argparse.Namespace, vllm_version: str | None) -> Report:
    """``check --conformance``: the conformance suite (mla_prefill_ext.testing) on one backend."""
    import torch

    from mla_prefill_ext.registry import load_backend_class, lookup
    from mla_prefill_ext.selector import MLAPrefillSelectorConfig, current_device_capability, select

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cap = current_device_capability() if device == "cuda" else None
    facts: dict[str, Any] = {
        "mode": "conformance",
        "device": device,
        "capability": cap_json(cap),
        "dtypes": [args.dtype] if args.dtype else list(DTYPES),
        "seed": args.seed,
        "disabled_by_env": is_disabled(),
    }
    overrides_problem = settings.overrides_problem()  # the selector refuses it; so does a named backend
    if overrides_problem is not None:
        return Stopped(facts, overrides_problem)
    # The backend: --backend (a name, checked while parsing, or a class path), else the one the
    # selector picks here (MLA_PREFILL_BACKEND, else automatic) for a DeepSeek-R1 model.
    if args.backend and is_class_path(args.backend):
        name, source, cls = args.backend, "--backend, a class path", None
    elif args.backend:
        name, source, cls = lookup(backend_choice(args).name).name, "--backend", None
    else:
        config = MLAPrefillSelectorConfig.from_dims(dtype(args.dtype or DEFAULT_CHECK_DTYPE), *CHECK_DIMS)
        try:
            selection = select(cap, config, backend_choice(args))
        except (TypeError, ValueError) as e:  # TypeError: a backend's malformed auto_select_claim
            return Stopped(facts, str(e))
        name, source, cls = selection.name, selection.source, selection.backend
    facts.update(backend=name, source=source)
    if cls is None:
        try:
            if is_class_path(name):
                cls = load_backend_class(name.replace(":", "."), name)
            else:
                cls = lookup(name).get_class()
        except Exception as e:  # ImportError/TypeError/ValueError, or whatever the module raises
            error = str(e).rstrip(".")
            if not error.startswith(f"MLA prefill backend {name}"):
                error = f"MLA prefill backend {name} cannot be loaded: {error}"
            return Stopped(facts, error)

    from mla_prefill_ext.testing import run_conformance

    try:
        report = run_conformance(cls, device=device, dtype=args.dtype, seed=args.seed)
    except Exception as e:  # the suite itself failed (a bad backend is reported, never raised)
        message = f"the conformance suite cannot run with vLLM {vllm_version}: {describe_exception(e)}"
        return Stopped(facts, message, EXIT_CANNOT_CHECK)
    return ConformanceCheck(facts, report)
