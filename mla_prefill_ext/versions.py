"""The vLLM versions the add-on supports, and how (patch or bridge): declared here, and only here.

Like an OpenTelemetry instrumentation's supported range, one table says what the
add-on does on each vLLM release line:

* **patch** (0.20.x): vLLM has no pluggable MLA prefill; the add-on wraps vLLM's MLA
  layer (``mla_prefill_ext.hosts.vllm_0_20``).
* **none** (0.21-0.22): vLLM has its own MLA prefill backends but no way to register
  one (no ``register_mla_prefill_backend``; ``MLAPrefillBackendEnum.get_path`` returns
  the built-in path, read from the 0.21.0 and 0.22.1 wheels). The add-on changes
  nothing, and an explicit choice of an add-on backend refuses at start.
* **bridge** (0.23 and later): the add-on's backends are registered in vLLM's own
  registry through adapters (``mla_prefill_ext.hosts.vllm_0_23``). Tested up to
  :data:`NEWEST_TESTED`; a later release is bridged when vLLM's API still has the
  shape the bridge inspects for, with one WARNING naming the tested releases.

The version picks the mode; the bridge then inspects vLLM's API (signatures,
attributes) and refuses, all or nothing, when its shape is not one it knows.
No vLLM or torch import here: activation and the CLI read this module first.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

PATCH, NONE, BRIDGE = "patch", "none", "bridge"

Release = tuple[int, int, int]


class Mode(NamedTuple):
    """What the add-on does on vLLM releases in ``[low, high)`` (``high`` None: no upper bound)."""

    name: str
    low: Release
    high: Release | None
    summary: str


MODES: tuple[Mode, ...] = (
    Mode(PATCH, (0, 20, 0), (0, 21, 0), "the add-on patches vLLM's MLA layer"),
    Mode(
        NONE,
        (0, 21, 0),
        (0, 23, 0),
        "vLLM 0.21-0.22 selects among its own MLA prefill backends and has no way to register "
        "another one (no register_mla_prefill_backend before 0.23)",
    ),
    Mode(BRIDGE, (0, 23, 0), None, "the add-on's backends join vLLM's own MLA prefill registry"),
)

TESTED = ("0.20.2", "0.25.1", "0.33.0", "0.34.0")
"""The releases the test matrix runs against (noxfile.py reads them from here)."""

DEV_TESTED = TESTED[0]
"""The release of the development environment (requirements-dev.txt pins it; the nox session that
runs in nox's own interpreter tests it); the others get an environment each under ``.nox/``."""


def _line(release: Release) -> str:
    return f"{release[0]}.{release[1]}"


SUPPORTED_TEXT = " or ".join(
    f"vLLM {_line(m.low)}.x (patched)" if m.name == PATCH else f"{_line(m.low)}+ (bridged)"
    for m in MODES
    if m.name != NONE
)
"""The supported releases in one phrase, for messages, ``--help`` and the README's first line (from
:data:`MODES`: "vLLM 0.20.x (patched) or 0.23+ (bridged)")."""

INSTALL_SPEC = f"vllm=={TESTED[-1]}"
"""What an install hint suggests (the newest tested release; the hint names the whole range too)."""


class Decision(NamedTuple):
    """The mode for one vLLM version: ``reason`` says why nothing is done (mode none)."""

    mode: str
    vllm_version: str | None
    reason: str | None = None
    warning: str | None = None  # set when the version is above the tested range


def installed_vllm_version() -> str | None:
    vllm = sys.modules.get("vllm")  # already imported inside vLLM's processes: free
    version = getattr(vllm, "__version__", None)
    if isinstance(version, str):
        return version
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("vllm")
    except PackageNotFoundError:
        return None


def requirement(mode: str) -> str:
    """A mode's releases as a requirement specifier: ``">=0.20.0,<0.21"`` for the patch."""
    row = next(m for m in MODES if m.name == mode)
    spec = ">=" + ".".join(map(str, row.low))
    return spec + (f",<{row.high[0]}.{row.high[1]}" if row.high else "")


def unsupported_reason(mode: str, vllm_version: str | None = None) -> str | None:
    """Why ``vllm_version`` (default: the installed one) is not served in ``mode``; None when it is.

    Only the release numbers count, so dev and local builds qualify; pre-releases of the
    next line do not (their release is that line's). The reason is :func:`decide`'s where
    it has one, so that activation and a host's own check say the same.
    """
    decision = decide(vllm_version)
    if decision.mode == mode:
        return None
    return decision.reason or (
        f"vLLM {decision.vllm_version} is not supported (supported: vllm{requirement(mode)})"
    )


def release(version: str) -> Release | None:
    """The release numbers of a version string (dev and local builds count as their release).

    By hand, not with a regular expression: compiling one costs milliseconds at every start.
    """
    parts = []
    for part in version.strip().removeprefix("v").split(".")[:3]:
        digits = len(part) - len(part.lstrip("0123456789"))
        if digits == 0:
            break
        parts.append(int(part[:digits]))
        if digits < len(part):  # "0rc1", "3+local": the release ends here
            break
    if len(parts) < 2:
        return None
    major, minor, micro = (*parts, 0)[:3]
    return (major, minor, micro)


NEWEST_TESTED: Release = release(TESTED[-1])  # type: ignore[assignment]  # a literal release
"""Releases of this minor line and older are in the tested range; later ones warn."""


def decide(vllm_version: str | None = None) -> Decision:
    """The mode for ``vllm_version`` (default: the installed vLLM).

    A plain tuple comparison: ``packaging.specifiers`` costs ~20 ms to import, at
    every start of every vLLM process.
    """
    v = installed_vllm_version() if vllm_version is None else vllm_version
    if v is None:
        return Decision(NONE, None, "vLLM is not installed")
    rel = release(v)
    if rel is None:
        return Decision(NONE, v, f"vLLM version '{v}' cannot be parsed (supported: {SUPPORTED_TEXT})")
    for mode in MODES:
        if mode.low <= rel and (mode.high is None or rel < mode.high):
            if mode.name == NONE:
                return Decision(NONE, v, f"vLLM {v} is not supported: {mode.summary}")
            warning = None
            if mode.name == BRIDGE and rel[:2] > NEWEST_TESTED[:2]:
                warning = (
                    f"vLLM {v} is newer than the releases mla-prefill-ext was tested with "
                    f"({', '.join(TESTED)}); its MLA prefill API still has the shape the bridge "
                    "expects, so the add-on bridges it. Report problems with the vLLM version."
                )
            return Decision(mode.name, v, None, warning)
    return Decision(NONE, v, f"vLLM {v} is not supported (supported: {SUPPORTED_TEXT})")


def mode_table() -> list[tuple[str, str, str]]:
    """(releases, mode, what it means) per row, for docs and ``info``."""
    rows = []
    for mode in MODES:
        low = ".".join(map(str, mode.low[:2]))
        span = f">={low}" + (f",<{'.'.join(map(str, mode.high[:2]))}" if mode.high else "")
        rows.append((span, mode.name, mode.summary))
    return rows
