"""vLLM's GPU model runner objects, built for real on the CPU: its ``BlockTable`` and ``InputBatch``.

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


def runner_block_table(rows: Sequence[Sequence[int]], block_size: int) -> torch.Tensor:
    """vLLM's runner block table holding ``rows``; its device view, as the runner hands it to a builder."""
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
    return table.get_device_tensor(len(rows))


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
