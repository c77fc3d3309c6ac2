"""What every command shares: exit codes, the host probe, findings, the report and its output."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, NamedTuple

from mla_prefill_ext.value_types import AUTOMATIC  # the source of a selection no setting made

EXIT_OK, EXIT_PROBLEM, EXIT_CANNOT_CHECK = 0, 1, 2
EXIT_FAIL = EXIT_PROBLEM  # older name

PROG = "mla-prefill-ext"
DTYPES = ("bfloat16", "float16", "float32")


# The report every command fills, rendered once


class Report(ABC):
    """What a command found: rendered once, as text lines or as one JSON object."""

    exit_code: int

    @abstractmethod
    def to_json(self) -> dict[str, Any]:
        """The JSON object ``--json`` prints."""

    @abstractmethod
    def text_lines(self) -> list[str]:
        """The lines printed without ``--json``."""


def emit(args: argparse.Namespace, report: Report) -> int:
    """Print the report on stdout, as JSON with ``--json``; its exit code."""
    if args.json:
        print(json.dumps(report.to_json(), indent=2, default=str))
    else:
        print("\n".join(report.text_lines()))
    return report.exit_code


class Finding(NamedTuple):
    level: str  # "problem" or "note"
    message: str


# vLLM and PyTorch: present and importable?


def supported_range() -> str:
    from mla_prefill_ext.versions import SUPPORTED_TEXT

    return SUPPORTED_TEXT


def install_hint() -> str:
    from mla_prefill_ext.versions import INSTALL_SPEC, TESTED

    return (
        f"install {supported_range()}, which brings PyTorch (tested: {', '.join(TESTED)}; the newest "
        f"tested: pip install '{INSTALL_SPEC}')"
    )


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _import_error(module: str) -> str | None:
    """Why ``module`` cannot be imported (None: it imports)."""
    try:
        importlib.import_module(module)
    except Exception as e:  # ImportError, or a broken install (e.g. OSError from a shared library)
        return f"{type(e).__name__}: {e}"
    return None


class Host(NamedTuple):
    """What the add-on runs on: versions, and why vLLM or PyTorch cannot be used."""

    vllm_version: str | None
    torch_version: str | None
    problems: list[str]  # non-empty: nothing can be checked


def probe_host(import_vllm: bool = True) -> Host:
    """Versions of vLLM and PyTorch, and whether they import (vLLM only when asked: ~5 s)."""
    from mla_prefill_ext.versions import installed_vllm_version

    vllm_version = installed_vllm_version()
    torch_version = _dist_version("torch")
    problems = []
    torch_error = _import_error("torch")
    if torch_error is None:
        import torch

        torch_version = torch.__version__
    elif torch_version is None:
        problems.append(f"PyTorch is not installed ({torch_error}).")
    else:
        problems.append(f"PyTorch {torch_version} is installed but cannot be imported ({torch_error}).")
    if vllm_version is None:
        problems.append(f"vLLM is not installed: this add-on needs {supported_range()}.")
    elif import_vllm and torch_error is None:
        vllm_error = _import_error("vllm")
        if vllm_error is not None:
            problems.append(f"vLLM {vllm_version} is installed but cannot be imported ({vllm_error}).")
    return Host(vllm_version, torch_version, problems)


@dataclass
class CannotCheck(Report):
    """A command that cannot run here because vLLM or PyTorch is missing or broken (exit code 2).

    ``info`` keeps its doctor's header (versions, findings); ``select`` and ``check`` say
    that they cannot run.
    """

    command: str
    host: Host
    exit_code: int = EXIT_CANNOT_CHECK

    def _about(self) -> dict[str, Any]:
        if self.command != "info":
            return {"ok": False}
        import platform

        import mla_prefill_ext
        from mla_prefill_ext.versions import decide

        version = self.host.vllm_version
        return {
            "package_version": mla_prefill_ext.__version__,
            "python_version": platform.python_version(),
            "vllm_supported": version is not None and decide(version).reason is None,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            **self._about(),
            "vllm_version": self.host.vllm_version,
            "torch_version": self.host.torch_version,
            "supported_range": supported_range(),
            "findings": [{"level": "problem", "message": p} for p in self.host.problems],
            "verdict": "cannot check",
            "exit_code": self.exit_code,
        }

    def text_lines(self) -> list[str]:
        verdict = f"verdict: cannot check: {install_hint()}, then run `{PROG} info` again."
        if self.command != "info":
            return [
                f"{PROG} {self.command} cannot run here:",
                *(f"  {p}" for p in self.host.problems),
                verdict,
            ]
        return [
            header(),
            f"vLLM: {self.host.vllm_version or 'not installed'} (the add-on supports {supported_range()})",
            f"PyTorch: {self.host.torch_version or 'not installed'}",
            "findings:",
            *(f"  PROBLEM  {p}" for p in self.host.problems),
            verdict,
        ]


def header() -> str:
    """``mla-prefill-ext 0.1.0 (Python 3.12.3)``: the first line of ``info``."""
    import platform

    import mla_prefill_ext

    return f"{PROG} {mla_prefill_ext.__version__} (Python {platform.python_version()})"


def chosen_automatically(source: str) -> bool:
    """Whether a selection's or a choice's source is automatic selection (no setting chose)."""
    return source == AUTOMATIC  # == rather than is: a source may come as a plain string


def disabled_lines(disabled: bool, consequence: str) -> list[str]:
    """The note select and check print first when the add-on is off (none when it is on)."""
    if not disabled:
        return []
    from mla_prefill_ext.settings import DISABLE_ENV

    return [
        f"note: the add-on is off ({DISABLE_ENV} is set): vLLM runs its stock MLA prefill in every "
        f"process; {consequence}."
    ]


def note_unsupported(host: Host) -> None:
    """select and check still run on an unsupported vLLM (vLLM's own code is not used): say so."""
    from mla_prefill_ext.versions import decide

    reason = decide(host.vllm_version).reason
    if reason is not None:
        print(f"note: {reason}; the add-on would not serve it. `{PROG} info` says more.", file=sys.stderr)


def describe_exception(e: BaseException) -> str:
    """``Type: message (at file:line)`` of the innermost frame, for a one-line report."""
    import traceback

    frames = traceback.extract_tb(e.__traceback__)
    where = f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    return f"{type(e).__name__}: {e}{where}"


# Devices, dtypes, dims and the backend choice, from parsed flags


def cap_str(cap: Any) -> str:
    return "none (no GPU)" if cap is None else f"{cap.major}.{cap.minor}"


def cap_json(cap: Any) -> str | None:
    return None if cap is None else f"{cap.major}.{cap.minor}"


def capability(value: tuple[int, int] | str | None) -> Any:
    """The DeviceCapability for a parsed ``--capability`` (None: no GPU)."""
    from vllm.platforms.interface import DeviceCapability

    from mla_prefill_ext.selector import current_device_capability

    if value is None:
        return current_device_capability()
    if value == "cpu":
        return None
    return DeviceCapability(*value)


def dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def add_dims_argument(parser: argparse.ArgumentParser, heads_needed: bool) -> None:
    """``--dims``, one format for select and bench (``heads_needed``: bench, which times heads)."""
    from mla_prefill_ext.bench.spec import DEFAULT_DIMS, DIMS_METAVAR, DIMS_PRESETS, dims_help, parse_dims

    def dims_arg(text: str) -> Any:
        try:
            return parse_dims(text, heads_needed)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parser.add_argument(
        "--dims",
        type=dims_arg,
        default=DIMS_PRESETS[DEFAULT_DIMS],
        metavar=DIMS_METAVAR,
        help=dims_help(heads_needed),
    )


def is_class_path(text: str) -> bool:
    """``pkg.module.Class`` or ``pkg.module:Class`` (a backend name is an identifier)."""
    return "." in text or ":" in text


def backend_flag_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with ``--backend`` (None: nothing), found without importing vLLM (4-5 s).

    The names are the registry's: the built-ins, those registered in the overrides variable and
    the installed backend packages' (a scan of the installed packages' metadata, milliseconds).
    A class path is syntax alone: only ``check --conformance`` loads one, and loading needs vLLM.
    """
    names = [n.strip() for item in _as_list(getattr(args, "backend", None)) for n in item.split(",")]
    names = [n for n in names if n]
    if not names:
        return None
    from mla_prefill_ext.class_paths import validate_class_path
    from mla_prefill_ext.registry import lookup
    from mla_prefill_ext.settings import OVERRIDES_ENV, overrides_problem

    check, conformance = args.command == "check", getattr(args, "conformance", False)
    for name in names:
        if is_class_path(name):
            dotted = name.replace(":", ".")
            if conformance:
                try:
                    validate_class_path(name, dotted)
                except (TypeError, ValueError) as e:
                    return f"{e}; write it as pkg.module:Class or pkg.module.Class"
                continue
            takes = (
                "takes a backend name unless --conformance is given"
                if args.command == "check"
                else ("takes a backend name; a class path is taken only by check --conformance")
            )
            return (
                f"{name!r} is a class path; {args.command} {takes}: `{PROG} check --conformance --backend "
                f"{name}` runs the conformance suite on that class. To check, select or bench it by name, "
                f'register it first: {OVERRIDES_ENV}=\'{{"CUSTOM": "{dotted}"}}\' in the environment, '
                "then --backend CUSTOM (or install it as a package with an entry point in the group "
                "mla_prefill_ext.backends)"
            )
        try:
            lookup(name)  # a miss scans the installed backend packages first
        except ValueError as e:
            hints = [" (check --conformance also takes a class path, pkg.module:Class)"] if check else []
            if overrides_problem() is not None:
                hints.append(f"; {OVERRIDES_ENV}, which may register more names, cannot be used")
            return f"{str(e).rstrip('.')}{''.join(hints)}"
    return None


def _as_list(value: Any) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def backend_choice(args: argparse.Namespace) -> Any:
    """The choice in force: ``--backend`` (an unknown name is a usage error), else the environment."""
    from mla_prefill_ext.registry import lookup
    from mla_prefill_ext.selector import Choice, requested_choice

    if not args.backend:
        return requested_choice(None)
    try:
        lookup(args.backend)
    except ValueError as e:
        args.parser.error(f"argument --backend: {e}.")
    return Choice(args.backend, "--backend", True)


def claim_text(claim: dict[str, Any]) -> str:
    """``claim: 9.x, cpu; before FLASH_ATTN`` (as select and info show it)."""
    return f"claim: {', '.join(claim['capabilities'])}; before {claim['before']}"
