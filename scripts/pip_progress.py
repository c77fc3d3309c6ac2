"""Shows pip's download progress on one terminal line and writes the rest of its output to a log.

Usage: ``pip install --progress-bar raw ... 2>&1 | python scripts/pip_progress.py LOG``. On a terminal
pip's ``Progress <bytes> of <total>`` lines become one status line (collecting, downloading with its
megabytes, installing), cleared at the end; every other line is appended to LOG.
"""

from __future__ import annotations

import re
import shutil
import sys

PROGRESS = re.compile(r"^Progress (\d+) of (\d+)$")
COLLECTING = re.compile(r"^Collecting (\S+)")
DOWNLOADING = re.compile(r"^\s*Downloading (\S+)")
INSTALLING = re.compile(r"^Installing collected packages: (.*)$")


def status_for(line: str, status: str, downloading: str) -> tuple[str, str]:
    """The status line after ``line`` (and the name of the file being downloaded)."""
    progress = PROGRESS.match(line)
    if progress:
        done, total = (int(n) / 1e6 for n in progress.groups())
        size = f"{done:.0f} of {total:.0f} MB" if total else f"{done:.0f} MB"
        return f"downloading {downloading}: {size}", downloading
    if m := COLLECTING.match(line):
        return f"collecting {m.group(1)}", downloading
    if m := DOWNLOADING.match(line):
        name = m.group(1).rsplit("/", 1)[-1]
        return f"downloading {name}", name
    if m := INSTALLING.match(line):
        return f"installing {len(m.group(1).split(', '))} packages", downloading
    return status, downloading


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit("usage: pip install --progress-bar raw ... 2>&1 | python pip_progress.py LOG")
    terminal = sys.stdout.isatty()
    status, downloading = "", ""
    with open(sys.argv[1], "a", encoding="utf-8") as log:
        for raw in sys.stdin:
            line = raw.rstrip("\n")
            if not PROGRESS.match(line):
                log.write(raw)
                log.flush()
            new, downloading = status_for(line, status, downloading)
            if terminal and new != status:
                width = shutil.get_terminal_size().columns - 5
                sys.stdout.write(f"\r\033[K    {new[:width]}")
                sys.stdout.flush()
            status = new
    if terminal and status:
        sys.stdout.write("\r\033[K")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
