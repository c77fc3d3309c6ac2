"""What every command shares (mla_prefill_ext/cli/common.py): the host probe, the off-switch note.

Without vLLM or PyTorch: simulated (see tests/helpers/cli_runs.py).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
from cli_runs import ROOT, SUPPORTED, assert_no_traceback, cli_env, finish, run, start

from mla_prefill_ext.versions import INSTALL_SPEC

SLOW_RUNS: dict[str, tuple[list[str], dict[str, str]]] = {
    # The add-on switched off: select and check still answer, and say so.
    "select_disabled_json": (["select", "--json"], {"MLA_PREFILL_EXT_DISABLE": "1"}),
    "check_disabled": (["check", "--repeat", "1"], {"MLA_PREFILL_EXT_DISABLE": "1"}),
}


@pytest.mark.parametrize("hidden", ["vllm,torch", "vllm"])
def test_every_command_without_vllm_says_what_is_missing(harness: Path, hidden: str) -> None:
    env = cli_env(harness, MLA_TEST_HIDE=hidden)
    info = run("info", env=env)
    assert info.returncode == 2, info.stdout + info.stderr
    assert_no_traceback(info)
    assert "vLLM: not installed" in info.stdout
    assert f"vLLM is not installed: this add-on needs {SUPPORTED}." in info.stdout
    assert ("PyTorch is not installed" in info.stdout) == ("torch" in hidden)
    assert info.stdout.rstrip().splitlines()[-1].startswith(f"verdict: cannot check: install {SUPPORTED},")

    if hidden == "vllm,torch":  # each run with PyTorch present pays for importing it: keep those few
        report = json.loads(run("info", "--json", env=env).stdout)
        assert report["verdict"] == "cannot check" and report["exit_code"] == 2
        assert report["vllm_version"] is None and report["supported_range"] == SUPPORTED
        assert any("vLLM is not installed" in f["message"] for f in report["findings"])

    for command in ("select", "check") if hidden == "vllm,torch" else ("check",):
        proc = run(command, env=env)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert_no_traceback(proc)
        assert f"mla-prefill-ext {command} cannot run here:" in proc.stdout
        assert f"vLLM is not installed: this add-on needs {SUPPORTED}." in proc.stdout


def test_importing_the_package_without_vllm(harness: Path) -> None:
    code = textwrap.dedent(
        """
        import sys
        import mla_prefill_ext
        print("imported", "vllm" in sys.modules, "torch" in sys.modules)
        print("dir", "register_mla_prefill_backend" in dir(mla_prefill_ext))
        for name in ("MLAPrefillBackend", "register_mla_prefill_backend", "get_mla_prefill_backend"):
            try:
                getattr(mla_prefill_ext, name)
                print(name, "ok")
            except ModuleNotFoundError as e:
                print(name, "missing", e.name, "|", e)
        """
    )
    lines = {}
    for hidden in ("vllm", "vllm,torch"):
        proc = finish(start(["-c", code], cli_env(harness, MLA_TEST_HIDE=hidden)))
        assert proc.returncode == 0, proc.stderr[-4000:]
        lines[hidden] = proc.stdout.splitlines()
    for out in lines.values():
        assert out[:2] == ["imported False False", "dir True"]
    # PyTorch present: every name loads (none imports vLLM before it is used; the command line looks
    # names up in the registry before it imports vLLM).
    assert lines["vllm"][2:] == [
        "MLAPrefillBackend ok",
        "register_mla_prefill_backend ok",
        "get_mla_prefill_backend ok",
    ]
    # Neither: each name that needs PyTorch says what is missing and which vLLM to install.
    assert lines["vllm,torch"][2].startswith("MLAPrefillBackend missing torch | mla_prefill_ext.")
    assert lines["vllm,torch"][3] == "register_mla_prefill_backend ok"
    assert lines["vllm,torch"][4].startswith("get_mla_prefill_backend missing torch | mla_prefill_ext.")
    for line in (lines["vllm,torch"][2], lines["vllm,torch"][4]):
        assert f"pip install '{INSTALL_SPEC}'" in line
        assert "mla-prefill-ext info" in line


def test_backend_table_script_without_vllm_says_which_python_to_use(harness: Path) -> None:
    proc = finish(
        start(
            [str(ROOT / "scripts" / "backend_table.py"), "--check"],
            cli_env(harness, MLA_TEST_HIDE="vllm,torch"),
        )
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert_no_traceback(proc)
    assert "needs vLLM and PyTorch" in proc.stderr
    assert ".venv/bin/python scripts/backend_table.py --write" in proc.stderr


def test_select_and_check_say_when_the_add_on_is_off(slow: dict[str, Any]) -> None:
    note = (
        "note: the add-on is off (MLA_PREFILL_EXT_DISABLE is set): vLLM runs its stock MLA prefill in "
        "every process; "
    )
    proc = slow["select_disabled_json"]
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    assert report["disabled_by_env"] is True and report["selected"]
    proc = slow["check_disabled"]
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert_no_traceback(proc)
    lines = proc.stdout.splitlines()
    assert lines[0] == note + (
        "this check runs the backend directly; vLLM would not use it while the add-on is off."
    )
    assert lines[-1] == "PASS"
