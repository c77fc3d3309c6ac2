"""Runs cases each in a new process in which nothing of the add-on has run yet.

Starting Python with PyTorch and vLLM costs seconds, so this script imports them once and
forks one child per case: a child begins with no add-on module imported (checked), its own
environment and its own stdout and stderr, as ``python -c`` or ``python -m
mla_prefill_ext`` would. Usage (from a test)::

    python fresh_processes.py < cases.json > results.json

Each case is ``{"env": {...}, "code": "python source"}`` or ``{"env": {...}, "cli": [args]}``;
each result ``{"rc": int, "stdout": str, "stderr": str, "cpu_s": float}``, in the cases' order.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback

# As the CLI asks before vLLM is first imported (here): vLLM's log lines on stderr, not stdout.
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")

# Imported once, for every child: PyTorch, and vLLM's MLA layer with what it brings (the
# add-on patches it on activation whether it was imported before or after).
import torch  # noqa: F401
import vllm.model_executor.layers.attention.mla_attention  # noqa: F401

ADDON = "mla_prefill_ext"


def _run_in_child(case: dict) -> int:
    if any(name == ADDON or name.startswith(ADDON + ".") for name in sys.modules):
        print(f"not fresh: {ADDON} was imported before the case", file=sys.stderr)
        return 99
    os.environ.update(case.get("env", {}))
    try:
        if "cli" in case:
            sys.argv = ["mla-prefill-ext", *case["cli"]]
            from mla_prefill_ext.cli import main

            return main(case["cli"])
        exec(compile(case["code"], "<case>", "exec"), {"__name__": "__main__"})
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:
        traceback.print_exc()
        return 1


def run(case: dict, folder: str) -> dict:
    out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        rc = 1
        try:
            for fd, path in ((1, out), (2, err)):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
            rc = _run_in_child(case)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)  # no atexit handlers of the parent's imports
    _, status, usage = os.wait4(pid, 0)
    with open(out) as f_out, open(err) as f_err:
        return {
            "rc": os.waitstatus_to_exitcode(status),
            "stdout": f_out.read(),
            "stderr": f_err.read(),
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
        }


def main() -> None:
    cases = json.load(sys.stdin)
    with tempfile.TemporaryDirectory() as folder:
        results = [run(case, folder) for case in cases]
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
