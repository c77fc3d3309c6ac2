"""The host copy of the step's block table, for the builder, without a device sync.

vLLM's runner hands the metadata builder a device view of its block table
(``BlockTable.get_device_tensor``: ``block_table.gpu[:num_reqs]``) and fills it from a host
buffer it keeps (``block_table.np``). The wrapper on ``get_device_tensor`` remembers, by the
device buffer's address, which host array it was filled from; the builder looks its tensor up
there. Rows are the batch's requests in order, as in the device tensor.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

_TWINS: dict[int, np.ndarray] = {}
_LOCK = threading.Lock()


def remember_host_twin(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    """``BlockTable.get_device_tensor``: vLLM's result, its host twin noted."""
    device = wrapped(*args, **kwargs)
    host = getattr(getattr(instance, "block_table", None), "np", None)
    if isinstance(host, np.ndarray):
        with _LOCK:
            _TWINS[device.data_ptr()] = host
    return device


def host_rows(device_block_table: Any) -> np.ndarray | None:
    """The host array behind ``device_block_table`` (a view from row 0), or None when unknown."""
    try:
        address = device_block_table.data_ptr()
        rows, width = device_block_table.shape
    except (AttributeError, ValueError):
        return None
    host = _TWINS.get(address)
    # A buffer freed and another put at its address would not have the same layout: refuse it.
    if host is None or host.ndim != 2 or host.shape[1] != width or host.shape[0] < rows:
        return None
    return host


def forget() -> None:
    """Drop every remembered twin (when the wrapper is removed)."""
    with _LOCK:
        _TWINS.clear()
