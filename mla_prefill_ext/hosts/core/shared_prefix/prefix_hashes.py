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

The argument rests on how vLLM hashes, which a new vLLM may change; it is checked on the engine's own
vLLM instead of assumed: the first time a hasher lends hashes, it also hashes that request with vLLM's
hasher alone and compares. Where they differ the hasher stops reusing for good (and so do its engine's
prefix-cache hits and gathering, which build on it), returns vLLM's hashes, and one INFO line names the
difference; after that first comparison a flag keeps the check free.

A new request is compared in place and its tokens copied only if it shares leading blocks with a
donor. One that shares nothing is remembered weakly (copying every prompt, and freeing the copy of
a finished one, on the engine core's input thread made that thread slower than stock's): its tokens
are copied when a later request first shares its first block, up to its prompt's whole blocks as the
prompt is then (read after the copy: disaggregated prefill's producer side drops the prompt's last
tokens and puts the output in their place, lowering ``num_prompt_tokens`` first; streaming input only
changes tokens after the prompt), and it is gone with the request: the next request over a prefix
whose only lender has finished hashes it again, and is kept. Where requests share a first block but
not the prefix (a chat template's header), each remembered request is still copied once.
"""

from __future__ import annotations

import collections
import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from mla_prefill_ext._logging import log_once

DONORS = 8
"""Plain requests remembered per hasher, of each kind: those whose tokens it copied (they shared
leading blocks with a recent request, or lent theirs) and those it holds weakly (they shared
nothing), so that requests sharing nothing never push a shared prefix out. A new request extending
one takes its place, one it covers moves it to the front."""

_ABSENT = object()
# What vLLM's extra keys read on a request (0.20.2-0.34.0): all empty means no extra keys.
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


def common_blocks(a: Sequence[Any], b: Sequence[Any], block_size: int, limit: int, guess: int = 0) -> int:
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
    # Slicing a 32k-token list costs more than comparing it: whole lists are compared as they are
    # (a view such as vLLM's ConstantList compares by identity: sliced).
    if (a if type(a) is list and len(a) == end else a[:end]) == (
        b if type(b) is list and len(b) == end else b[:end]
    ):
        return limit
    lo, hi = 1, limit  # blocks [0, lo) equal, [0, hi) not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo * block_size : mid * block_size] == b[lo * block_size : mid * block_size]:
            lo = mid
        else:
            hi = mid
    return lo


def differs(reused: Sequence[Any], own: Sequence[Any]) -> str | None:
    """Where ``reused`` (a request's hashes, some lent) differs from ``own`` (vLLM's), in words."""
    if reused == own:
        return None
    for i, (a, b) in enumerate(zip(reused, own, strict=False)):
        if a != b:
            return f"block {i} of {len(own)} hashes differently"
    if len(reused) != len(own):
        return f"{len(reused)} block hashes where vLLM makes {len(own)}"
    return None


def keep_latest_of_each_kind(items: list[Any], kind: Callable[[Any], bool], most: int) -> None:
    """Drop from ``items`` (most recent first) all but the ``most`` first of each ``kind`` (True or False)."""
    if len(items) <= most:
        return
    counts = [0, 0]
    keep = []
    for item in items:
        k = kind(item)
        counts[k] += 1
        if counts[k] <= most:
            keep.append(item)
    items[:] = keep


def _as_list(tokens: Any) -> list[int]:
    # vLLM's token views slice to lists already: a second copy of a 32k-token prompt costs ~50 us.
    return tokens if isinstance(tokens, list) else list(tokens)


class _Donor(NamedTuple):
    """A request whose leading blocks' hashes may be lent."""

    head: list[int]  # its first block's tokens (most requests part there: one comparison each)
    tokens: list[int] | None  # its leading whole blocks' tokens; None: not copied yet (``request``)
    hashes: list[Any]  # its leading whole blocks' hashes
    # While its tokens are not copied (it shared nothing, and no later request shared its first block
    # yet): the request itself, weakly (copying every prompt made the input thread slower than
    # stock's: 8k-token prompts on an H200, about 0.1 ms of 0.75 each).
    request: Any


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
        self._donors: list[_Donor] = []  # most recent first
        self._last_shared = 0  # blocks the last request that shared took (common_blocks' guess)
        # New requests are hashed on the engine core's input thread, decoded blocks on its core thread.
        self._lock = threading.Lock()
        self.reused_blocks = 0
        self.hashed_blocks = 0
        # The latest requests whose leading blocks a recent request has too (took its hashes, or hashed
        # them again where it had finished): (request id, tokens shared).
        self.sharing: collections.deque[tuple[str, int]] = collections.deque(maxlen=64)
        # Whether the first lend was compared with vLLM's own hashes (done once per hasher, an engine's).
        self.checked = False
        # Why this hasher reuses nothing (None: it does): its first lend differed from vLLM's hashes.
        self.off: str | None = None
        # What builds on the reused hashes in this engine (its prefix-cache hits): turned off with it.
        self.followers: list[Any] = []

    def __call__(self, request: Any) -> list[Any]:
        if self.off is not None or request.block_hashes or not is_plain(request):
            return self.inner(request)  # off, later blocks (decode), requests with extra keys, a pause
        bs = self.block_size
        full = request.num_tokens // bs
        if full == 0:
            return self.inner(request)
        # The request's own tokens, read in place (this runs as vLLM makes the request): copied only
        # if it shares leading blocks with a donor.
        view = request.all_token_ids
        head = view[:bs]
        with self._lock:
            epoch = self._epoch()
            if epoch is not self._donors_epoch:
                self._donors.clear()
                self._donors_epoch = epoch
            matched = any(donor.head == head for donor in self._donors)
            at, k = self._longest(view, head, full) if matched else (-1, 0)
            reused = self._donors[at].hashes[:k] if k else []
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
                if not self.checked:
                    self.checked = True
                    own = self.inner(request)  # the request as vLLM hashes it, from its first block
                    difference = differs(hashes, own)
                    if difference is not None:
                        self._turn_off(difference)
                        self.hashed_blocks += len(own)
                        return own
            self.reused_blocks += len(reused)
            self.hashed_blocks += len(hashes) - len(reused)
            shared = len(reused)
            if not shared and matched:
                # A first block in common, its lender gone (finished): how far the hashes vLLM just
                # computed agree with its, for the gathering (:mod:`.arrivals`) only; nothing reused.
                shared = max(
                    (
                        common_blocks(hashes, d.hashes, 1, min(full, len(d.hashes)))
                        for d in self._donors
                        if d.head == head
                    ),
                    default=0,
                )
            if shared:
                self.sharing.append((getattr(request, "request_id", None), shared * bs))
                donor = _Donor(head, _as_list(view[: full * bs]), hashes[:full], None)
            else:
                donor = _Donor(head, None, hashes[:full], weakref.ref(request))
            self._remember(donor, at, k)
        return hashes

    def held(self) -> dict[str, int]:
        """What this hasher keeps between requests (read-only, for soaks and reports): donors, the tokens
        copied and the hashes they hold, and the ``sharing`` record's entries."""
        with self._lock:
            donors = list(self._donors)
        return {
            "donors": len(donors),
            "donor_tokens": sum(len(d.tokens) for d in donors if d.tokens is not None),
            "donor_hashes": sum(len(d.hashes) for d in donors),
            "sharing": len(self.sharing),
        }

    def _turn_off(self, difference: str) -> None:
        """Stop reusing in this engine (its hits too), saying why once."""
        self.off = f"the first reused hashes differ from vLLM's own: {difference}"
        self._donors.clear()
        self.sharing.clear()
        for follower in self.followers:
            follower.turn_off(f"its engine's block hashes are not reused ({self.off})")
        log_once(
            logging.INFO,
            ("shared-prefix-hashes-differ", difference),
            "MLA shared-prefix prefill (mla-prefill-ext): block hashes, prefix-cache hits and gathering "
            "of shared prefixes turned off in this engine core: %s; vLLM hashes and looks up every request.",
            self.off,
        )

    def _longest(self, tokens: Any, head: list[int], full: int) -> tuple[int, int]:
        """(index of the donor, leading blocks shared) for the donor sharing the most (k = 0: none)."""
        bs = self.block_size
        best, best_at = 0, -1
        for at, donor in enumerate(self._donors):
            limit = min(full, len(donor.hashes))
            if limit <= best or donor.head != head:
                continue
            if donor.tokens is None:  # a request that shared nothing so far: its tokens copied now
                lender = donor.request()
                if lender is None:
                    continue  # finished and gone
                copied = _as_list(lender.all_token_ids[: len(donor.hashes) * bs])
                # A KV connector (disaggregated prefill) may drop the prompt's last tokens after they
                # were hashed and append the output in their place, lowering num_prompt_tokens first:
                # only whole blocks of the prompt as it is now (read after the copy) are compared.
                kept = int(getattr(lender, "num_prompt_tokens", 0) or 0) // bs * bs
                donor = self._donors[at] = _Donor(donor.head, copied[:kept], donor.hashes, None)
                limit = min(limit, kept // bs)
                if limit <= best:
                    continue
            # A donor can only do better if it agrees on the block after the best so far.
            if best and tokens[best * bs : (best + 1) * bs] != donor.tokens[best * bs : (best + 1) * bs]:
                continue
            k = common_blocks(tokens, donor.tokens, bs, limit, self._last_shared)
            if k > best:
                best, best_at = k, at
                if k == full:
                    break
        if best:
            self._last_shared = best
        return best_at, best

    def _remember(self, new: _Donor, at: int, k: int) -> None:
        if k:
            donor = self._donors[at]
            if k == len(donor.hashes) or k == len(new.hashes):  # one holds the other: keep the longer
                del self._donors[at]
                if len(donor.hashes) > len(new.hashes):
                    new = donor
        self._donors.insert(0, new)
        keep_latest_of_each_kind(self._donors, lambda donor: donor.tokens is not None, DONORS)
