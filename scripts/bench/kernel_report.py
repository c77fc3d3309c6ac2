"""The kernel benchmark's results, tables and plot rebuilt from the rows a kernel.py run printed.

    python -m scripts.bench kernel_report --kernel-log bench-kernel.log[.gz] [--json out.json]
        [--plot out.png] [--markdown tables.md]

kernel.py prints one JSON row per backend, op and shape as it measures; a run that stopped
before writing its JSON (or whose JSON is wanted again) is rebuilt from its log. The
selection (fastest backend per shape against automatic selection) is computed for an SM90
GPU, the H200 of the recorded runs. Runs on any machine: nothing is measured.
"""

from __future__ import annotations

import gzip
import json
import os
import sys
from pathlib import Path

from . import common
from .kernel_tables import fastest_per_shape, markdown, plot

SELECTION_CAPABILITY = (9, 0)


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(__doc__)
    parser.add_argument("--kernel-log", required=True, help="the log of a kernel.py run")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--plot", help="write the plot (PNG) here")
    parser.add_argument("--markdown", help="write the tables as Markdown here")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    common.use_this_checkout()
    from vllm.platforms.interface import DeviceCapability

    log = Path(args.kernel_log)
    raw = log.read_bytes()
    text = (gzip.decompress(raw) if log.suffix == ".gz" else raw).decode().splitlines()  # recorded: gzipped
    out = {
        "command": " ".join(sys.argv),
        "environment": {"note": "rows measured by the run that printed them; see its log"},
        "kernel": [json.loads(line) for line in text if line.startswith('{"backend"')],
    }
    out["selection"] = fastest_per_shape(out["kernel"], DeviceCapability(*SELECTION_CAPABILITY))
    if args.plot:
        plot(out["kernel"], args.plot)
    if args.markdown:
        Path(args.markdown).write_text(markdown(out["kernel"], out["selection"]))
    common.write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
