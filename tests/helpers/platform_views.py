"""vLLM's real platform answering as another device would: only its device facts are patched."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

import vllm.platforms
from vllm.platforms.interface import DeviceCapability

PLATFORMS = {
    # name: (is_* flags, device capability)
    "cuda-h200": ({"is_cuda": True}, (9, 0)),
    "rocm-mi300": ({"is_rocm": True}, (9, 4)),
    "xpu": ({"is_xpu": True}, None),
}


def platform_view(name: str) -> list[Any]:
    """Patches, not started, under which vLLM's platform answers as ``name`` (see PLATFORMS)."""
    from vllm.platforms import current_platform

    flags, _ = PLATFORMS[name]
    cls = type(current_platform)
    patches = [mock.patch.object(cls, "is_unspecified", lambda self: False)]
    patches += [mock.patch.object(cls, flag, lambda self: True) for flag in flags]
    return patches


@contextlib.contextmanager
def device(capability: tuple[int, int] | None) -> Iterator[None]:
    """What a GPU of this capability would report (None: what this CPU box reports)."""
    cap = None if capability is None else DeviceCapability(*capability)
    with mock.patch.object(
        type(vllm.platforms.current_platform),
        "get_device_capability",
        classmethod(lambda cls, device_id=0: cap),
    ):
        yield
