#!/usr/bin/env python3
"""Generates the README's backend table from the backend classes themselves.

It imports vLLM and PyTorch: run it with the project's environment (scripts/setup.sh).

.venv/bin/python scripts/backend_table.py          # print the table
.venv/bin/python scripts/backend_table.py --write  # rewrite it in README.md
.venv/bin/python scripts/backend_table.py --check  # exit 1 when README.md's copy is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
WRITE_COMMAND = ".venv/bin/python scripts/backend_table.py --write"
START, END = "<!-- backend-table:start -->", "<!-- backend-table:end -->"

# Capabilities probed to describe where each backend runs (None: CPU / no GPU).
PROBES: list[tuple[str, tuple[int, int] | None]] = [("CPU", None), ("8.x", (8, 0)), ("9.0", (9, 0))]
PROBES += [("10.x", (10, 0)), ("12.x", (12, 0))]


def table() -> str:
    from vllm.platforms.interface import DeviceCapability

    from mla_prefill_ext.registry import MLAPrefillBackendEnum

    rows = [
        "| backend | runs on (compute capability) | dtypes | MLA dims | FP8 query | verified on |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for member in MLAPrefillBackendEnum:
        if not member.is_builtin or member.value is None:
            continue
        cls = member.get_class()
        caps = [(label, None if cap is None else DeviceCapability(*cap)) for label, cap in PROBES]
        where = [label for label, cap in caps if cls.supports_compute_capability(cap)]
        dtypes = ", ".join(str(d).removeprefix("torch.") for d in cls.supported_dtypes)
        dims = "DeepSeek-R1 only (qk 128+64, v 128)" if cls.requires_r1_mla_dimensions else "any"
        rows.append(
            f"| `{cls.get_name()}` | {', '.join(where)} | {dtypes} | {dims} | "
            f"{'yes (SM100)' if cls.supports_fp8_query else 'no'} | {cls.hardware_note or '-'} |"
        )
    return "\n".join(rows)


def readme_copy(text: str) -> str:
    try:
        return text.split(START, 1)[1].split(END, 1)[0].strip()
    except IndexError:
        raise SystemExit(f"README.md lacks the markers {START} ... {END}") from None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", action="store_true", help="rewrite the table in README.md")
    group.add_argument("--check", action="store_true", help="exit 1 when README.md's table is stale")
    args = parser.parse_args()
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # the add-on from this checkout, with any Python that has vLLM
    try:
        fresh = table()
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] not in ("vllm", "torch"):
            raise
        why = f"needs vLLM and PyTorch, which this Python ({sys.executable}) cannot import ({e})"
        run = f"Run it with the project's environment, e.g. {WRITE_COMMAND} (scripts/setup.sh creates .venv)"
        print(f"scripts/backend_table.py {why}. {run}.", file=sys.stderr)
        return 2
    text = README.read_text()
    if args.check:
        if readme_copy(text) != fresh:
            print(f"README.md's backend table is stale: run {WRITE_COMMAND}")
            return 1
        return 0
    if args.write:
        before, rest = text.split(START, 1)
        after = rest.split(END, 1)[1]
        README.write_text(f"{before}{START}\n{fresh}\n{END}{after}")
        return 0
    print(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
