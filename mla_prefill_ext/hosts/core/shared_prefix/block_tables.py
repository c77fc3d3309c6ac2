"""Host copies of the step's block table rows, for the builder, without a device sync.

The builder needs each prefill request's block ids on the host to find the pages requests share.
vLLM hands it a device tensor; how the host copy is had depends on the model runner:

* V1 runner (``vllm.v1.worker.block_table.BlockTable``): the runner fills the device table from a host
  buffer it keeps (``block_table.np``) and hands the builder ``get_device_tensor(num_reqs)``. The wrapper
  on ``get_device_tensor`` remembers, by the device buffer's address, which host array it was filled from.
* V2 runner (``vllm.v1.worker.gpu.block_table.BlockTables``, vLLM 0.33+): the tables live on the GPU
  only, written through staged writes. Every block id enters through ``append_block_ids(req_index,
  new_block_ids, overwrite)``: the wrapper writes the same ids into a host mirror of its own
  (:class:`Mirror`), and remembers the address of each group's gathered table (``input_block_tables``),
  the tensor the builder gets. The builder's metadata says which runner row each batch row is (``req_idx``).

Either way :func:`host_rows` gives the step's rows in batch order, or None when the device tensor is not
one of those remembered (then the step runs vLLM's own context path).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

_TWINS: dict[int, np.ndarray] = {}  # V1: device address -> the runner's host array
_MIRRORS: dict[int, tuple[Mirror, int]] = {}  # V2: gathered table's address -> (mirror, group)
_LOCK = threading.Lock()
_MIRROR_ATTR = "_mla_host_mirror"

RUNNER_PROBLEMS: dict[str, str | None] = {}
"""Per model runner ("V1", "V2"): None where its block rows are read here, else why not (set by the
instrumentor; empty before it ran or when nothing is wrapped)."""


def remember_host_twin(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    """V1 ``BlockTable.get_device_tensor``: vLLM's result, its host twin noted."""
    device = wrapped(*args, **kwargs)
    host = getattr(getattr(instance, "block_table", None), "np", None)
    if isinstance(host, np.ndarray):
        with _LOCK:
            _TWINS[device.data_ptr()] = host
    return device


class Mirror:
    """What a V2 runner's block tables hold, group by group, as host arrays (rows: the runner's requests).

    Written exactly as vLLM writes its tables: ``overwrite`` starts a row again, otherwise the ids go
    after the row's last; a row's columns past its count are stale and never read (the planner reads a
    request's blocks up to its context). Grows as rows and blocks come.
    """

    __slots__ = ("counts", "inputs", "rows")

    def __init__(self, groups: int) -> None:
        self.rows = [np.zeros((0, 0), dtype=np.int32) for _ in range(groups)]
        self.counts = [np.zeros(0, dtype=np.int64) for _ in range(groups)]
        self.inputs: Any = None  # the runner's gathered tables these addresses were taken from

    def write(self, req_index: int, new_block_ids: Any, overwrite: bool, null: bool = False) -> None:
        for group, ids in enumerate(new_block_ids):
            counts = self.counts[group]
            start = 0 if overwrite or req_index >= len(counts) else int(counts[req_index])
            end = start + len(ids)
            self._fit(group, req_index + 1, end)
            if ids:
                self.rows[group][req_index, start:end] = 0 if null else ids
            self.counts[group][req_index] = end

    def _fit(self, group: int, rows: int, cols: int) -> None:
        table = self.rows[group]
        if table.shape[0] >= rows and table.shape[1] >= cols:
            return
        # Each dimension doubles only where it is short (rows doubling with every wider row grew the
        # mirror past twice the runner's table).
        height, width = table.shape
        height = max(rows, 2 * height) if height < rows else height
        width = max(cols, 2 * width) if width < cols else width
        grown = np.zeros((height, width), dtype=np.int32)
        grown[: table.shape[0], : table.shape[1]] = table
        self.rows[group] = grown
        counts = np.zeros(grown.shape[0], dtype=np.int64)
        counts[: len(self.counts[group])] = self.counts[group]
        self.counts[group] = counts

    def rows_for(self, group: int, req_idx: np.ndarray) -> np.ndarray | None:
        table = self.rows[group]
        if len(req_idx) and int(req_idx.max()) >= table.shape[0]:
            return None  # a row never written: not a table this mirror follows
        return table[req_idx]  # a copy: later writes do not reach a step already planned


def _args(args: Any, kwargs: Any) -> tuple[int, Any, bool]:
    names = ("req_index", "new_block_ids", "overwrite")
    values = [kwargs[n] if n in kwargs else args[i] for i, n in enumerate(names)]
    return int(values[0]), values[1], bool(values[2])


def mirror_block_ids(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    """V2 ``BlockTables.append_block_ids``: vLLM's staged write, then the same ids in the host mirror."""
    result = wrapped(*args, **kwargs)  # first: a write vLLM refuses is not mirrored
    req_index, new_block_ids, overwrite = _args(args, kwargs)
    mirror = instance.__dict__.get(_MIRROR_ATTR)
    if mirror is None:
        mirror = instance.__dict__[_MIRROR_ATTR] = Mirror(len(new_block_ids))
    # Elastic EP's warm-up writes the null block in place of the ids (0.34's class flag).
    null = bool(getattr(instance, "redirect_writes_to_null_block", False))
    mirror.write(req_index, new_block_ids, overwrite, null=null)
    inputs = getattr(instance, "input_block_tables", None)
    if inputs is not None and inputs is not mirror.inputs:
        with _LOCK:
            for group, table in enumerate(inputs):
                _MIRRORS[table.data_ptr()] = (mirror, group)
        mirror.inputs = inputs
    return result


def mirrored_rows(tables: Any, req_idx: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """A V2 runner's ``BlockTables``: the first group's host rows and block counts of ``req_idx`` (runner
    request indices), as its mirror holds them; None where nothing was mirrored there."""
    mirror = getattr(tables, "__dict__", {}).get(_MIRROR_ATTR)
    if mirror is None or not mirror.rows:
        return None
    rows = mirror.rows_for(0, req_idx)
    return None if rows is None else (rows, mirror.counts[0][req_idx])


def host_rows(common: Any) -> np.ndarray | None:
    """The host rows behind ``common.block_table_tensor`` (the builder's common metadata), in batch order
    and at least ``common.num_reqs`` of them, or None when unknown."""
    device = common.block_table_tensor
    try:
        address = device.data_ptr()
        rows, width = device.shape
    except (AttributeError, ValueError):
        return None
    req_idx = getattr(common, "req_idx", None)
    if req_idx is not None:  # the V2 runner (vLLM 0.33+): its rows by request index
        entry = _MIRRORS.get(address)
        if entry is None:
            return None
        mirror, group = entry
        return mirror.rows_for(group, np.asarray(req_idx[: common.num_reqs]))
    host = _TWINS.get(address)
    # A buffer freed and another put at its address would not have the same layout: refuse it.
    if host is None or host.ndim != 2 or host.shape[1] != width or host.shape[0] < rows:
        return None
    return host


def held() -> dict[str, int]:
    """What this process keeps of the runners' block tables (read-only, for soaks and reports): the V1
    host twins and V2 gathered tables remembered by address, and the bytes of the V2 host mirrors."""
    with _LOCK:
        mirrors = {id(mirror): mirror for mirror, _ in _MIRRORS.values()}
        twins, addresses = len(_TWINS), len(_MIRRORS)
    tables = [a for m in mirrors.values() for a in (*m.rows, *m.counts)]
    return {"twins": twins, "mirror_addresses": addresses, "mirror_bytes": sum(a.nbytes for a in tables)}


def forget() -> None:
    """Drop every remembered twin and mirror address (when the wrappers are removed)."""
    with _LOCK:
        _TWINS.clear()
        _MIRRORS.clear()
