"""One step's context plan: shared segments gathered once, each request's private remainder chunked.

Made once per step on the host (in the metadata builder), never per layer. The private
remainders are chunked as vLLM 0.20-0.25 chunk whole contexts: every request with context
left gets an equal share of the context workspace per pass, rounded down to the page size, so
a pass never holds more rows than the workspace vLLM already allocates and profiles. The
shared segments are chunked the same way, a segment in place of a request, in passes of
their own.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from mla_prefill_ext.shared_prefix.groups import GroupValue, SharedPrefixGroup, find_shared_prefixes


@dataclass(frozen=True)
class FlopCostModel:
    """Whether a group is worth a shared segment, by FLOPs of one layer (the ``GroupValue`` hook).

    Default constants: the FLOP model of DeepSeek-R1 at 16 heads per GPU (TP=8). A member that
    shares ``P`` tokens stops up-projecting them: ``2 * P * kv_lora_rank * heads * (qk_nope + v)``
    FLOPs saved per member after the first; the attention FLOPs are the same either way. Not
    calibrated: ``group_overhead_flops`` (a segment's extra launches, gathers of member queries
    and merges, as FLOP-equivalents) and ``min_saved_flops`` are to be measured on the GPU.
    """

    num_heads: int = 16
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    group_overhead_flops: float = 0.0
    min_saved_flops: float = 0.0

    def saved_flops(self, members: int, shared_tokens: int, member_query_tokens: int) -> float:
        per_token = 2.0 * self.kv_lora_rank * self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)
        return (members - 1) * shared_tokens * per_token - self.group_overhead_flops

    def __call__(self, members: int, shared_tokens: int, member_query_tokens: int) -> float:
        saved = self.saved_flops(members, shared_tokens, member_query_tokens)
        return saved if saved > self.min_saved_flops else 0.0


class ContextPass(NamedTuple):
    """One workspace-sized pass over several sequences' context, in vLLM's chunk layout (host)."""

    starts: torch.Tensor  # int32 [seqs]: first context token of each sequence in this pass
    seq_lens: torch.Tensor  # int32 [seqs]
    cu_seq_lens: torch.Tensor  # int32 [seqs + 1]
    token_to_seq: torch.Tensor  # int32 [total]
    total: int

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens.max()) if self.seq_lens.numel() else 0


def chunk_passes(
    begins: torch.Tensor, ends: torch.Tensor, workspace_rows: int, page_size: int
) -> list[ContextPass]:
    """Passes covering ``[begins[j], ends[j])`` of each sequence ``j``, vLLM's way.

    ``begins`` must be multiples of ``page_size`` (vLLM's gather kernel needs aligned starts).
    NumPy on the host: for one 64k-row pass ``torch.repeat_interleave`` took 20 ms on a busy
    2-core CPU, ``np.repeat`` 0.08 ms.
    """
    begin, end = begins.numpy().astype(np.int64), ends.numpy().astype(np.int64)
    lens = np.maximum(end - begin, 0)
    active = int((lens > 0).sum())
    if active == 0:
        return []
    share = (workspace_rows // active) // page_size * page_size
    if share <= 0:
        raise ValueError(f"{active} sequences do not fit {workspace_rows} workspace rows of page {page_size}")
    count = -(-int(lens.max()) // share)
    starts = begin[None, :] + share * np.arange(count)[:, None]
    seq_lens = np.clip(np.minimum(end[None, :], starts + share) - starts, 0, None).astype(np.int32)
    cu = np.zeros((count, lens.shape[0] + 1), dtype=np.int32)
    np.cumsum(seq_lens, axis=1, out=cu[:, 1:])
    seq_ids = np.arange(lens.shape[0], dtype=np.int32)
    return [
        ContextPass(
            torch.from_numpy(starts[i].astype(np.int32)),
            torch.from_numpy(seq_lens[i]),
            torch.from_numpy(cu[i]),
            torch.from_numpy(np.repeat(seq_ids, seq_lens[i])),
            int(cu[i, -1]),
        )
        for i in range(count)
    ]


@dataclass(frozen=True)
class SharedSegment:
    """One group's shared leading blocks: gathered and up-projected once for all its members."""

    members: tuple[int, ...]  # indices among the step's prefill requests
    block_ids: np.ndarray  # int32
    num_tokens: int
    query_ranges: tuple[tuple[int, int], ...]  # each member's rows [start, end) in the step's queries


@dataclass(frozen=True)
class ContextPlan:
    """The context part of one step; see :func:`plan_context`. All tensors on the host."""

    segments: tuple[SharedSegment, ...]
    segment_block_table: torch.Tensor  # int32 [segments, max shared blocks]
    segment_passes: tuple[ContextPass, ...]  # sequence j = segment j
    member_rows: torch.Tensor  # int64: the step's query rows of segment 0's members, then segment 1's...
    segment_query_start_loc: torch.Tensor  # int32 [segments + 1], offsets into member_rows
    private_starts: torch.Tensor  # int32 [requests]: where each request's private context begins
    private_passes: tuple[ContextPass, ...]  # sequence j = prefill request j
    num_query_tokens: int
    # member_rows is every query row in order (all requests in one group, or groups in request
    # order): the layers then take q and the segments' output as they are, with no gather or scatter.
    members_are_all_rows: bool = False

    @property
    def has_segments(self) -> bool:
        return bool(self.segments)

    def to(self, device: torch.device | str) -> ContextPlan:
        """The plan with its tensors on ``device``, for the layers and the step's views.

        One host-to-device copy for all of them (from pinned memory on CUDA, without waiting): each
        copy from pageable memory is staged and waited for by the host, a dozen per step before
        the first layer can launch. The device tensors are views of that one buffer.
        """
        device = torch.device(device)
        passes = (*self.segment_passes, *self.private_passes)
        host = [self.segment_block_table, self.member_rows, self.segment_query_start_loc, self.private_starts]
        host += [t for p in passes for t in p[:4]]
        if any(t.device.type != "cpu" for t in host):
            if all(_is_on(t, device) for t in host):
                return self  # moved already (a caller that did not keep the host plan)
            raise ValueError(f"a plan's tensors are copied to {device} from the host only")
        moved = iter(copy_as_one(host, device))
        table, rows, seg_loc, private_starts = (next(moved) for _ in range(4))
        moved_passes = [ContextPass(*(next(moved) for _ in range(4)), total=p.total) for p in passes]
        split = len(self.segment_passes)
        return dataclasses.replace(
            self,
            segment_block_table=table,
            segment_passes=tuple(moved_passes[:split]),
            member_rows=rows.long(),
            segment_query_start_loc=seg_loc,
            private_starts=private_starts,
            private_passes=tuple(moved_passes[split:]),
        )


def _is_on(tensor: torch.Tensor, device: torch.device) -> bool:
    """Whether ``tensor`` is where ``.to(device)`` would put it ("cuda": the current device)."""
    on = tensor.device
    if on.type != device.type:
        return False
    if device.index is None and device.type == "cuda":
        return on.index == torch.cuda.current_device()
    return device.index is None or on.index == device.index


@functools.cache
def _can_pin() -> bool:
    """vLLM's own answer (no pinned memory under WSL, for one); asked once per process."""
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_pin_memory_available())
    except ImportError:  # no vLLM here: torch's view
        return torch.cuda.is_available()


def copy_as_one(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """``tensors`` (host, integers) on ``device`` as int32 views of one buffer copied at once."""
    sizes = [t.numel() for t in tensors]
    pinned = device.type == "cuda" and _can_pin()
    host = torch.empty(sum(sizes), dtype=torch.int32, pin_memory=pinned)
    if tensors:
        torch.cat([t.reshape(-1).to(torch.int32) for t in tensors], out=host)
    # Pinned: the copy does not wait, and the caching host allocator keeps the buffer until it is done.
    buffer = host.to(device, non_blocking=pinned)
    out, at = [], 0
    for t, n in zip(tensors, sizes, strict=True):
        out.append(buffer[at : at + n].view(t.shape))
        at += n
    return out


def plan_context(
    block_table: np.ndarray,
    context_lens: Sequence[int] | np.ndarray,
    query_start_loc: Sequence[int] | np.ndarray | torch.Tensor,
    block_size: int,
    workspace_rows: int,
    value: GroupValue | None = None,
    shared: bool = True,
    groups: Sequence[SharedPrefixGroup] | None = None,
) -> ContextPlan:
    """The step's plan from host copies of its prefill requests' data, in their order.

    ``block_table``: their block-table rows; ``context_lens``: their computed tokens;
    ``query_start_loc``: their query offsets from 0 (vLLM's ``prefill_query_start_loc_cpu``);
    ``block_size``: the cache's page size; ``workspace_rows``: the builder's context workspace.

    ``value`` decides which groups are worth it (default: :class:`FlopCostModel`'s defaults).
    ``shared=False`` (the backend takes no shared segments, or the path is off) gives vLLM's
    own plan: no segments, every context chunked whole. ``groups``: what
    :func:`~mla_prefill_ext.shared_prefix.groups.find_shared_prefixes` found for these requests,
    when the caller has it already (``value`` is then not used).
    """
    ctx = torch.as_tensor(np.asarray(context_lens), dtype=torch.int64)
    loc = torch.as_tensor(np.asarray(query_start_loc), dtype=torch.int64)
    qlens = (loc[1:] - loc[:-1]).numpy()
    if not shared:
        groups = []
    elif groups is None:
        groups = find_shared_prefixes(block_table, ctx.numpy(), block_size, qlens, value or FlopCostModel())
    segments, rows = [], []
    private_starts = torch.zeros_like(ctx)
    for g in groups:
        tokens = g.num_blocks * block_size
        ranges = tuple((int(loc[m]), int(loc[m + 1])) for m in g.members)
        segments.append(SharedSegment(g.members, g.block_ids, tokens, ranges))
        rows += [torch.arange(s, e) for s, e in ranges]
        private_starts[list(g.members)] = tokens
    seg_lens = torch.tensor([s.num_tokens for s in segments], dtype=torch.int64)
    seg_table = torch.zeros(
        len(segments), max((len(s.block_ids) for s in segments), default=0), dtype=torch.int32
    )
    for j, s in enumerate(segments):
        seg_table[j, : len(s.block_ids)] = torch.from_numpy(s.block_ids)
    member_counts = torch.tensor([sum(e - s for s, e in seg.query_ranges) for seg in segments])
    seg_loc = torch.zeros(len(segments) + 1, dtype=torch.int32)
    torch.cumsum(member_counts, dim=0, out=seg_loc[1:])
    member_rows = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)
    num_query_tokens = int(loc[-1])
    return ContextPlan(
        segments=tuple(segments),
        segment_block_table=seg_table,
        segment_passes=tuple(chunk_passes(torch.zeros_like(seg_lens), seg_lens, workspace_rows, block_size)),
        member_rows=member_rows,
        segment_query_start_loc=seg_loc,
        private_starts=private_starts.to(torch.int32),
        private_passes=tuple(chunk_passes(private_starts, ctx, workspace_rows, block_size)),
        num_query_tokens=num_query_tokens,
        members_are_all_rows=bool(segments)
        and torch.equal(member_rows, torch.arange(num_query_tokens, dtype=member_rows.dtype)),
    )


def accepts_shared_segments(backend: Any) -> bool:
    """Whether ``backend`` (instance or class) declared it serves shared segments."""
    cls = backend if isinstance(backend, type) else type(backend)
    return bool(getattr(cls, "accepts_shared_context_segments", False))
