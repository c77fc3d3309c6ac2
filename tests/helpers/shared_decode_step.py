"""One decode step over a paged latent cache on the CPU (tests/shared_prefix/test_decode.py and the decode
parity harness's tests): six decode rows (one new token each, the cache holding it); rows 0-3 share 3 full
blocks, row 3 holds a 4th full block of its own and rows 0-2 a partly filled last block; rows 4 and 5 share
nothing. Sharp latents and queries, so that a wrong key set, a dropped LSE or a scale 2% off shows."""

from __future__ import annotations

import numpy as np
import torch

from mla_prefill_ext.shared_prefix.decode import ANY_SHARED_BLOCK

BS, RANK, ROPE, HEADS, SCALE = 4, 32, 8, 4, 0.3
EVERY_GROUP = ANY_SHARED_BLOCK
SEQ_LENS = np.array([14, 15, 13, 17, 6, 9])
ROWS = np.array(
    [
        [0, 1, 2, 3, 0],
        [0, 1, 2, 4, 0],
        [0, 1, 2, 5, 0],
        [0, 1, 2, 6, 7],
        [8, 9, 0, 0, 0],
        [10, 11, 12, 0, 0],
    ],
    dtype=np.int32,
)


def step(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(13, BS, RANK + ROPE, generator=g) * 3
    q = torch.randn(len(SEQ_LENS), HEADS, RANK + ROPE, generator=g) * 3
    return cache, q[..., RANK:].contiguous(), q[..., :RANK].contiguous()


def vllm_decode(attend, q_pe, q_nope):
    """vLLM's call: every row over all of its pages, causal, one query each."""
    n = len(SEQ_LENS)
    cu = torch.arange(n + 1, dtype=torch.int32)
    return attend(q_pe, q_nope, torch.from_numpy(ROWS), torch.from_numpy(SEQ_LENS), cu, 1, 17, True)
