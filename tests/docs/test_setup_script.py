"""scripts/setup.sh prints its stages and pip's progress; pip's own output goes to a log it names.

The script runs in a copy of the repository's layout whose ``.venv/bin/python`` is this
interpreter (so it is reused, as on a second run), with pip cut off from every package source
(``PIP_NO_INDEX``, no configuration, no links): the requirements are ones pip finds installed
already, or one it cannot find, and nothing can be installed or upgraded.
"""

from __future__ import annotations

import os
import pty
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_setup(repo: Path, requirements: str) -> subprocess.CompletedProcess[str]:
    (repo / "scripts").mkdir(parents=True, exist_ok=True)
    for name in ("setup.sh", "pip_progress.py"):
        shutil.copy(ROOT / "scripts" / name, repo / "scripts" / name)
    (repo / "requirements-dev.txt").write_text(requirements)
    python = repo / ".venv" / "bin" / "python"
    if not python.exists():
        python.parent.mkdir(parents=True)
        python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
        python.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_NO_INDEX="1", PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return subprocess.run(
        ["bash", str(repo / "scripts" / "setup.sh")], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.mark.vllm_patch  # scripts/setup.sh's environment is vLLM 0.20.2's
def test_setup_prints_its_stages_and_logs_pips_output(tmp_path: Path) -> None:
    log = tmp_path / ".venv" / "setup.log"
    for run in (1, 2):  # idempotent: the second run reuses everything, as the first did
        proc = run_setup(tmp_path, "wrapt\n")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        lines = proc.stdout.splitlines()
        assert [line[:9] for line in lines if line.startswith("==> [")] == [
            f"==> [{i}/4]" for i in range(1, 5)
        ], run
        assert "Reusing the virtual environment .venv" in lines[0]
        assert any(line.startswith("    vLLM 0.20.2 | mla-prefill-ext ") for line in lines)
        assert f"(pip's output: {log.relative_to(tmp_path)})" in proc.stdout
        assert len(lines) <= 13 and proc.stderr == ""  # 9, and a done line per stage off a terminal
        # pip's chatter is in the log, of this run only.
        text = log.read_text()
        assert text.count("Requirement already satisfied: wrapt") == 1
        assert "Requirement already satisfied" not in proc.stdout


def test_a_failing_install_shows_the_end_of_the_log(tmp_path: Path) -> None:
    proc = run_setup(tmp_path, "no-such-distribution-for-this-test==1\n")
    assert proc.returncode == 1
    assert "==> [3/4]" in proc.stdout and "==> [4/4]" not in proc.stdout
    log = tmp_path / ".venv" / "setup.log"
    assert f"pip install -r requirements-dev.txt failed. The last lines of its log, {log}:" in proc.stderr
    assert "No matching distribution found for no-such-distribution-for-this-test==1" in proc.stderr


PIP_OUTPUT = """\
Collecting vllm==0.20.2 (from -r requirements-dev.txt (line 4))
  Downloading vllm-0.20.2-cp38-abi3-manylinux1_x86_64.whl.metadata (15 kB)
Collecting torch==2.11.0 (from vllm==0.20.2)
  Downloading https://example.org/torch-2.11.0-cp311-none-linux_x86_64.whl (900.0 MB)
Progress 0 of 900000000
Progress 450000000 of 900000000
Progress 900000000 of 900000000
Installing collected packages: torch, vllm
Successfully installed torch-2.11.0 vllm-0.20.2
"""


def test_pip_progress_on_a_terminal_and_the_rest_in_the_log(tmp_path: Path) -> None:
    log = tmp_path / "setup.log"
    script = ROOT / "scripts" / "pip_progress.py"
    controller, terminal = pty.openpty()
    command = [sys.executable, str(script), str(log)]
    with subprocess.Popen(command, stdin=subprocess.PIPE, stdout=terminal) as p:
        p.communicate(PIP_OUTPUT.encode(), timeout=60)
    os.close(terminal)
    shown = b""
    while chunk := _read(controller):
        shown += chunk
    os.close(controller)
    statuses = [s.strip() for s in shown.decode().split("\r\x1b[K") if s.strip()]
    assert statuses == [
        "collecting vllm==0.20.2",
        "downloading vllm-0.20.2-cp38-abi3-manylinux1_x86_64.whl.metadata",
        "collecting torch==2.11.0",
        "downloading torch-2.11.0-cp311-none-linux_x86_64.whl",
        "downloading torch-2.11.0-cp311-none-linux_x86_64.whl: 0 of 900 MB",
        "downloading torch-2.11.0-cp311-none-linux_x86_64.whl: 450 of 900 MB",
        "downloading torch-2.11.0-cp311-none-linux_x86_64.whl: 900 of 900 MB",
        "installing 2 packages",
    ]
    assert shown.endswith(b"\r\x1b[K")  # the status line is cleared at the end
    assert log.read_text() == "".join(
        line + "\n" for line in PIP_OUTPUT.splitlines() if not line.startswith("Progress ")
    )
    # Off a terminal nothing is shown; the log gets the same.
    command[-1] = str(tmp_path / "off.log")
    off = subprocess.run(command, input=PIP_OUTPUT, capture_output=True, text=True)
    assert off.returncode == 0 and off.stdout == "" and (tmp_path / "off.log").read_text() == log.read_text()


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 4096)
    except OSError:  # the terminal's other end is closed: all was read
        return b""


# Off a terminal, scripts/setup.sh says when each stage is done and how long it took.
DONE = re.compile(r"^    \[(\d)/4\] done in (\d+) s$")


def test_each_finished_stage_is_one_line_with_its_time_off_a_terminal(tmp_path: Path) -> None:
    proc = run_setup(tmp_path, "wrapt\n")  # stdout is a pipe here, as in CI
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    done = [(i, DONE.match(line)) for i, line in enumerate(lines) if DONE.match(line)]
    assert [m.group(1) for _, m in done] == ["1", "2", "3", "4"], proc.stdout
    starts = [i for i, line in enumerate(lines) if line.startswith("==> [")]
    # Each stage's done line comes after its own start line and before the next stage starts.
    for (at, _), start, next_start in zip(done, starts, [*starts[1:], len(lines)], strict=True):
        assert start < at < next_start, proc.stdout
    assert lines[-3].startswith("Done")


def test_a_failing_stage_has_no_done_line(tmp_path: Path) -> None:
    proc = run_setup(tmp_path, "no-such-distribution-for-this-test==1\n")
    assert proc.returncode == 1
    assert [m.group(1) for m in map(DONE.match, proc.stdout.splitlines()) if m] == ["1", "2"]
