"""The parser, the command table and ``main`` (mla_prefill_ext/cli/__init__.py): flags, help, usage errors.

No vLLM needed: these runs are fast.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from cli_runs import SUPPORTED, assert_no_traceback, cli_env, run

from mla_prefill_ext import __version__
from mla_prefill_ext.bench.spec import MLADims
from mla_prefill_ext.cli import build_parser


def test_version() -> None:
    proc = run("--version", env=cli_env())
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"mla-prefill-ext {__version__} (an add-on for {SUPPORTED})"


def test_every_flag_has_help_and_the_product_is_the_add_on() -> None:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.choices and isinstance(a.choices, dict)).choices
    assert set(subparsers) == {"info", "select", "check", "bench"}
    for name, sub in subparsers.items():
        for action in sub._actions:
            assert action.help, f"{name} {action.option_strings} has no help"
        assert "shim" not in sub.format_help().lower()
    assert "shim" not in parser.format_help().lower()
    proc = run("check", "--help", env=cli_env())
    assert proc.returncode == 0
    for flag in ("--backend", "--conformance", "--device", "--dtype", "--repeat", "--seed", "--json"):
        assert flag in proc.stdout
    assert "timed runs after one warm-up run" in proc.stdout


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["check", "--repeat", "0"], "argument --repeat: expected a whole number of at least 1, got '0'"),
        (["check", "--repeat", "many"], "argument --repeat"),
        (["check", "--seed", "-1"], "argument --seed"),
        (["check", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
        (["check", "--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
        (["check", "--conformance", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
        (["check", "--conformance", "--seed", "x"], "argument --seed"),
        (["select", "--capability", "99.9"], "argument --capability: expected a CUDA compute capability"),
        (["select", "--capability", "9"], "argument --capability"),
        (["select", "--capability", "0.5"], "argument --capability"),
        (["select", "--dims", "0,0,0"], "argument --dims: expected a preset (r1, r1-tp1, v2-lite) or four"),
        (["select", "--dims", "128,64"], "argument --dims"),
        (["info", "--verbose"], "unrecognized arguments: --verbose"),
        ([], "the following arguments are required"),
    ],
)
def test_bad_flags_print_the_usage_line_and_exit_2(args: list[str], says: str) -> None:
    proc = run(*args, env=cli_env())
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("usage: mla-prefill-ext"), proc.stderr
    assert says in proc.stderr
    assert_no_traceback(proc)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["select", "--capability", "99.9", "--json"], "argument --capability: expected a CUDA"),
        (["select", "--json", "--dims", "1,2"], "argument --dims: expected a preset"),
        (["info", "--json", "--verbose"], "unrecognized arguments: --verbose"),
        (["check", "--json", "--repeat", "0"], "argument --repeat: expected a whole number of at least 1"),
    ],
)
def test_with_json_a_usage_error_is_json_on_stdout(args: list[str], says: str) -> None:
    """Scripts parse stdout: a usage error there is JSON too (and the usage line stays on stderr)."""
    proc = run(*args, env=cli_env())
    assert proc.returncode == 2, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["error"].startswith(says) and report["exit_code"] == 2
    # The usage line argparse prints on stderr (the subcommand's, or the program's where it gives that).
    assert report["usage"].startswith("usage: mla-prefill-ext") and proc.stderr.startswith(report["usage"])
    assert says in proc.stderr
    assert_no_traceback(proc)


# --dims: one format for select and bench


def _dims_action(command: str) -> object:
    sub = next(a for a in build_parser()._actions if isinstance(a.choices, dict)).choices[command]
    return next(a for a in sub._actions if "--dims" in a.option_strings)


def test_select_and_bench_take_dims_in_one_format() -> None:
    """One parser: a preset or NOPE,ROPE,V,HEADS in both; select, whose choice does not depend
    on the head count, also takes NOPE,ROPE,V."""
    parser = build_parser()
    for command in ("select", "bench"):
        assert parser.parse_args([command, "--dims", "r1-tp1"]).dims == MLADims(128, 64, 128, 128, "r1-tp1")
        assert parser.parse_args([command, "--dims", "64,32,64,8"]).dims == MLADims(64, 32, 64, 8)
        assert parser.parse_args([command]).dims == MLADims(128, 64, 128, 16, "r1")
    assert parser.parse_args(["select", "--dims", "64,32,64"]).dims[:3] == (64, 32, 64)
    select, bench = _dims_action("select"), _dims_action("bench")
    assert select.metavar == bench.metavar == "PRESET|NOPE,ROPE,V,HEADS"
    assert select.type.__qualname__ == bench.type.__qualname__  # the one parser, not two
    assert bench.help in select.help  # the same words; select's add that it takes three numbers too


def test_bench_refuses_three_dims_saying_it_needs_the_head_count() -> None:
    proc = run("bench", "--dims", "128,64,128", env=cli_env())
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (
        "argument --dims: '128,64,128' gives no head count: bench needs four numbers "
        "qk_nope,qk_rope,v,heads, heads as one GPU sees them (e.g. 128,64,128,16)"
    ) in proc.stderr
    assert_no_traceback(proc)


# --backend: checked against the registry before vLLM is imported (vLLM hidden here: if a command
# imported it first, it would answer "cannot run here" instead of the usage error)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["select", "--backend", "NOPE"], "argument --backend: Unknown MLA prefill backend: 'NOPE'. "),
        (
            ["bench", "--backend", "TORCH_SDPA,NOPE"],
            "argument --backend: Unknown MLA prefill backend: 'NOPE'",
        ),
        (
            ["check", "--backend", "nope"],
            "Valid options are: FLASH_ATTN, FLASHINFER, TRTLLM_RAGGED, TORCH_SDPA, CUSTOM (check "
            "--conformance also takes a class path, pkg.module:Class).",
        ),
        (["check", "--conformance", "--backend", "pkg.mod:"], "class path 'pkg.mod.' is not of the form"),
    ],
)
def test_a_bad_backend_is_refused_before_vllm_is_imported(harness: Path, args: list[str], says: str) -> None:
    proc = run(*args, env=cli_env(harness, MLA_TEST_HIDE="vllm,torch"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("usage: mla-prefill-ext"), proc.stderr
    assert says in proc.stderr
    assert "cannot run here" not in proc.stdout
    assert_no_traceback(proc)


def test_names_registered_in_the_environment_or_installed_pass_that_check(harness: Path) -> None:
    """Overrides and installed packages' entry points are found without vLLM: the command runs on
    (and says here that vLLM is missing)."""
    env = cli_env(harness, MLA_TEST_HIDE="vllm,torch", MLA_PREFILL_BACKEND_OVERRIDES='{"MINE": "a.b.C"}')
    env["PYTHONPATH"] = os.pathsep.join([str(harness / "claim_packages"), env["PYTHONPATH"]])
    for args in (["select", "--backend", "mine"], ["bench", "--backend", "DEMO_CLAIM,torch_sdpa"]):
        proc = run(*args, env=env)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "cannot run here" in proc.stdout and "usage:" not in proc.stderr, proc.stdout + proc.stderr


@pytest.mark.parametrize("command", ["check", "select", "bench"])
def test_a_class_path_where_a_name_is_needed_says_where_a_class_path_goes(command: str) -> None:
    proc = run(command, "--backend", "pkg.mod:Cls", env=cli_env())
    assert proc.returncode == 2, proc.stdout + proc.stderr
    takes = "unless --conformance is given" if command == "check" else "a class path is taken only by"
    assert f"argument --backend: 'pkg.mod:Cls' is a class path; {command} takes a backend name" in proc.stderr
    assert takes in proc.stderr
    assert (
        "`mla-prefill-ext check --conformance --backend pkg.mod:Cls` runs the conformance suite"
        in proc.stderr
    )
    assert """MLA_PREFILL_BACKEND_OVERRIDES='{"CUSTOM": "pkg.mod.Cls"}' in the environment""" in proc.stderr
    assert "then --backend CUSTOM" in proc.stderr
    assert "Unknown MLA prefill backend" not in proc.stderr
    assert_no_traceback(proc)
