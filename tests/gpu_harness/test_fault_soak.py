"""The fault soak (scripts/gpu_fault_soak_suite.sh) without a GPU: its shell parses, its dry run names the
server and imports what it runs, and its verdicts judge synthetic records as they would a soak's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.gpu_harness import soak_verdict

ROOT = Path(__file__).resolve().parents[2]
SUITE = ROOT / "scripts" / "gpu_fault_soak_suite.sh"


def test_the_suite_parses():
    subprocess.run(["bash", "-n", str(SUITE)], check=True)


@pytest.mark.parametrize("side", ["stock", "path"])
def test_the_dry_run_prints_the_server_and_imports(tmp_path, side):
    env = {**os.environ, "DRY_RUN": "1", "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(SUITE), str(tmp_path), side], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    command, said = proc.stdout.splitlines()[-2:]
    assert said == "imports ok"
    assert (
        "serve" in command
        and "--num-gpu-blocks-override 256" in command
        and "--enable-prefix-caching" in command
    )
    assert ("MLA_PREFILL_EXT_DISABLE=1" in command) == (side == "stock")
    assert ("MLA_PREFILL_BACKEND=FLASH_ATTN" in command and "soak_probe" in command) == (side == "path")


def test_all_three_sides_run_at_once_each_on_its_own_port_checkpoint_and_share_of_the_gpu(tmp_path):
    env = {**os.environ, "DRY_RUN": "1", "PYTHON": sys.executable, "TMPDIR": str(tmp_path)}
    proc = subprocess.run(
        ["bash", str(SUITE), str(tmp_path / "out"), "all"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    commands = {name: (tmp_path / "out" / f"{name}.txt").read_text() for name in ("stock", "stock-2", "path")}
    ports = {name: c.split("--port ")[1].split()[0] for name, c in commands.items()}
    assert len(set(ports.values())) == 3
    assert all(
        f"mla-sharp-{name} " in c and "--gpu-memory-utilization 0.25" in c for name, c in commands.items()
    )
    assert "MLA_PREFILL_EXT_DISABLE=1" in commands["stock-2"] and "FLASH_ATTN" in commands["path"]


def record(rid: str, tokens: list[int], shift: float = 0.0, sha: str = "p") -> dict:
    """One completed request as the client writes it: clear top-1 (gap 1.0) at every position."""
    logprobs = [-0.1 - shift] * len(tokens)
    return dict(
        id=rid,
        prompt_sha=sha,
        prompt_len=100,
        tokens=tokens,
        logprobs=logprobs,
        top2=[[lp, lp - 1.0] for lp in logprobs],
        top2_tokens=[[t, t + 1] for t in tokens],
    )


def soak(records: list[dict]) -> dict[str, dict]:
    return {r["id"]: r for r in records}


def test_the_same_tokens_pass_and_requests_one_side_lacks_are_left_out():
    stock = soak([record("0-0-0", [5, 6, 7]), record("0-0-1", [8, 9]), record("1-0-0", [3])])
    path = soak([record("0-0-1", [8, 9], shift=0.01), record("0-0-0", [5, 6, 7])])
    result = soak_verdict.tokens_verdict(stock, path)
    assert result.passed and result.compared_positions == 5


def test_a_changed_token_fails():
    stock = soak([record("0-0-0", [5, 6, 7]), record("0-0-1", [8, 9])])
    path = soak([record("0-0-0", [5, 6, 7]), record("0-0-1", [8, 4])])
    result = soak_verdict.tokens_verdict(stock, path)
    assert not result.passed and "not a near-tie" in result.reason


def test_the_bound_is_stocks_own_spread_with_a_second_stock_soak():
    stock, path = soak([record("a", [5, 6])]), soak([record("a", [5, 6], shift=0.15)])
    assert not soak_verdict.tokens_verdict(stock, path).passed  # past the FA3-family bound (0.06)
    stock2 = soak([record("a", [5, 6], shift=0.2)])  # stock's soaks differ by 0.2: the bound is 0.25
    assert soak_verdict.tokens_verdict(stock, path, stock2).passed


def test_another_prompt_under_the_same_id_fails():
    stock, path = soak([record("a", [5, 6])]), soak([record("a", [5, 6], sha="q")])
    assert "prompts differ" in soak_verdict.tokens_verdict(stock, path).reason


def write_run(
    out: Path, *, preempted: int, aborted: int, steps: int, donors: int, twins_end: int = 1
) -> None:
    (out / "client.json").write_text(
        json.dumps(dict(sent=10, completed=10 - aborted, aborted=aborted, statuses={"200": 10}, errors={}))
    )
    (out / "phases.txt").write_text("soak_start 100\nsoak_end 200\n")
    page = 'vllm:num_preemptions_total{{engine="0",model_name="tiny"}} {}\n'
    page += 'http_requests_total{{status="2xx"}} 9\n'
    (out / "metrics-idle.txt").write_text(page.format(3))
    (out / "metrics-end.txt").write_text(page.format(3 + preempted))
    caps = {"donors": 16, "copied": 8, "memos": 16, "step_shapes": 256}
    held = {"donors": donors, "donor_tokens": 0, "donor_hashes": 0, "sharing": 0}
    samples = [
        dict(
            t=t,
            caps=caps,
            path={"steps_with_segments": s, "step_shapes": 4},
            hashers=[held],
            hits=[],
            block_tables={"twins": twins},
        )
        for t, s, twins in ((90, 2, 1), (150, 2 + steps, 1), (210, 2 + steps, twins_end))
    ]
    (out / "path-7.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))


def test_the_run_passes_what_it_shows_and_fails_each_point_it_misses(tmp_path):
    write_run(tmp_path, preempted=60, aborted=3, steps=5, donors=16)
    lines = soak_verdict.judge_run(tmp_path, "path", 4096)
    assert [line.split(":")[0] for line in lines] == ["PASS"] * 6, lines
    write_run(tmp_path, preempted=49, aborted=1, steps=0, donors=17, twins_end=2)
    failed = [line for line in soak_verdict.judge_run(tmp_path, "path", 4096) if line.startswith("FAIL")]
    assert [line.split(":")[1].strip() for line in failed] == [
        "preemptions",
        "aborted",
        "path engaged",
        "memory bounded, back to idle",
    ], failed
    assert "donors 17 > 16" in failed[-1] and "twins 2 at the end, 1 idle" in failed[-1]
    assert len(soak_verdict.judge_run(tmp_path, "stock", 4096)) == 4  # stock: no path, no probe
