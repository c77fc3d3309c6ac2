"""A shared prefix's prompt tokens copied from a request already in the runner's batch, not converted again.

vLLM's V1 model runner copies every new request's prompt into its input batch
(``InputBatch.add_request``: ``token_ids_cpu[row, :num_prompt_tokens] = prompt_token_ids``), a
Python list converted to numpy element by element: about 0.7 ms per 32k-token prompt on a 2-core
CPU, 10.5-11.3 ms for 16 requests over one cached 32k prefix (docs/results/cpu-2026-12-04-prompt-rows),
on the step's critical path before its forward.

With the path on, for an MLA model whose KV cache is one MLA group, a new request whose leading KV
blocks are the very blocks (same block ids, same positions) of a request still in the batch takes
those tokens from that request's row (a copy of an array) and converts only the rest. Exact: in one
full-attention group two requests hold one block at one position only through a prefix-cache hit,
whose block hash is a function of the tokens it holds (and of the blocks before it), so the tokens
are the same, as vLLM's own reuse of that block's KV already assumes; a lender is a request still
in the batch at this step (a finished, preempted or unscheduled request has left it before new ones
are added), whose blocks the scheduler holds, and only its prompt's whole blocks lend (its row holds
placeholders for tokens not sampled yet under async scheduling). Sliding-window and other groups
are left to vLLM (a window frees blocks the runner's block ids still name). vLLM's ``add_request``
runs as it is: it is handed the prompt as a list whose array form is ready (numpy takes it through
``__array__``); the request gets its own list back after.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np

from mla_prefill_ext.hosts.core.shared_prefix import switch
from mla_prefill_ext.hosts.core.shared_prefix.prefix_hashes import common_blocks

LENDERS = 8
"""Recent requests with long prompts an input batch remembers as possible lenders (weakly)."""
MIN_SHARED_TOKENS = 1024
"""Leading tokens a request must share with a lender to take them (fewer convert in tens of µs)."""
NULL_BLOCK_ID = 0  # vLLM's null block (placeholders, e.g. sliding windows): never a proof of anything

COPIED = [0, 0]
"""In this process: requests whose prompt took a lender's tokens, and the tokens taken."""

_LOCAL = threading.local()  # the block size while a runner that copies updates its batch, else 0
_LENDERS_ATTR = "_mla_prompt_lenders"
_ON_ATTR = "_mla_shared_prompts"


class _PromptWithArray(list):
    """A request's prompt (a list, as vLLM's), whose array form numpy takes without converting."""

    __slots__ = ("array",)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        array = self.array
        if array is None:  # after its add_request (a logits processor's record may keep the list)
            return np.array(list(self), dtype=dtype)
        return array if dtype is None or np.dtype(dtype) == array.dtype else array.astype(dtype)


def block_size_for(vllm_config: Any, kv_cache_config: Any) -> int:
    """The KV block size when an engine's new prompts may take lenders' rows, else 0: the path on, an
    MLA model, and its KV cache one group of MLA layers (full attention)."""
    if not getattr(getattr(vllm_config, "model_config", None), "use_mla", False):
        return 0
    if not switch.decide(vllm_config).on:
        return 0
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    spec = getattr(groups[0], "kv_cache_spec", None) if len(groups) == 1 else None
    if type(spec) is not MLAAttentionSpec:  # not its subclasses either (sparse, hidden-state caches)
        return 0
    return int(spec.block_size)


@contextlib.contextmanager
def lending(block_size: int) -> Iterator[None]:
    """While this thread adds a step's requests: their prompts may take lenders' rows (0: none)."""
    _LOCAL.block_size = block_size
    try:
        yield
    finally:
        _LOCAL.block_size = 0


def update_states(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    """``GPUModelRunner._update_states(scheduler_output)``: new prompts may take lenders' rows."""
    block_size = instance.__dict__.get(_ON_ATTR)
    if block_size is None:
        kv_cache_config = getattr(instance, "kv_cache_config", None)
        block_size = block_size_for(instance.vllm_config, kv_cache_config) if kv_cache_config else 0
        if kv_cache_config is not None:  # decided once per runner, once its KV cache is laid out
            instance.__dict__[_ON_ATTR] = block_size
    with lending(block_size):
        return wrapped(*args, **kwargs)


def _lender(
    batch: Any, lenders: Any, ids: list[int], block_size: int, num_prompt: int
) -> tuple[int, int] | None:
    """(row, tokens) of the live lender whose leading blocks cover the most of the new prompt."""
    best = None
    most = min(len(ids), num_prompt // block_size)
    for ref in lenders:
        state = ref()
        if state is None:
            continue
        row = batch.req_id_to_index.get(state.req_id)
        # The same request still in that row (not one whose id came back): its output list is there.
        if row is None or batch.req_output_token_ids[row] is not state.output_token_ids:
            continue
        theirs = state.block_ids[0] if len(state.block_ids) == 1 else ()
        if not theirs or theirs[0] != ids[0]:
            continue
        # Only its prompt's whole blocks, and only what its row holds (pipeline parallelism's first
        # ranks may hold fewer tokens than the prompt in a row: num_tokens_no_spec).
        held = min(int(batch.num_prompt_tokens[row]), int(batch.num_tokens_no_spec[row]))
        limit = min(most, len(theirs), held // block_size)
        tokens = common_blocks(ids, theirs, 1, limit) * block_size
        if tokens >= MIN_SHARED_TOKENS and (best is None or tokens > best[1]):
            best = (row, tokens)
    return best


def add_request(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    """``InputBatch.add_request(request)``: the prompt's leading tokens from a lender's row, if any."""
    block_size = getattr(_LOCAL, "block_size", 0)
    if not block_size or switch.paused("prompts"):
        return wrapped(*args, **kwargs)
    request = kwargs["request"] if "request" in kwargs else args[0]
    tokens = request.prompt_token_ids
    block_ids = request.block_ids
    if (
        type(tokens) is not list
        or len(tokens) < MIN_SHARED_TOKENS
        or getattr(request, "prompt_embeds", None) is not None
        or len(block_ids) != 1  # one KV cache group (MLA's)
        or not block_ids[0]
        or block_ids[0][0] == NULL_BLOCK_ID
    ):
        return wrapped(*args, **kwargs)
    lenders = instance.__dict__.get(_LENDERS_ATTR)
    if lenders is None:
        lenders = instance.__dict__[_LENDERS_ATTR] = collections.deque(maxlen=LENDERS)
    found = _lender(instance, lenders, block_ids[0], block_size, len(tokens))
    lenders.appendleft(weakref.ref(request))
    if found is None:
        return wrapped(*args, **kwargs)
    row, shared = found
    rows = instance.token_ids_cpu
    array = np.empty(len(tokens), dtype=rows.dtype)
    array[:shared] = rows[row, :shared]
    array[shared:] = tokens[shared:]
    lent = _PromptWithArray(tokens)
    lent.array = array
    request.prompt_token_ids = lent
    try:
        result = wrapped(*args, **kwargs)
    finally:
        request.prompt_token_ids = tokens
        # The logits processors' record of the step's added requests keeps the lent list (equal to
        # the request's own; replacing the record's tuple left one more object in the garbage
        # collector's young count per request, which made its collections fall more often).
        lent.array = None
    COPIED[0] += 1
    COPIED[1] += shared
    return result
