"""A shared prefix's block hashes, computed once per engine core instead of once per request.

With prefix caching on, vLLM's engine core hashes every full block of every new request's prompt
(``get_request_block_hasher``: per block a pickle and a sha256 of the parent's hash, the block's
tokens and its extra keys). Sixteen requests over one cached 32k prefix hash the same 2,048 blocks
16 times (32,768 hashes per call at block size 16): most of the fixed host cost that bounds the short
shared-prefix points (docs/results/h200-2026-12-02-prefix-fixed-cost).

:class:`ReusingHasher` wraps vLLM's own hasher. For a new request it finds, among the last few plain
requests it hashed (:data:`DONORS`), the longest run of leading whole blocks whose tokens are the
same, takes those blocks' hashes as they are, and lets vLLM's hasher compute the rest from there
(it starts after the hashes the request already holds). Exact by construction: a block's hash is a
function of its parent's hash, its tokens and its extra keys, and for a plain request (no multimodal
features, LoRA, cache salt or prompt embeddings) the extra keys are None for every block; so equal
leading tokens give equal hashes, computed by the same hasher (same function and block size) from the
same ``NONE_HASH`` (donors are dropped when vLLM draws it again, as a second engine in the process
does). Any other request is hashed by vLLM alone and never lends its hashes.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

from mla_prefill_ext.hosts.core.shared_prefix import switch

DONORS = 8
"""Plain requests remembered per hasher (their leading tokens and hashes; a new request extending
one takes its place, one it covers moves it to the front)."""

_ABSENT = object()
# What vLLM's extra keys read on a request (0.20.2, 0.25.1, 0.33.0): all empty means no extra keys.
_EXTRA_KEY_SOURCES = ("mm_features", "lora_request", "cache_salt", "prompt_embeds")


def is_plain(request: Any) -> bool:
    """Whether every block of ``request`` hashes without extra keys (an attribute vLLM's request
    lacks counts as not plain: the request is left to vLLM)."""
    for name in _EXTRA_KEY_SOURCES:
        value = getattr(request, name, _ABSENT)
        if value is _ABSENT:
            return False
        if name == "prompt_embeds":
            if value is not None:
                return False
        elif value:
            return False
    return True


def common_blocks(a: list[int], b: list[int], block_size: int, limit: int, guess: int = 0) -> int:
    """How many leading whole blocks (at most ``limit``) ``a`` and ``b`` have equal.

    List comparisons run in C; the search halves the unknown span, comparing only it. ``guess``:
    the answer expected (the last request's: a burst over one prefix shares as many blocks each
    time), tried first: one comparison of the shared part instead of the whole list and the search.
    """
    if limit <= 0 or a[:block_size] != b[:block_size]:
        return 0
    if 0 < guess < limit:
        at = guess * block_size
        # The guess's last block and the block after it first (two blocks' slices): a wrong guess
        # then costs no copy of the whole shared part.
        if (
            a[at - block_size : at] == b[at - block_size : at]
            and a[at : at + block_size] != b[at : at + block_size]
            and a[:at] == b[:at]
        ):
            return guess
    end = limit * block_size
    # Slicing a 32k-token list costs more than comparing it: whole lists are compared as they are.
    if (a if len(a) == end else a[:end]) == (b if len(b) == end else b[:end]):
        return limit
    lo, hi = 1, limit  # blocks [0, lo) equal, [0, hi) not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo * block_size : mid * block_size] == b[lo * block_size : mid * block_size]:
            lo = mid
        else:
            hi = mid
    return lo


class ReusingHasher:
    """vLLM's request block hasher, reusing the hashes of leading blocks it has already hashed."""

    def __init__(
        self, inner: Callable[[Any], list[Any]], block_size: int, epoch: Callable[[], Any] = lambda: None
    ) -> None:
        self.inner = inner
        self.block_size = block_size
        # What every chain of hashes starts from (vLLM's NONE_HASH): donors of another epoch are dropped.
        self._epoch = epoch
        self._donors_epoch: Any = None
        self._donors: list[tuple[list[int], list[Any]]] = []  # most recent first
        self._last_shared = 0  # blocks the last request that shared took (common_blocks' guess)
        # New requests are hashed on the engine core's input thread, decoded blocks on its core thread.
        self._lock = threading.Lock()
        self.reused_blocks = 0
        self.hashed_blocks = 0
        # The latest requests that took a recent request's hashes: (request id, tokens shared).
        self.sharing: collections.deque[tuple[str, int]] = collections.deque(maxlen=64)

    def __call__(self, request: Any) -> list[Any]:
        if request.block_hashes or not is_plain(request) or switch.paused("hashes"):
            return self.inner(request)  # later blocks (decode), requests with extra keys, a pause
        full = request.num_tokens // self.block_size
        if full == 0:
            return self.inner(request)
        tokens = request.all_token_ids[: full * self.block_size]
        if not isinstance(tokens, list):
            tokens = list(tokens)
        with self._lock:
            epoch = self._epoch()
            if epoch is not self._donors_epoch:
                self._donors.clear()
                self._donors_epoch = epoch
            at, k = self._longest(tokens, full)
            reused = self._donors[at][1][:k] if k else []
            if not reused:
                hashes = self.inner(request)
            else:
                held = len(request.block_hashes)
                request.block_hashes.extend(reused)  # vLLM's hasher starts after the hashes held
                try:
                    rest = self.inner(request)
                finally:
                    del request.block_hashes[held:]
                hashes = reused + rest
            self.reused_blocks += len(reused)
            self.hashed_blocks += len(hashes) - len(reused)
            if reused:
                self.sharing.append((getattr(request, "request_id", None), len(reused) * self.block_size))
            self._remember(tokens, hashes[:full], at, k)
        return hashes

    def _longest(self, tokens: list[int], full: int) -> tuple[int, int]:
        """(index of the donor, leading blocks shared) for the donor sharing the most (k = 0: none)."""
        bs = self.block_size
        best, best_at = 0, -1
        for at, (donor_tokens, donor_hashes) in enumerate(self._donors):
            limit = min(full, len(donor_hashes))
            # A donor can only do better if it agrees on the block after the best so far.
            if (
                limit <= best
                or tokens[best * bs : (best + 1) * bs] != donor_tokens[best * bs : (best + 1) * bs]
            ):
                continue
            k = common_blocks(tokens, donor_tokens, bs, limit, self._last_shared)
            if k > best:
                best, best_at = k, at
                if k == full:
                    break
        if best:
            self._last_shared = best
        return best_at, best

    def _remember(self, tokens: list[int], hashes: list[Any], at: int, k: int) -> None:
        if k:
            donor_tokens, donor_hashes = self._donors[at]
            if k == len(donor_hashes) or k == len(hashes):  # one holds the other: keep the longer
                del self._donors[at]
                if len(donor_hashes) > len(hashes):
                    tokens, hashes = donor_tokens, donor_hashes
        self._donors.insert(0, (tokens, hashes))
        del self._donors[DONORS:]
