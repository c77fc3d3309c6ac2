"""Off a terminal, scripts/setup.sh says when each stage is done and how long it took."""

from __future__ import annotations

import re
from pathlib import Path

from test_setup_script import run_setup

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
