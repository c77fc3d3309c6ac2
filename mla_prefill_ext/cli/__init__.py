"""The command line ``mla-prefill-ext info | select | check | bench``: the parser, the commands, ``main``.

``info`` checks the installation (and says whether the add-on serves MLA prefill on
this platform, and which backends claim a place in automatic selection), ``select``
shows which backend would serve and the automatic order it used, ``check`` runs one
prefill against a float64 reference, or with ``--conformance`` the conformance suite,
``bench`` times backends next to the built-ins that can serve here.
Each command lives in a module of its own and fills one report (``common.Report``),
which ``main`` prints once, as text or as JSON.

Every command answers with a report, never with a traceback: a missing vLLM or
PyTorch, a vLLM version the add-on does not support, a bad setting or a backend
that fails are findings. Exit codes a script can use: 0 all is well, 1 a problem
was found, 2 the check could not run (vLLM or PyTorch missing, or a bad flag,
which also prints the usage line).

This package imports neither vLLM nor PyTorch at import time or while it parses
the command line: each command checks that they import before it uses them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from mla_prefill_ext import _logging
from mla_prefill_ext.cli import bench
from mla_prefill_ext.cli.check import DEFAULT_CHECK_DTYPE, DEFAULT_CHECK_REPEAT, cmd_check
from mla_prefill_ext.cli.common import (
    DTYPES,
    EXIT_CANNOT_CHECK,
    EXIT_FAIL,
    EXIT_OK,
    EXIT_PROBLEM,
    PROG,
    Report,
    add_dims_argument,
    backend_flag_problem,
    describe_exception,
    emit,
    supported_range,
)
from mla_prefill_ext.cli.info import cmd_info
from mla_prefill_ext.cli.select import cmd_select
from mla_prefill_ext.settings import OVERRIDES_PROBLEM_LOG_KEY

__all__ = [
    "EXIT_CANNOT_CHECK",
    "EXIT_FAIL",
    "EXIT_OK",
    "EXIT_PROBLEM",
    "build_parser",
    "main",
]

# The command table: each command fills one report.
COMMANDS: dict[str, Callable[[argparse.Namespace], Report]] = {
    "info": cmd_info,
    "select": cmd_select,
    "check": cmd_check,
    "bench": bench.cmd_bench,
}


class _Parser(argparse.ArgumentParser):
    """argparse's parser; with ``json_errors``, a usage error is also JSON on stdout for scripts."""

    def __init__(self, *args: Any, json_errors: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.json_errors = json_errors

    def error(self, message: str) -> NoReturn:
        if self.json_errors:
            usage = self.format_usage().strip()
            print(json.dumps({"error": message, "usage": usage, "exit_code": EXIT_CANNOT_CHECK}, indent=2))
        super().error(message)  # the usage line and the message on stderr, exit code 2


# Command-line values, checked while parsing (argparse prints the usage line and exits 2)


def _capability_arg(text: str) -> tuple[int, int] | str:
    """``MAJOR.MINOR`` of a CUDA compute capability, or ``cpu``."""
    value = text.strip().lower()
    if value in ("cpu", "none"):
        return "cpu"
    match = re.fullmatch(r"(\d+)\.(\d)", value)
    if match is None or not 1 <= int(match.group(1)) <= 20:
        raise argparse.ArgumentTypeError(
            "expected a CUDA compute capability MAJOR.MINOR with MAJOR from 1 to 20 "
            f"(e.g. 8.0, 9.0, 10.0, 12.0) or 'cpu', got {text!r}"
        )
    return int(match.group(1)), int(match.group(2))


def _whole_number(low: int, high: int | None, what: str) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


_positive_int = _whole_number(1, None, "a whole number of at least 1")
_seed_arg = _whole_number(0, 2**63 - 1, "a whole number from 0 to 2**63 - 1")


# The command line


def _version_line() -> str:
    import mla_prefill_ext

    return f"{PROG} {mla_prefill_ext.__version__} (an add-on for {supported_range()})"


def build_parser(json_errors: bool = False) -> argparse.ArgumentParser:
    """The parser; ``json_errors``: usage errors are also printed as JSON on stdout (``--json``)."""
    parser = _Parser(
        json_errors=json_errors,
        prog=PROG,
        description="Diagnostics for the pluggable MLA prefill backends this add-on brings to "
        f"{supported_range()}.",
        epilog="Exit codes: 0 all is well, 1 a problem was found, 2 the check could not run "
        "(vLLM or PyTorch missing, or a bad flag).",
    )
    parser.add_argument("--version", action="version", version=_version_line())
    sub = parser.add_subparsers(dest="command", required=True, metavar="{info,select,check,bench}")

    sub.add_parser(
        "info",
        json_errors=json_errors,
        help="check the installation: vLLM, the patch, the backend choice, the registrations",
        description="Check the installation: the vLLM version and whether the add-on supports it, "
        "the patch and each of its targets, the backend choice and whether it can serve on this "
        "machine, and every registered backend. Ends with a verdict line.",
        epilog="Exit codes: 0 no problem found, 1 a problem found, 2 cannot check (vLLM or PyTorch missing).",
    )

    p = sub.add_parser(
        "select",
        json_errors=json_errors,
        help="which backend would serve, and why each other would not",
        description="Which MLA prefill backend would serve a model on this machine (or on the "
        "given one), and why each other backend would not.",
        epilog="Exit codes: 0 a backend was selected, 1 none can serve, 2 cannot check.",
    )
    p.add_argument(
        "--capability",
        type=_capability_arg,
        metavar="MAJOR.MINOR|cpu",
        help="the GPU's compute capability, e.g. 9.0 (Hopper) or 10.0 (Blackwell), or 'cpu' "
        "(default: this machine's)",
    )
    p.add_argument(
        "--dtype", default="bfloat16", choices=DTYPES, help="the model's dtype (default: %(default)s)"
    )
    add_dims_argument(p, heads_needed=False)
    p.add_argument(
        "--backend",
        metavar="NAME",
        help="an explicit choice to validate, any case (default: MLA_PREFILL_BACKEND, else automatic)",
    )

    p = sub.add_parser(
        "check",
        json_errors=json_errors,
        help="run one MLA prefill through the selected backend against a float64 reference "
        "(or, with --conformance, the conformance suite)",
        description="Run one MLA prefill (new tokens plus two context chunks, DeepSeek-V2-Lite "
        "sized) through the selected backend and compare it with a float64 reference. With "
        "--conformance, run the conformance suite instead: every property a backend must hold, "
        "each checked on every dtype, MLA head dims and head count the backend can serve.",
        epilog="Exit codes: 0 pass, 1 fail, 2 cannot check.",
    )
    p.add_argument(
        "--backend",
        metavar="NAME",
        help="the backend to run, any case (default: MLA_PREFILL_BACKEND, else automatic); with "
        "--conformance also a class path, pkg.module.Class",
    )
    p.add_argument(
        "--conformance",
        action="store_true",
        help="run the conformance suite (mla_prefill_ext.testing.run_conformance) on the backend "
        "and report each property; --repeat does not apply",
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        help="where to run (default: cuda when PyTorch sees a GPU, else cpu)",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        help=f"the dtype of q, k and v (default: {DEFAULT_CHECK_DTYPE}; with --conformance: each of "
        f"{', '.join(DTYPES)})",
    )
    p.add_argument(
        "--repeat",
        type=_positive_int,
        default=DEFAULT_CHECK_REPEAT,
        metavar="N",
        help="timed runs after one warm-up run; the median is reported (default: %(default)s)",
    )
    p.add_argument(
        "--seed",
        type=_seed_arg,
        default=0,
        metavar="N",
        help="seed of the random inputs (default: %(default)s)",
    )

    bench.add_parser(sub, json_errors)

    for name, p in sub.choices.items():
        p.add_argument("--json", action="store_true", help="print the report as JSON (on stdout)")
        p.add_argument(
            "--debug",
            action="store_true",
            help="show the Python traceback when the command itself fails unexpectedly",
        )
        p.set_defaults(func=COMMANDS[name], parser=p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # --json may come after the flag that is wrong: look for it before parsing.
    args = build_parser(json_errors="--json" in argv).parse_args(argv)
    # vLLM logs to stdout by default; keep stdout for the report (and valid JSON).
    # Set before vLLM is first imported, which configures its logging once.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    # Each command reports an unusable MLA_PREFILL_BACKEND_OVERRIDES itself: the registry's ERROR
    # line, logged when it is imported, would say it a second time.
    _logging.first_time(OVERRIDES_PROBLEM_LOG_KEY)
    try:
        # A bad --backend is refused before a command imports vLLM (seconds), as other bad flags are.
        problem = backend_flag_problem(args)
        if problem is not None:
            args.parser.error(f"argument --backend: {problem}.")
        return emit(args, args.func(args))
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted.", file=sys.stderr)
        return 130
    except Exception as e:
        if args.debug:
            raise
        print(
            f"{PROG} {args.command}: the command failed unexpectedly: {describe_exception(e)}. "
            "Run it again with --debug to see the traceback, and please report it.",
            file=sys.stderr,
        )
        return EXIT_CANNOT_CHECK
