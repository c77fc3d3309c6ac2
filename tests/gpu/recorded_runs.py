"""The GPU scenarios' recorded runs, as the GPU tests read them (one folder or several, run when missing).

Shared by tests/gpu/test_engine.py (vLLM 0.20) and tests/gpu/test_bridge_engine.py (vLLM 0.25+).
"""

from __future__ import annotations

import functools
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import pytest

from scripts.gpu_harness import engine_runner, scenarios, verdict

# One folder, or several separated by os.pathsep (later runs of the same scenarios).
RESULTS_DIRS = [Path(p) for p in (os.environ.get("MLA_GPU_RESULTS") or "").split(os.pathsep) if p] or [
    Path(tempfile.mkdtemp(prefix="mla-gpu-"))
]
RESULTS = RESULTS_DIRS[-1]
MIN_CONTEXT_CHUNKS = 3
# A worker's log line: Ray prefixes its actors' output with the actor and pid (RayWorkerWrapper on vLLM 0.20,
# RayWorkerProc on 0.25), vLLM's multiprocessing executor with the worker's rank and pid (Worker_TP0 on 0.25).
WORKER_PREFIX = re.compile(r"\((?:RayWorkerWrapper|RayWorkerProc|Worker_TP\d+) pid=(\d+)[^)]*\)")
ANY_PREFIX = re.compile(r"^(?:\x1b\[[0-9;]*m)?\(\w+ pid=\d+")  # a worker's, the engine core's, Ray's
# Between two prefixes of one line: Ray's colour codes and spaces.
_BETWEEN = re.compile(r"(?:\x1b\[[0-9;]*m|\s)*")


def worker_messages(log: str) -> list[tuple[int, str]]:
    """Each worker line of ``log`` as (pid, message).

    Two workers writing at once interleave: ``(Worker_TP0 pid=1) (Worker_TP1 pid=2) INFO ...`` then an
    unprefixed line. The message after the last prefix is taken as that worker's, and the unprefixed
    lines right after it as the earlier prefixes' messages, the innermost first (TP0 wrote its prefix,
    TP1 a whole line, then TP0 went on). Which message is whose cannot be known from the text; when both
    log at once they log the same line (the path's on/off line), which is what the tests look for. Only the
    lines right after count, and none with a prefix of any kind (the engine core's, say); a line
    further on is never taken for a worker's. Ray's nested prefixes of one process
    (``(RayWorkerProc pid=7) (Worker_TP0 pid=7)``) are one writer."""
    found: list[tuple[int, str]] = []
    pending: list[int] = []  # prefixes whose message may be on the next lines, innermost last
    for line in log.splitlines():
        first = WORKER_PREFIX.search(line)
        if first is None:
            if pending and not ANY_PREFIX.match(line):
                found.append((pending.pop(), line))
            else:
                pending.clear()
            continue
        pids, end = [int(first.group(1))], first.end()
        while (m := WORKER_PREFIX.match(line, _BETWEEN.match(line, end).end())) is not None:
            if int(m.group(1)) != pids[-1]:
                pids.append(int(m.group(1)))
            end = m.end()
        found.append((pids[-1], line[end:]))
        pending = pids[:-1]
    return found


def worker_pids_in(log: str, text: str) -> set[int]:
    """The worker processes whose log lines in ``log`` contain ``text``."""
    return {pid for pid, message in worker_messages(log) if text in message}


@functools.cache
def runs(name: str) -> list[tuple[Path, dict]]:
    """Every recorded run of a scenario (folder, result), in folder order; run it if there is none."""
    found = [(d, data) for d in RESULTS_DIRS if (data := scenarios.load(d, name)) is not None]
    if not found:
        import torch

        if scenarios.SCENARIOS[name].gpus > torch.cuda.device_count():
            pytest.skip(f"{name} needs {scenarios.SCENARIOS[name].gpus} GPUs")
        scenarios.run_all([name], RESULTS, [str(i) for i in range(torch.cuda.device_count())], bench=False)
        found = [(RESULTS, data)] if (data := scenarios.load(RESULTS, name)) is not None else []
    assert found, f"scenario {name} wrote no result (see {RESULTS / (name + '.log')})"
    return found


def _chosen(name: str) -> tuple[Path, dict]:
    """The last run that completed (else the last run: its error is the result)."""
    every = runs(name)
    ok = [r for r in every if r[1].get("ok")]
    return (ok or every)[-1]


def result(name: str) -> dict:
    return _chosen(name)[1]


def ran(name: str) -> dict:
    """A scenario's result, which must have run to the end (its error otherwise)."""
    data = result(name)
    assert data["ok"], data.get("error")
    return data


def log_of(name: str) -> str:
    return scenarios.log_text(_chosen(name)[0], name)


records = engine_runner.records  # a scenario result's records, every prompt set in a fixed order


def outputs(name: str) -> list[dict]:
    """The scenario's records, every prompt set in a fixed order."""
    data = result(name)
    assert data["ok"], data.get("error")
    return records(data)


def check(kind: str, candidate: str, reference: str, judge: Any = None) -> verdict.Verdict:
    """The verdict of every completed candidate run against the stock runs.

    Stock vLLM 0.20.2 is not reproducible across engine lifetimes everywhere: on the
    H200 host two stock runs of the compiled single-GPU engine, and two of the TP=2
    engine, differed (docs/gpu-verification.md). So a candidate run passes when it
    matches one of the recorded stock runs, and every candidate run must pass. A
    mutant must therefore fail against every stock run. ``judge`` (a verdict function taking
    candidate, reference and ``label``) replaces the one ``kind`` names.
    """
    if judge is None:
        judge = verdict.identical if kind == "identical" else verdict.bf16_noise
    references = [(d, records(data)) for d, data in runs(reference) if data.get("ok")]
    candidates = [(d, records(data)) for d, data in runs(candidate) if data.get("ok")]
    assert references, f"no completed run of {reference}"
    assert candidates, f"no completed run of {candidate}: {result(candidate).get('error')}"
    verdicts = []
    for cd, c in candidates:
        tried = [
            judge(c, r, label=f"{candidate} ({cd.name}) vs {reference} ({rd.name})") for rd, r in references
        ]
        passing = [v for v in tried if v.passed]
        verdicts.append(passing[0] if passing else min(tried, key=lambda v: v.max_diff))
    failed = [v for v in verdicts if not v.passed]
    return failed[0] if failed else verdicts[0]


# --- the shared-prefix prompt set (tests/gpu/test_shared_prefix.py, test_shared_prefix_tp2.py) ----------

# The widest bound stock's lifetimes may set (on the H200: spread 0.141, bound 0.177; gpu-verification.md).
LIFETIME_SPREAD_CAP = 0.25
BLOCK_SLACK = 64  # the largest page size of the MLA backends: a prefix's last partial block is recomputed


def lifetime_judge(spread: list[verdict.Verdict]) -> Any:
    """:func:`verdict.lifetime_noise` at the bound stock's lifetimes set against each other (``spread``),
    capped so that a stock run gone wrong cannot widen it without limit."""
    bound = verdict.lifetime_bound(spread)
    assert bound <= LIFETIME_SPREAD_CAP, f"stock's own spread gives {bound:.3g}, above {LIFETIME_SPREAD_CAP}"
    return functools.partial(verdict.lifetime_noise, calibrations=spread)


@functools.cache
def stock_calibrations(group: tuple[str, ...]) -> list[verdict.Verdict]:
    """Stock against stock: every pair of the group's recorded lifetimes (bf16_noise, passed or not)."""
    lifetimes = [(f"{n} ({d.name})", records(data)) for n in group for d, data in runs(n) if data.get("ok")]
    assert len(lifetimes) >= 2, f"stock's spread needs two lifetimes of {group}, found {len(lifetimes)}"
    return verdict.lifetime_calibrations(lifetimes)


def assert_shared_prefix_served(data: dict) -> None:
    """A shared-set run on the sharp checkpoint whose every prompt was served its prefix from the cache."""
    assert data["weights"] == "sharp", "parity must run on the sharp checkpoint"
    sets = engine_runner.shared_prompt_sets()
    for key in engine_runner.SHARED_SETS:
        records = data["results"][key]
        assert [r["prompt_len"] for r in records] == [len(p) for p in sets[key]], key
        cached = engine_runner.shared_cached_tokens(key)
        short = [r["num_cached_tokens"] for r in records if r["num_cached_tokens"] < cached - BLOCK_SLACK]
        assert not short, f"{key}: {short} cached tokens, expected >= {cached - BLOCK_SLACK}"
        assert all(len(r["top2"]) == len(r["tokens"]) for r in records), key


def assert_unpatched(log: str) -> None:
    """A stock run's log: nothing of the add-on (which names itself in every line it logs; vLLM 0.25+
    logs its own "Using X MLA prefill backend.")."""
    assert "(mla-prefill-ext" not in log and "MLA prefill backend (" not in log
