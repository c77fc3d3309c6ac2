"""Which worker wrote a log line (tests/gpu/recorded_runs.py), on lines shaped as the TP=2 runs wrote them."""

from __future__ import annotations

from tests.gpu import recorded_runs

OFF = "MLA shared-prefix prefill (mla-prefill-ext): off (turned off by MLA_PREFILL_SHARED_PREFIX)."
ON = "MLA shared-prefix prefill (mla-prefill-ext): on (shared cached prefixes of a step's prefill requests)."
INFO = "INFO 12-04 17:32:39 [_logging.py:30] "


def test_one_worker_per_line():
    log = f"(Worker_TP0 pid=11) {INFO}{ON}\n(Worker_TP1 pid=12) {INFO}{ON}\n"
    assert recorded_runs.worker_pids_in(log, ON) == {11, 12}
    assert recorded_runs.worker_pids_in(log, OFF) == set()


def test_two_workers_writing_at_once():
    """vLLM 0.25.1, TP=2 with multiprocessing: TP0's prefix, TP1's whole line, then TP0's message alone."""
    log = (
        f"(EngineCore pid=9) {INFO}something else\n"
        f"(Worker_TP0 pid=11) (Worker_TP1 pid=12) {INFO}{OFF}\n"
        f"{INFO}{OFF}\n"
    )
    assert recorded_runs.worker_messages(log)[-2:] == [(12, f" {INFO}{OFF}"), (11, f"{INFO}{OFF}")]
    assert recorded_runs.worker_pids_in(log, OFF) == {11, 12}


def test_an_interleaved_prefix_takes_the_next_unprefixed_line():
    """Which message is whose cannot be known; the innermost prefix's comes first (a convention)."""
    log = f"(Worker_TP0 pid=11) (Worker_TP1 pid=12) {INFO}{OFF}\n{INFO}{ON}\n"
    assert recorded_runs.worker_pids_in(log, OFF) == {12}
    assert recorded_runs.worker_pids_in(log, ON) == {11}


def test_only_the_line_right_after_an_interleaved_one_is_a_workers():
    """An engine core's line in between, or a driver's line further on, is nobody's worker message."""
    core_between = (
        f"(Worker_TP0 pid=11) (Worker_TP1 pid=12) {INFO}{ON}\n(EngineCore pid=9) {INFO}{OFF}\n{INFO}{OFF}\n"
    )
    assert recorded_runs.worker_pids_in(core_between, OFF) == set()
    later = f"(Worker_TP0 pid=11) (Worker_TP1 pid=12) {INFO}{ON}\n{INFO}{ON}\n{INFO}driver: {OFF}\n"
    assert recorded_runs.worker_pids_in(later, ON) == {11, 12}
    assert recorded_runs.worker_pids_in(later, OFF) == set()
    worker_between = (
        f"(Worker_TP0 pid=11) (Worker_TP1 pid=12) {INFO}{ON}\n(Worker_TP1 pid=12) {INFO}x\n{INFO}{OFF}\n"
    )
    assert recorded_runs.worker_pids_in(worker_between, OFF) == set()


def test_rays_nested_prefixes_are_one_writer():
    log = (
        f"(EngineCore pid=7253) \x1b[36m(RayWorkerProc pid=7327)\x1b[0m (Worker_TP0 pid=7327) {INFO}{OFF}\n"
        f"(EngineCore pid=7253) \x1b[36m(RayWorkerProc pid=7326)\x1b[0m (Worker_TP1 pid=7326) {INFO}{OFF}\n"
        f"{INFO}driver line, no worker's\n"
    )
    assert recorded_runs.worker_messages(log) == [(7327, f" {INFO}{OFF}"), (7326, f" {INFO}{OFF}")]
    assert recorded_runs.worker_pids_in(log, OFF) == {7326, 7327}
    assert recorded_runs.worker_pids_in(log, "driver line") == set()
