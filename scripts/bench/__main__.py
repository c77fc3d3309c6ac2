"""``python -m scripts.bench NAME [flags]``: run one measurement (``--help`` after NAME: its flags)."""

from __future__ import annotations

import importlib
import sys

from . import MEASUREMENTS


def usage() -> str:
    width = max(map(len, MEASUREMENTS))
    lines = [f"  {name:<{width}}  {what}" for name, what in MEASUREMENTS.items()]
    return "usage: python -m scripts.bench NAME [flags]\n\nmeasurements:\n" + "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in MEASUREMENTS:
        print(f"unknown measurement {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    # The run's record and --help show the command as it was typed.
    sys.argv = [f"python -m scripts.bench {name}", *rest]
    return importlib.import_module(f"{__package__}.{name}").main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
