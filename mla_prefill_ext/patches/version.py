"""The vLLM versions this add-on patches: declared here, and only here."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

SUPPORTED_VLLM = SpecifierSet(">=0.20.0,<0.21")
"""vLLM releases whose MLA layer the patch was written and tested against."""


def installed_vllm_version() -> str | None:
    try:
        return version("vllm")
    except PackageNotFoundError:
        return None


def unsupported_reason(vllm_version: str | None = None) -> str | None:
    """Why this vLLM version is not patched, or None when it is supported."""
    v = installed_vllm_version() if vllm_version is None else vllm_version
    if v is None:
        return "vLLM is not installed"
    try:
        parsed = Version(v)
    except InvalidVersion:
        return f"vLLM version '{v}' cannot be parsed"
    # Compare the release only, so that dev and local builds of 0.20.x qualify.
    if Version(parsed.base_version) not in SUPPORTED_VLLM:
        return f"vLLM {v} is not supported (supported: vllm{SUPPORTED_VLLM})"
    return None
