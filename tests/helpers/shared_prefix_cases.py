"""Steps whose prefill requests share cached prefixes, in a paged latent cache, with a float64 reference.

Each request is (family, family blocks, private tokens, new tokens): requests of one family hold
the same first blocks of that family's prefix (the same block ids, as prefix caching gives them),
then blocks of their own, the last one partly filled. Block ids are shuffled over the cache.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from mla_prefill_ext.backends.torch_sdpa import TorchSDPAPrefillBackend
from mla_prefill_ext.shared_prefix.execute import LatentLayout
from mla_prefill_ext.testing.reference import reference_attention

BS = 16
DIMS = LatentLayout(num_heads=4, kv_lora_rank=64, qk_nope_head_dim=32, v_head_dim=32)
ROPE = 16
SCALE = (DIMS.qk_nope_head_dim + ROPE) ** -0.5

# A, A, A (nested: the third holds only 2 of A's blocks), B, B, B (one with no private context),
# and one request of its own.
REQUESTS = [
    ("A", 4, 21, 5),
    ("A", 4, 7, 3),
    ("A", 2, 30, 4),
    ("B", 4, 0, 6),
    ("B", 4, 21, 2),
    (None, 0, 40, 3),
    ("B", 4, 9, 1),
]
# Every request in one group (with and without private context): the plan's members are all rows.
ALL_SHARE = [("A", 4, 21, 5), ("A", 4, 0, 3), ("A", 4, 9, 4)]


class SegmentSDPA(TorchSDPAPrefillBackend):
    """TORCH_SDPA, which declares shared segments (its kernel reads only the prepared step's bounds)."""

    accepts_shared_context_segments = True


class NoSegmentSDPA(TorchSDPAPrefillBackend):
    """A backend that does not declare shared segments (a registered backend's default)."""

    accepts_shared_context_segments = False


def make_backend(cls: type = SegmentSDPA) -> TorchSDPAPrefillBackend:
    return cls(
        num_heads=DIMS.num_heads,
        scale=SCALE,
        kv_lora_rank=DIMS.kv_lora_rank,
        qk_nope_head_dim=DIMS.qk_nope_head_dim,
        qk_rope_head_dim=ROPE,
        v_head_dim=DIMS.v_head_dim,
        vllm_config=None,
    )


class Step(NamedTuple):
    table: torch.Tensor  # int32 [requests, width]
    context_lens: list[int]
    query_start_loc: torch.Tensor  # int32 [requests + 1]
    cache: torch.Tensor  # [blocks, BS, lora + rope]
    q: torch.Tensor  # [tokens, heads, nope + rope]
    w_kv_b: torch.Tensor  # [heads * (nope + v), lora]

    def kv_b_proj(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return torch.nn.functional.linear(x, self.w_kv_b), None  # (out, bias) as vLLM's linear layers

    def keys_values(self, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Request ``r``'s context K and V in float64, read through its own block-table row."""
        c = self.context_lens[r]
        blocks = self.table[r, : -(-c // BS)].long()
        latent = self.cache[blocks].reshape(-1, self.cache.shape[-1])[:c]
        # kv_b_proj in the model dtype, as the layer runs it; attention in float64.
        kv = self.kv_b_proj(latent[:, : DIMS.kv_lora_rank])[0].double().view(c, DIMS.num_heads, -1)
        k_pe = latent[:, None, DIMS.kv_lora_rank :].double().expand(c, DIMS.num_heads, ROPE)
        return torch.cat([kv[..., : DIMS.qk_nope_head_dim], k_pe], dim=-1), kv[..., DIMS.qk_nope_head_dim :]

    def queries(self, r: int) -> torch.Tensor:
        return self.q[int(self.query_start_loc[r]) : int(self.query_start_loc[r + 1])]

    def reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each request's queries over its whole context, non-causal (all of it precedes them), float64."""
        outs, lses = [], []
        for r in range(len(self.context_lens)):
            k, v = self.keys_values(r)
            out, lse = reference_attention(self.queries(r), k, v, SCALE, causal=False)
            outs.append(out)
            lses.append(lse)
        return torch.cat(outs), torch.cat(lses, dim=1)


def make_step(
    requests: list[tuple[str | None, int, int, int]] = REQUESTS,
    seed: int = 0,
    sharpness: float = 3.0,
    dtype: torch.dtype = torch.float32,
) -> Step:
    """Latent rows and queries of large norm (``sharpness``), so that softmax is far from uniform."""
    gen = torch.Generator().manual_seed(seed)
    family_blocks = {f: max(n for g, n, _, _ in requests if g == f) for f, *_ in requests if f}
    needed = sum(family_blocks.values()) + sum(-(-p // BS) for _, _, p, _ in requests)
    ids = iter(torch.randperm(needed + 3, generator=gen).tolist())
    family_ids = {f: [next(ids) for _ in range(n)] for f, n in family_blocks.items()}
    rows, ctx = [], []
    for family, shared, private, _ in requests:
        row = (family_ids[family][:shared] if family else []) + [next(ids) for _ in range(-(-private // BS))]
        rows.append(row)
        ctx.append(shared * BS + private)
    width = max(len(r) for r in rows) + 2
    table = torch.full((len(rows), width), needed + 2, dtype=torch.int32)  # stale entries: a real block
    for i, row in enumerate(rows):
        table[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
    latent_dim = DIMS.kv_lora_rank + ROPE
    cache = torch.randn(needed + 3, BS, latent_dim, generator=gen) * sharpness
    new = [n for *_, n in requests]
    loc = torch.tensor(np.concatenate([[0], np.cumsum(new)]), dtype=torch.int32)
    q = torch.randn(int(loc[-1]), DIMS.num_heads, DIMS.qk_nope_head_dim + ROPE, generator=gen) * sharpness
    w = torch.randn(
        DIMS.num_heads * (DIMS.qk_nope_head_dim + DIMS.v_head_dim), DIMS.kv_lora_rank, generator=gen
    )
    return Step(table, ctx, loc, cache.to(dtype), q.to(dtype), (w / DIMS.kv_lora_rank**0.5).to(dtype))
