"""A recorded engine run made compact: what it keeps, what it drops and says it dropped, and that the
tables read from a record come out the same before and after."""

from __future__ import annotations

import gzip
import json

import pytest

from scripts.bench import compact_record, shared_prefix_steps


def trace(side: str, rep: int, split: list[int], seconds: float) -> dict:
    """One call's arrival trace as ``--trace-arrivals`` records it (16 requests, ms from the first send)."""
    requests = [[0.1 * i, 0.8 * i + 0.5, 0.8 * i + 1.2, 14.0 + 0.01 * i] for i in range(16)]
    steps = [[14.1, 120.0], [120.1, 121.0]] if split == [16] else [[4.0, 90.0], [90.1, 170.0], [170.1, 171.0]]
    return {
        "side": side,
        "point": "private P=8192 B=16 N=128",
        "rep": rep,
        "requests": requests,
        "prompt_len": 8320,
        "seconds": seconds,
        "split": split,
        "steps": steps,
    }


def run(tmp_path) -> dict:
    out = tmp_path / "out"
    traces = [
        trace(side, rep, [16] if (rep + k) % 3 else [3, 13], 0.12 + 0.001 * rep + 0.0123456789 * k)
        for k, side in enumerate(("stock", "FLASH_ATTN"))
        for rep in range(7)
    ]
    return {
        "command": f"python -m scripts.bench shared_prefix_engine --trace-arrivals --json {out}/engine.json",
        "environment": {"vllm": "0.25.1"},
        "sides": [{"label": "stock"}, {"label": "FLASH_ATTN"}],
        "seconds": {
            side: {"private P=8192 B=16 N=128": [t["seconds"] for t in traces if t["side"] == side]}
            for side in ("stock", "FLASH_ATTN")
        },
        "points": ["private P=8192 B=16 N=128"],
        "table": [
            {
                "key": "private P=8192 B=16 N=128",
                "sides": {
                    side: {"median_s": 0.12345678, "cache_as_planned": True}
                    for side in ("stock", "FLASH_ATTN")
                },
            }
        ],
        "cached_tokens": {"stock": [8192] * 7},
        "output_tokens": {"stock": [1] * 7},
        "markdown": "| private | ... |",
        "notes": ["a note the run made"],
        "engines_after": {
            "stock": [
                {
                    "steps": 10,
                    "step_shapes": [[16, 2048]] * 10,
                    "log": f"{out}/x.log",
                    "layout": "a/layout/out/b",
                }
            ]
        },
        "path_steps": [
            {"side": t["side"], "point": t["point"], "rep": t["rep"], "steps_routed": 1, "gathered": 16}
            | {"steps_with_segments": 0, "blocks_reused": 2 * t["rep"], "hits_reused": 0, "shapes": [[1]]}
            for t in traces
        ],
        "arrival_traces": traces,
    }


def test_a_compact_record_keeps_what_its_tables_are_made_from(tmp_path):
    raw = run(tmp_path)
    before = shared_prefix_steps.tables(raw)
    record = compact_record.compact(raw, command="bash suite.sh OUT pause", root=str(tmp_path))
    assert "arrival_traces" in raw  # the run itself is left as it was
    for dropped in ("arrival_traces", "path_steps", "table", "cached_tokens", "output_tokens"):
        assert dropped not in record
    assert "step_shapes" not in record["engines_after"]["stock"][0]
    assert record["engines_after"]["stock"][0]["log"] == "OUT/x.log"  # the machine's folder gone
    assert record["engines_after"]["stock"][0]["layout"] == "a/layout/out/b"  # only where a path starts
    assert record["cache_as_planned"] == {"private P=8192 B=16 N=128": {"stock": True, "FLASH_ATTN": True}}
    assert record["command"].startswith("bash suite.sh OUT pause  # python -m scripts.bench")
    assert "--json OUT/engine.json" in record["command"]
    assert record["path_steps_summary"]["FLASH_ATTN | private P=8192 B=16 N=128"] == {
        "calls": 7,
        "steps_routed": 7,
        "steps_with_segments": 0,
        "gathered": 112,
        "blocks_reused": 42,
        "hits_reused": 0,
        "prompts_copied": 0,
    }
    flash = record["seconds"]["FLASH_ATTN"]["private P=8192 B=16 N=128"]
    assert flash[0] == 0.132346  # to the microsecond
    assert record["notes"][0] == "a note the run made"
    assert len(record["notes"]) == 1 + len(compact_record.DROPPED) + 1  # each drop and the rounding
    # The tables: made from the traces before, stored after (the same rows).
    after = shared_prefix_steps.tables(record)
    assert [line for line in after if line.startswith("|")] == [
        line for line in before if line.startswith("|")
    ]
    assert shared_prefix_steps.comparisons(record) == shared_prefix_steps.comparisons(raw)


def test_compacting_twice_changes_nothing_and_the_bytes_repeat(tmp_path):
    record = compact_record.compact(run(tmp_path), command="bash suite.sh OUT pause", root=str(tmp_path))
    again = compact_record.compact(record, command="bash suite.sh OUT pause", root=str(tmp_path))
    assert again == record
    a, b = tmp_path / "a.json.gz", tmp_path / "b.json.gz"
    assert compact_record.write(record, a) == compact_record.write(again, b)
    assert a.read_bytes() == b.read_bytes()
    assert json.loads(gzip.decompress(a.read_bytes())) == record


def test_the_command_line_writes_the_record(tmp_path, capsys):
    src = tmp_path / "engine.json"
    src.write_text(json.dumps(run(tmp_path)))
    out = tmp_path / "record.json.gz"
    assert compact_record.main([str(src), str(out), "--command", "bash suite.sh OUT bench"]) == 0
    printed = capsys.readouterr().out
    assert f"{out}:" in printed and "FLASH_ATTN | private P=8192 B=16 N=128" in printed
    assert "arrival_traces" not in json.loads(gzip.decompress(out.read_bytes()))


def test_calls_recorded_before_they_named_their_point_are_summed_by_shape():
    calls = [{"side": "stock", "requests": 16, "prompt_len": 32896, "steps": 2, "gathered": 0}] * 3
    summary = compact_record.path_steps_summary(calls)
    assert summary == {
        "stock | 16 requests x 32896 tokens": {
            "calls": 3,
            "steps_routed": 0,
            "steps_with_segments": 0,
            "gathered": 0,
            "blocks_reused": 0,
            "hits_reused": 0,
            "prompts_copied": 0,
        }
    }


def test_older_calls_are_not_summed_across_points_of_one_shape(tmp_path):
    """Calls that name only their shape cannot tell a shared 16 x 32 point from a decode one over the
    same prefix: the compaction refuses rather than sum them together."""
    raw = run(tmp_path)
    raw["points"] = ["shared P=32768 B=16 N=32", "decode P=32768 B=16 N=32 out=32"]
    raw["path_steps"] = [{"side": "stock", "requests": 16, "prompt_len": 32800, "gathered": 1}] * 2
    with pytest.raises(ValueError, match="summed together"):
        compact_record.compact(raw)
    raw["points"] = raw["points"][:1]
    assert (
        compact_record.compact(raw)["path_steps_summary"]["stock | 16 requests x 32800 tokens"]["gathered"]
        == 2
    )
