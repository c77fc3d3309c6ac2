"""An out-of-tree MLA prefill backend: counts its calls, then runs a built-in kernel.

It shows the whole backend interface, and it is what the GPU suite registers as
CUSTOM to prove that a backend registered in the user's process is the one that
runs inside vLLM's engine processes: every call appends ``<pid> <method>`` to
the file named by ``MLA_PREFILL_COUNT_FILE`` (when set).

The file holds one run's calls: the first call of a process empties it unless the
process that wrote its first line is still running (then they belong to the same
run: vLLM's engine core and workers run at once), so counts never add up across
runs. Processes of one run on one host agree; on several hosts, give each its own file.

Register it before the engine starts, by class path (this module must be
importable in vLLM's child processes, e.g. on ``PYTHONPATH``)::

    from mla_prefill_ext import MLAPrefillBackendEnum, register_mla_prefill_backend
    register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, "counting_backend.CountingPrefillBackend")
"""

from __future__ import annotations

import fcntl
import os
from typing import Any

import torch

from mla_prefill_ext import MLAPrefillBackend, MLAPrefillBackendEnum
from mla_prefill_ext.selector import mla_prefill_backend_priorities

COUNT_FILE_ENV = "MLA_PREFILL_COUNT_FILE"
_JOINED: dict[str, int] = {}  # count file -> the pid that joined its run (a forked child has not)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


def _join_run(path: str) -> None:
    """Empty the count file unless its first line was written by a running process (this run)."""
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # the workers of one run start at once: one decides
        f.seek(0)
        first = f.readline().split(" ", 1)[0]
        if first and not (first.isdigit() and _running(int(first))):
            f.truncate(0)


def _inner_class(device_capability: Any, selector_config: Any) -> type[MLAPrefillBackend] | None:
    """The first built-in backend that can serve here (automatic order)."""
    for member in mla_prefill_backend_priorities(device_capability):
        cls = member.get_class()
        if not cls.validate_configuration(device_capability, selector_config):
            return cls
    return None


class CountingPrefillBackend(MLAPrefillBackend):
    """Delegates to the best built-in backend for the device and records each call."""

    supported_dtypes = (torch.float16, torch.bfloat16, torch.float32)

    @staticmethod
    def get_name() -> str:
        return "COUNTING"

    @classmethod
    def validate_configuration(cls, device_capability: Any, selector_config: Any) -> list[str]:
        reasons = super().validate_configuration(device_capability, selector_config)
        if _inner_class(device_capability, selector_config) is None:
            reasons.append("no built-in backend can serve this configuration")
        return reasons

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from mla_prefill_ext.selector import current_device_capability, selector_config_for

        cap = current_device_capability()
        config = selector_config_for(self.vllm_config) if self.vllm_config is not None else None
        inner = _inner_class(cap, config) if config is not None else None
        self.inner = (inner or MLAPrefillBackendEnum.TORCH_SDPA.get_class())(*args, **kwargs)
        self._count_file = os.environ.get(COUNT_FILE_ENV)

    def _record(self, what: str) -> None:
        if not self._count_file:
            return
        if _JOINED.get(self._count_file) != os.getpid():  # once per process (and per fork)
            _join_run(self._count_file)
            _JOINED[self._count_file] = os.getpid()
        with open(self._count_file, "a") as f:
            f.write(f"{os.getpid()} {what}\n")

    def prepare_metadata(self, prefill_metadata: Any) -> None:
        super().prepare_metadata(prefill_metadata)
        self.inner.prepare_metadata(prefill_metadata)

    def run_prefill_new_tokens(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, return_softmax_lse: bool
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        self._record("new_tokens")
        return self.inner.run_prefill_new_tokens(q, k, v, return_softmax_lse)

    def run_prefill_context_chunk(
        self, chunk_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._record(f"context_chunk {chunk_idx}")
        return self.inner.run_prefill_context_chunk(chunk_idx, q, k, v)
