"""``bench``: a backend's speed next to the built-ins that can serve here, at a model's MLA prefill shapes."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from mla_prefill_ext import settings
from mla_prefill_ext.bench.spec import (
    DEFAULT_SHAPES,
    SHAPE_SETS,
    BenchShape,
    MLADims,
    parse_shapes,
)
from mla_prefill_ext.cli.bench_report import BenchReport, BenchStopped
from mla_prefill_ext.cli.common import (
    DTYPES,
    EXIT_CANNOT_CHECK,
    PROG,
    CannotCheck,
    Report,
    add_dims_argument,
    backend_choice,
    cap_json,
    chosen_automatically,
    describe_exception,
    dtype,
    note_unsupported,
    probe_host,
)
from mla_prefill_ext.settings import is_disabled

DEFAULT_BENCH_REPEAT = 10
DEFAULT_BENCH_WARMUP = 2


# Command-line values, checked while parsing (argparse prints the usage line and exits 2)


def _shapes_arg(text: str) -> list[BenchShape]:
    try:
        return parse_shapes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _count_arg(low: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"expected a whole number of at least {low}, got {text!r}")
        return value

    return parse


def add_parser(sub: Any, json_errors: bool) -> argparse.ArgumentParser:
    """``bench``'s subparser (``--json`` and ``--debug`` are added with every command's)."""
    shape_sets = "; ".join(f"{n}: {' '.join(s.label for s in v)}" for n, v in SHAPE_SETS.items())
    p = sub.add_parser(
        "bench",
        json_errors=json_errors,
        help="time a backend next to the built-ins that can serve here, at a model's MLA dims",
        description="Time MLA prefill backends next to every built-in that can serve this device: "
        "each prefill shape is one step (new tokens, then each context chunk) called as the "
        "installed vLLM calls a prefill backend, timed as the median of repetitions after warm-up "
        "with the device synchronised, and reported as time, TFLOP/s and the ratio to the fastest "
        "built-in on that shape.",
        epilog="Exit codes: 0 every backend under test ran every shape, 1 one could not (it cannot "
        "serve this device, dtype or dims, or it raised), 2 cannot check (or a bad flag).",
    )
    p.add_argument(
        "--backend",
        action="append",
        metavar="NAME[,NAME...]",
        help="a backend to time, any case (repeatable, or a comma list; default: MLA_PREFILL_BACKEND, "
        "else the one automatic selection picks here)",
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        help="where to run (default: cuda when PyTorch sees a GPU, else cpu)",
    )
    p.add_argument(
        "--dtype", default="bfloat16", choices=DTYPES, help="q, k and v's dtype (default: %(default)s)"
    )
    add_dims_argument(p, heads_needed=True)
    p.add_argument(
        "--shapes",
        type=_shapes_arg,
        default=SHAPE_SETS[DEFAULT_SHAPES],
        metavar="SET|SPEC[,...]",
        help="the prefill steps: shape sets or specs SEQSxNEW[+CONTEXT[/CHUNKS]] (SEQS sequences of "
        "NEW new tokens, each after CONTEXT cached tokens in CHUNKS chunks), comma-separated "
        f"(default: {DEFAULT_SHAPES}). Sets: {shape_sets}",
    )
    p.add_argument(
        "--repeat",
        type=_count_arg(1),
        default=DEFAULT_BENCH_REPEAT,
        metavar="N",
        help="timed repetitions per backend and shape; the median is reported (default: %(default)s)",
    )
    p.add_argument(
        "--warmup",
        type=_count_arg(1),
        default=DEFAULT_BENCH_WARMUP,
        metavar="N",
        help="untimed steps before the repetitions, the first checked call by call (default: %(default)s)",
    )
    p.add_argument(
        "--seed", type=_count_arg(0), default=0, metavar="N", help="seed of the random inputs (default: 0)"
    )
    return p


# The command


def _describe_calls(convention: Any) -> str:
    from mla_prefill_ext.testing.conventions.bridged import BridgedConvention

    if isinstance(convention, BridgedConvention):
        return "backends called as vLLM calls its own (bridged: keyword calls through the add-on's adapter)"
    return "backends called as the patched vLLM calls them (positional calls, context chunks by index)"


def cmd_bench(args: argparse.Namespace) -> Report:
    host = probe_host(import_vllm=False)
    if host.problems:
        return CannotCheck("bench", host)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        args.parser.error(
            "argument --device: cuda was asked for, but PyTorch sees no CUDA GPU here "
            "(torch.cuda.is_available() is False); use --device cpu, or leave --device out."
        )
    host = probe_host()
    if host.problems:
        return CannotCheck("bench", host)
    note_unsupported(host)
    from mla_prefill_ext.bench.run import Candidate, run_bench
    from mla_prefill_ext.registry import lookup, registered_backends
    from mla_prefill_ext.selector import (
        MLAPrefillSelectorConfig,
        check_backend,
        current_device_capability,
        select,
    )
    from mla_prefill_ext.testing.conventions.bridged import installed_vllm_convention
    from mla_prefill_ext.testing.problem import deepseek_yarn_scale

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cap = current_device_capability() if device == "cuda" else None
    dims: MLADims = args.dims
    dt = dtype(args.dtype)
    config = MLAPrefillSelectorConfig.from_dims(dt, *dims[:3])
    convention = installed_vllm_convention()
    facts: dict[str, Any] = {
        "device": device,
        "capability": cap_json(cap),
        "dtype": args.dtype,
        "vllm_version": host.vllm_version,
        "calls": _describe_calls(convention),
        "repeat": args.repeat,
        "warmup": args.warmup,
        "seed": args.seed,
        "disabled_by_env": is_disabled(),
    }
    where = (
        f"{'no GPU' if cap is None else f'compute capability {cap.major}.{cap.minor}'}, dtype {args.dtype}, "
        f"MLA dims {dims.label}"
    )

    # An invalid overrides variable would leave a named backend unregistered or pointing elsewhere:
    # refused here as the selector refuses it, with the variable, the parse error and the right form.
    overrides_problem = settings.overrides_problem()
    if overrides_problem is not None:
        return BenchStopped(facts, overrides_problem)

    # The backends under test: --backend (an unknown name is a usage error), else the one in force.
    names = [n.strip() for item in args.backend or [] for n in item.split(",") if n.strip()]
    sources: dict[str, str] = {}
    for name in names:
        try:
            sources.setdefault(lookup(name).name, "--backend")
        except ValueError as e:
            args.parser.error(f"argument --backend: {e}.")
    if not names:
        try:
            selection = select(cap, config, backend_choice(args))
        except (TypeError, ValueError) as e:
            return BenchStopped(facts, str(e))
        auto = chosen_automatically(selection.source)
        sources[selection.name] = "selected automatically here" if auto else f"from {selection.source}"
    candidates: list[Any] = []
    for name in sources:
        member = lookup(name)
        cls, reasons = check_backend(member, cap, config)
        if cls is None or reasons:
            verb = "cannot be loaded" if cls is None else f"cannot serve here ({where})"
            return BenchStopped(facts, f"MLA prefill backend {name} {verb}: {'; '.join(reasons)}")
        candidates.append(Candidate(name, cls, under_test=True, builtin=_is_builtin(member)))

    # The built-ins that can serve here (the reference for every ratio); why each other cannot.
    left_out: dict[str, list[str]] = {}
    for member, path in registered_backends():
        if path is None or not _is_builtin(member):
            continue
        cls, reasons = check_backend(member, cap, config)
        if cls is None or reasons:
            left_out[member.name] = reasons
        elif member.name not in sources:
            candidates.append(Candidate(member.name, cls, under_test=False, builtin=True))

    scale = deepseek_yarn_scale(dims.qk_nope_head_dim + dims.qk_rope_head_dim)
    progress = _progress if sys.stderr.isatty() else None
    try:
        rows = run_bench(
            candidates,
            args.shapes,
            dims,
            dt,
            device,
            convention,
            args.repeat,
            args.warmup,
            args.seed,
            progress,
        )
    except Exception as e:  # the benchmark itself failed (a failing backend is a row, never raised)
        message = f"the benchmark cannot run with vLLM {host.vllm_version}: {describe_exception(e)}"
        return BenchStopped(facts, message, EXIT_CANNOT_CHECK)
    return BenchReport(facts, cap, dims, scale, candidates, sources, left_out, rows, list(args.shapes))


def _is_builtin(member: Any) -> bool:
    """A backend the add-on ships, not replaced by an override (CUSTOM and registered names are not)."""
    return member.value is not None and not member.is_overridden()


def _progress(text: str) -> None:
    print(f"{PROG} bench: {text}", file=sys.stderr, flush=True)
