"""What a host reports about itself, for ``mla-prefill-ext info`` (the one shape both hosts fill)."""

from __future__ import annotations

from typing import Any, NamedTuple


class HostReport(NamedTuple):
    """The host in force in this process: whether it is in place, and what it found."""

    instrumented: bool  # the patch (0.20) or the bridge (0.23+) is in place
    skipped_reason: str | None  # why it is not, when it said so
    targets: list[Any]  # the patch's target statuses (path, wrapped, problem, ok); empty when bridged
    info: dict[str, Any] | None  # the bridge's findings as JSON gives them (None: not bridged)
    lines: list[str]  # what ``info`` prints about the host
    problems: list[str]  # findings that make ``info`` fail
