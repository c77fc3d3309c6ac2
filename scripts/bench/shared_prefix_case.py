"""The layer benchmark's requests: a paged latent cache where requests share a cached prefix (GPU or CPU),
DeepSeek-R1's MLA as one GPU of TP=8 sees it, bf16, block size 64.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

R1_TP8 = dict(num_heads=16, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
BLOCK_SIZE = 64


def block_table(requests: int, prefix: int, private: int) -> Any:
    """The step's block table (CPU, int32): the prefix's blocks, shared, then each request's own.

    Columns past a request's context blocks hold the last block (one spare column).
    """
    import torch

    bs = BLOCK_SIZE
    prefix_blocks, private_blocks = prefix // bs, -(-private // bs)
    blocks = prefix_blocks + requests * private_blocks + 1
    width = prefix_blocks + private_blocks + 1
    table = torch.full((requests, width), blocks - 1, dtype=torch.int32)
    for r in range(requests):
        table[r, :prefix_blocks] = torch.arange(prefix_blocks, dtype=torch.int32)
        first = prefix_blocks + r * private_blocks
        own = torch.arange(first, first + private_blocks, dtype=torch.int32)
        table[r, prefix_blocks : prefix_blocks + private_blocks] = own
    return table


def decode_table(table: Any, context_lens: Sequence[int], new: int, first_free: int) -> Any:
    """Block table of the decode path: each request's context blocks, then its new tokens' own blocks.

    The new tokens continue the context (its partly filled last block first), their blocks numbered
    from ``first_free``; unused columns hold 0 (as vLLM's block table does).
    """
    import torch

    bs = BLOCK_SIZE
    rows = []
    for r, ctx in enumerate(context_lens):
        have, need = -(-ctx // bs), -(-(ctx + new) // bs)
        rows.append(table[r, :have].tolist() + list(range(first_free, first_free + need - have)))
        first_free += need - have
    out = torch.zeros((len(rows), max(map(len, rows))), dtype=torch.int32)
    for r, row in enumerate(rows):
        out[r, : len(row)] = torch.tensor(row, dtype=torch.int32)
    return out


def make_case(requests: int, prefix: int, private: int, new: int, device: Any, seed: int = 0) -> dict:
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    d = R1_TP8
    table = block_table(requests, prefix, private)
    blocks = int(table.max()) + 1
    context_lens = [prefix + private] * requests
    latent = d["kv_lora_rank"] + d["qk_rope_head_dim"]
    cache = torch.randn(blocks, BLOCK_SIZE, latent, generator=gen)
    q_dim = d["qk_nope_head_dim"] + d["qk_rope_head_dim"]
    q = torch.randn(requests * new, d["num_heads"], q_dim, generator=gen).to(device, torch.bfloat16)
    heads_dim = d["num_heads"] * (d["qk_nope_head_dim"] + d["v_head_dim"])
    w = torch.randn(heads_dim, d["kv_lora_rank"], generator=gen) / d["kv_lora_rank"] ** 0.5
    w = w.to(device, torch.bfloat16)
    # The new tokens' latents, in blocks after the context's: the decode path reads them from the
    # cache (vLLM writes them there before attention); the prefill plans never touch them.
    decode = decode_table(table, context_lens, new, first_free=blocks)
    extra = int(decode.max()) + 1 - blocks
    cache = torch.cat([cache, torch.randn(max(extra, 0), BLOCK_SIZE, latent, generator=gen)])
    loc = torch.arange(0, requests * new + 1, new, dtype=torch.int32)
    case = dict(table=table, context_lens=context_lens, loc=loc, q=q, w=w, decode_table=decode, prefix=prefix)
    return {**case, "cache": cache.to(device, torch.bfloat16), "seq_lens": [c + new for c in context_lens]}
