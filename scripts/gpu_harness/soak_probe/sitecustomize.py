"""The fault soak's probe (scripts/gpu_fault_soak_suite.sh puts this folder first on the server's PYTHONPATH).

With ``SOAK_PROBE_DIR`` set, a daemon thread in each Python process (forked children start their own)
appends one JSON line every ``SOAK_PROBE_S`` seconds (default 2) to ``SOAK_PROBE_DIR/path-<pid>.jsonl``:
the shared-prefix path's reports and what its memos hold (``held()``), read from the add-on's modules the
process has already imported (it imports none: a process that never loads them writes nothing). Any
other ``sitecustomize`` on the path runs after it.
"""

import importlib.machinery
import importlib.util
import json
import os
import sys
import threading
import time

_PATH = "mla_prefill_ext.hosts.core.shared_prefix."


def sample() -> dict:
    """The path's state in this process now (empty where the add-on's path is not loaded)."""
    got: dict = {}
    mods = {name: sys.modules.get(_PATH + name) for name in ("instrumentor", "engine_core", "prefix_hits")}
    if mods["instrumentor"]:
        report = mods["instrumentor"].INSTRUMENTOR.report()
        shapes = mods["instrumentor"].routing.SHAPES
        got["path"] = {**report, "step_shapes": len(report["step_shapes"])}
        got["block_tables"] = mods["instrumentor"].block_tables.held()
        got["caps"] = {"step_shapes": shapes.maxlen}
    if mods["engine_core"] and mods["prefix_hits"]:
        hashes, hits = mods["engine_core"], mods["prefix_hits"]
        got["engine_core"] = hashes.INSTRUMENTOR.report()
        got["hashers"] = [h.held() for h in hashes.HASHERS]
        got["hits"] = [h.held() for h in filter(None, (ref() for ref in hits.LATEST))]
        donors = sys.modules[_PATH + "prefix_hashes"].DONORS
        got["caps"] = {**got.get("caps", {}), "donors": 2 * donors, "copied": donors, "memos": 2 * hits.MEMOS}
    torch = sys.modules.get("torch")
    if got and torch is not None and torch.cuda.is_initialized():
        got["cuda_allocated"] = torch.cuda.memory_allocated()
    return got


def _run(where: str, every: float) -> None:
    while True:
        time.sleep(every)
        try:
            line = sample()
        except Exception as e:  # a report read while the engine changes it: said, and tried again
            line = {"error": f"{type(e).__name__}: {e}"}
        if line:
            with open(os.path.join(where, f"path-{os.getpid()}.jsonl"), "a") as f:
                f.write(json.dumps({"t": time.time(), **line}, default=str) + "\n")


def _start() -> None:
    args = (os.environ["SOAK_PROBE_DIR"], float(os.environ.get("SOAK_PROBE_S", "2")))
    threading.Thread(target=_run, args=args, name="soak-probe", daemon=True).start()


if os.environ.get("SOAK_PROBE_DIR"):
    _start()
    os.register_at_fork(after_in_child=_start)

_here = os.path.dirname(os.path.abspath(__file__))
_next = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _here]
)
if _next is not None and _next.loader is not None:
    _next.loader.exec_module(importlib.util.module_from_spec(_next))
