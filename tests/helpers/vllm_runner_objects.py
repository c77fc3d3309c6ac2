"""vLLM's GPU model runner objects, built for real on the CPU: the V1 runner's ``BlockTable`` and
``InputBatch``, the V2 runner's ``BlockTables`` (vLLM 0.33+).

Shared by the shared-prefix path's tests (tests/hosts/core/test_shared_prefix_path.py) and the layer
benchmark's router prediction test (tests/bench/test_shared_prefix_layer.py). Their constructors
differ across vLLM releases: each is given the keyword arguments its release takes.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Sequence
from typing import Any
from unittest import mock

import numpy as np
import torch


def accepted(cls: type, **kwargs: Any) -> dict[str, Any]:
    """The keyword arguments this vLLM's ``cls.__init__`` takes (they differ across releases)."""
    params = inspect.signature(cls.__init__).parameters
    return {k: v for k, v in kwargs.items() if k in params}


@contextlib.contextmanager
def unpinned() -> Iterator[None]:
    """Pinned host memory needs a CUDA driver; vLLM 0.25+ reads whether to pin from the platform at import."""
    from vllm.v1 import utils as v1_utils
    from vllm.v1.worker import gpu_input_batch

    with (
        mock.patch.object(gpu_input_batch, "PIN_MEMORY", False, create=True),
        mock.patch.object(v1_utils, "PIN_MEMORY", False, create=True),
    ):
        yield


def default_runner() -> str:
    """The model runner this vLLM picks by default (for a DeepSeek model): "V2" from 0.33, else "V1"."""
    from mla_prefill_ext import versions

    line = versions.release(versions.installed_vllm_version() or "") or (0, 0, 0)
    return "V2" if line[:2] >= (0, 33) else "V1"


def runner_block_table(
    rows: Sequence[Sequence[int]], block_size: int, runner: str | None = None
) -> tuple[torch.Tensor, np.ndarray | None]:
    """vLLM's runner block table holding ``rows`` (the step's requests in batch order): the tensor the
    runner hands a builder, and the ``req_idx`` the V2 runner's metadata carries (None on V1).

    ``runner``: "V1" or "V2" (default: :func:`default_runner`).
    """
    if (runner or default_runner()) == "V2":
        return v2_block_tables(rows, block_size)
    from vllm.v1.worker.block_table import BlockTable

    kwargs = dict(
        block_size=block_size,
        max_num_reqs=8,
        max_num_blocks_per_req=8,
        max_num_batched_tokens=256,
        pin_memory=False,
        device=torch.device("cpu"),
        kernel_block_size=block_size,
        cp_kv_cache_interleave_size=1,
    )
    with unpinned():
        table = BlockTable(**accepted(BlockTable, **kwargs))
        for i, row in enumerate(rows):
            table.add_row(list(row), i)
        table.commit_block_table(len(rows))
    return table.get_device_tensor(len(rows)), None


@contextlib.contextmanager
def v2_on_cpu() -> Iterator[None]:
    """The platform lookups the V2 runner's buffers make that a CPU-only vLLM answers for no machine:
    UVA and pinned memory off, so its explicit-copy buffers serve; the device type ``cpu``."""
    from vllm.platforms import current_platform
    from vllm.utils import torch_utils
    from vllm.v1.worker.gpu import buffer_utils

    with contextlib.ExitStack() as stack:
        for lookup in ("is_uva_available", "is_pin_memory_available"):
            if hasattr(buffer_utils, lookup):  # 0.33 reads UVA only
                stack.enter_context(mock.patch.object(buffer_utils, lookup, lambda: False))
        if hasattr(torch_utils, "PIN_MEMORY"):  # 0.33's host-to-device copy reads it, taken at import
            stack.enter_context(mock.patch.object(torch_utils, "PIN_MEMORY", False))
        stack.enter_context(mock.patch.object(type(current_platform), "device_type", "cpu"))
        yield


def v2_tables(block_size: int, max_num_reqs: int = 8, max_blocks: int = 8) -> Any:
    """The V2 runner's ``BlockTables`` (vLLM 0.33+) on the CPU, one KV cache group."""
    from vllm.v1.worker.gpu.block_table import BlockTables

    kwargs = dict(
        block_sizes=[block_size],
        max_num_reqs=max_num_reqs,
        max_num_batched_tokens=256,
        max_num_blocks_per_group=[max_blocks],
        device=torch.device("cpu"),
    )
    with v2_on_cpu():
        return BlockTables(**accepted(BlockTables, **kwargs))


def v2_write_one(tables: Any, live: dict[int, int], rng: np.random.Generator, max_blocks: int = 32) -> None:
    """One ``append_block_ids`` of a runner whose requests come and go: a new request in a random slot,
    more blocks for one already there, or a slot written again from its start (``overwrite``: another
    request, or a resumed one). ``live``: each written slot's block count, kept up to date."""
    req = int(rng.integers(tables.max_num_reqs))
    overwrite = req not in live or bool(rng.random() < 0.2)
    count = 0 if overwrite else live[req]
    new = rng.integers(1, 100, size=int(rng.integers(0, min(6, max_blocks - count) + 1))).tolist()
    tables.append_block_ids(req, (new,), overwrite)
    live[req] = count + len(new)


def v2_apply(tables: Any) -> None:
    """What ``BlockTables.apply_staged_writes`` does, for one KV cache group. vLLM applies the writes it
    staged (row, first column, ids; per ``append_block_ids``) with a Triton kernel, which needs a GPU: the
    same writes, read from what vLLM staged, in torch."""
    table = tables.block_tables[0]
    chunks = table._staged_chunks() if hasattr(table, "_staged_chunks") else [table._staged_write_contents]
    contents = np.concatenate([np.asarray(c, dtype=np.int64) for c in chunks]) if chunks else np.zeros(0)
    done = 0
    for row, start, end in zip(
        table._staged_write_indices, table._staged_write_starts, table._staged_write_cu_lens, strict=True
    ):
        table.gpu[row, int(start) : int(start) + end - done] = torch.as_tensor(contents[done:end])
        done = end
    table.clear_staged_writes()
    with v2_on_cpu():
        tables.num_blocks.copy_to_uva()


def v2_gather(tables: Any, req_idx: np.ndarray) -> torch.Tensor:
    """The step's rows gathered as the V2 runner's ``gather_block_tables`` does into its first group's
    input table, the tensor its builders get. A double of that one Triton kernel, which needs a GPU: the
    same copy (rows by request index, up to each row's block count) in torch."""
    out = tables.input_block_tables[0]
    n = len(req_idx)
    counts = tables.num_blocks.np[0]
    out[:n] = 0
    for batch_row, req in enumerate(req_idx):
        out[batch_row, : counts[req]] = tables.block_tables[0].gpu[req, : counts[req]]
    return out[:n]


def v2_block_tables(rows: Sequence[Sequence[int]], block_size: int) -> tuple[torch.Tensor, np.ndarray]:
    """The V2 runner holding ``rows``: written through its real ``append_block_ids`` into request slots
    that are not the batch order (as in a runner whose requests came and went), then gathered."""
    tables = v2_tables(block_size)
    req_idx = np.array([(5 + 3 * i) % 8 for i in range(len(rows))], dtype=np.int32)
    for req, row in zip(req_idx, rows, strict=True):
        tables.append_block_ids(int(req), (list(row),), True)
    v2_apply(tables)
    return v2_gather(tables, req_idx), req_idx


def empty_input_batch(
    block_size: int, max_model_len: int = 8192, max_num_reqs: int = 32, vocab_size: int = 1000
) -> Any:
    """vLLM's runner ``InputBatch`` on the CPU, unpinned, with no request yet."""
    from vllm.v1.worker.gpu_input_batch import InputBatch

    kwargs = dict(
        max_num_reqs=max_num_reqs,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_model_len,
        device=torch.device("cpu"),
        pin_memory=False,
        vocab_size=vocab_size,
        block_sizes=[block_size],
        kernel_block_sizes=[block_size],
        max_num_blocks_per_req=[max_model_len // block_size],
    )
    with unpinned():
        return InputBatch(**accepted(InputBatch, **kwargs))


def runner_input_batch(
    requests: Sequence[tuple[Sequence[int], int, int]], block_size: int, max_model_len: int = 8192
) -> Any:
    """vLLM's runner ``InputBatch`` holding ``(block ids, computed tokens, prompt tokens)`` per request
    (request ids ``r0``, ``r1``, ...)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.worker.gpu_input_batch import CachedRequestState

    batch = empty_input_batch(block_size, max_model_len)
    for i, (blocks, computed, prompt) in enumerate(requests):
        batch.add_request(
            CachedRequestState(
                req_id=f"r{i}",
                prompt_token_ids=list(range(prompt)),
                mm_features=[],
                sampling_params=SamplingParams(max_tokens=1),
                generator=None,
                block_ids=(list(blocks),),
                num_computed_tokens=computed,
                output_token_ids=[],
            )
        )
    return batch
