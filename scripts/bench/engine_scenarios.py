"""Engine prefill throughput the GPU suite's engine scenarios recorded, as one table: stock vs the add-on.

    python -m scripts.bench engine_scenarios --results OUT/scenarios [--json bench-engine.json]

Reads what ``python -m scripts.gpu_harness.scenarios --bench`` recorded (one JSON file per scenario, gzipped
or not; see
scripts/gpu_suite.sh): prompt tokens/s with ``max_tokens=1`` of ``stock`` (the add-on disabled),
``shim-fa`` (FLASH_ATTN) and ``shim-fi`` (FLASHINFER), each in its own engine lifetime, several
repetitions per point. Nothing is measured here. For stock and the backends alive at once,
taking turns (the better comparison), run engine.py.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from scripts.gpu_harness import scenarios

from . import common

SIDES = ("stock", "shim-fa", "shim-fi")


def engine_table(results: Path) -> dict[str, Any]:
    """Per point (prompt length x batch): each side's tokens/s and the add-on's sides over stock."""
    data = {n: scenarios.load(results, n) for n in SIDES}  # NAME.json or NAME.json.gz, or None
    for n, d in data.items():
        if d is None or not d.get("ok") or not d.get("bench"):
            raise SystemExit(f"engine scenario {n} has no benchmark results in {results}")
    table = []
    for i, point in enumerate(data["stock"]["bench"]):
        row: dict[str, Any] = {"prompt_len": point["prompt_len"], "batch": point["batch"]}
        for n in SIDES:
            tps = data[n]["bench"][i]["tokens_per_s"]
            row[n] = {"median": statistics.median(tps), "min": min(tps), "max": max(tps), "all": tps}
        for n in ("shim-fa", "shim-fi"):
            row[f"{n}/stock"] = row[n]["median"] / row["stock"]["median"]
        table.append(row)
        print(
            json.dumps(
                {k: v for k, v in row.items() if not isinstance(v, dict)}
                | {n: round(row[n]["median"]) for n in SIDES}
            ),
            flush=True,
        )
    return {"results_dir": str(results), "ready_s": {n: data[n]["ready_s"] for n in SIDES}, "table": table}


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(__doc__)
    parser.add_argument("--results", required=True, help="the scenarios' results folder")
    parser.add_argument("--json", help="write the table here")
    args = parser.parse_args(argv)
    out = common.record()
    out["engine"] = engine_table(Path(args.results))
    common.write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
