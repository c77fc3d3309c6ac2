"""The vLLM versions this add-on patches: declared here, and only here."""

from __future__ import annotations

import re
import sys

SUPPORTED_VLLM_RANGE = ((0, 20, 0), (0, 21, 0))
"""vLLM releases whose MLA layer the patch was written and tested against: [min, max)."""

SUPPORTED_VLLM = ">=0.20.0,<0.21"
"""The same range, as a requirement specifier (for messages and docs)."""

_RELEASE = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?")


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


def unsupported_reason(vllm_version: str | None = None) -> str | None:
    """Why this vLLM version is not patched, or None when it is supported.

    Only the release numbers count, so dev and local builds of 0.20.x qualify;
    pre-releases of 0.21 do not (their release is 0.21.0). A plain tuple
    comparison: ``packaging.specifiers`` costs ~20 ms to import, at every start.
    """
    v = installed_vllm_version() if vllm_version is None else vllm_version
    if v is None:
        return "vLLM is not installed"
    match = _RELEASE.match(v)
    if match is None:
        return f"vLLM version '{v}' cannot be parsed"
    release = tuple(int(x or 0) for x in match.groups())
    low, high = SUPPORTED_VLLM_RANGE
    if not (low <= release < high):
        return f"vLLM {v} is not supported (supported: vllm{SUPPORTED_VLLM})"
    return None
