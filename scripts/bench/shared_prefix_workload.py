"""The shared-prefix engine benchmark's load: its sides, its points and the prompts of each repetition.

Pure (no vLLM, no GPU): shared_prefix_engine runs it; tests/bench checks it on any machine.

A point is one scenario at one size: ``shared`` (B requests, one cached prefix of P tokens, N fresh
tokens each), ``private`` (B requests, each its own cached prefix of P tokens, N fresh each),
``fresh`` (B requests of N fresh tokens, nothing cached) and ``decode`` (as ``shared``, generating
``max_tokens`` tokens each). The cached prefixes are the same in every repetition (warmed once into
each engine's prefix cache); the fresh tokens differ from request to request and from repetition to
repetition, so only the prefixes hit the cache; every side gets the same prompts in one repetition.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from . import path_parts
from .common import seeded_tokens
from .engine import CUDAGRAPH_MODE_ENV, GATHER_ENV, SHARED_PREFIX_ENV

SCENARIOS = ("shared", "private", "fresh", "decode")
NOSHARE = "noshare"
# NAME:decode: decode rows served too (MLA_PREFILL_SHARED_DECODE=1); NAME:decode-piecewise: with piecewise
# CUDA graphs only, so that decode steps' attention runs outside a graph, where the path serves it
DECODE = "decode"
NOGATHER = "nogather"
GATHER = "gather"
GATHER_MS = "100"  # the window a NAME:gather side opts in to (NAME:gatherMS: another)
PAUSE = "pause"
PAUSE_PARTS = path_parts.PARTS


@dataclass(frozen=True)
class SideSpec:
    """One engine of the run: ``stock`` (the add-on disabled; ``stock:2`` another such lifetime) or
    a backend, with the shared-prefix path as the add-on sets it (default), turned off
    (``NAME:noshare``), with the engine core's gathering of a burst opted in (``NAME:gather``, 100 ms;
    ``NAME:gather40``, 40 ms) or explicitly off (``NAME:nogather``); or no engine of its own:
    ``NAME:pause`` runs its calls on the engine of the side ``NAME`` with the path paused there for them
    (``path_parts.pause``, all parts; ``NAME:pause-route+hits``: those parts, with what they imply), so the
    path on and off compare
    within one engine lifetime."""

    label: str
    backend: str  # "stock" or the add-on's backend name, as engine.start_engine takes it
    env: tuple[tuple[str, str], ...] = ()  # more switches for this engine's processes
    engine: str | None = None  # a pause side: the label of the side whose engine runs its calls
    pause: tuple[str, ...] = ()  # the parts paused during this side's calls

    @property
    def extra_env(self) -> dict[str, str]:
        return dict(self.env)


def _window_ms(text: str) -> int | None:
    """``40`` in ``NAME:gather40``: a window from 1 to 1000 ms the add-on accepts (None: not one)."""
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= 1000:
        return None
    return int(text)


def parse_sides(text: str) -> list[SideSpec]:
    """``stock,FLASH_ATTN,FLASH_ATTN:noshare`` -> the run's engines, in that order.

    ``stock:2`` is a second stock engine: its ratio to ``stock`` is what two lifetimes of the same
    engine differ by in this run (a control for the other sides' ratios); ``FLASH_ATTN:2`` and
    ``FLASH_ATTN:noshare:2`` are the same for the add-on's sides."""
    sides: list[SideSpec] = []
    for raw in text.split(","):
        label = raw.strip()
        name, _, mode = label.partition(":")
        if not name:
            raise ValueError(f"empty side in {text!r}")
        mode, lifetime = _split_lifetime(label, mode)
        if name.lower() == "stock":
            if mode or (lifetime is not None and lifetime < 2):
                raise ValueError(
                    f"side {label!r}: stock runs none of the add-on, it has no {mode or str(lifetime)!r} "
                    "(stock:2, stock:3, ...: another stock lifetime, the noise floor of a paired ratio)"
                )
            side = SideSpec(f"stock:{lifetime}" if lifetime else "stock", "stock")
        else:
            side = _configured(label, name.upper(), mode, sides)
            if lifetime is not None:
                side = _another_lifetime(label, side, lifetime)
        if any(s.label == side.label for s in sides):
            raise ValueError(f"side {side.label!r} listed twice")
        sides.append(side)
    return sides


def _split_lifetime(label: str, mode: str) -> tuple[str, int | None]:
    """``noshare:2`` -> (``noshare``, 2), ``2`` -> ("", 2), ``noshare`` -> (``noshare``, None): a side's
    mode and the lifetime number that may end it (one mode, one number, in that order)."""
    if not mode:
        return "", None
    *rest, last = mode.split(":")
    number = last.isascii() and last.isdigit()
    empty = not last or any(not p for p in rest)
    if empty or len(rest) > (1 if number else 0) or any(p.isascii() and p.isdigit() for p in rest):
        raise ValueError(
            f"side {label!r}: write NAME, NAME:MODE, NAME:N or NAME:MODE:N (one mode, then at most one "
            "lifetime number, e.g. FLASH_ATTN:noshare:2)"
        )
    return (":".join(rest), int(last)) if number else (mode, None)


def _configured(label: str, name: str, mode: str, earlier: list[SideSpec]) -> SideSpec:
    """Side ``NAME[:MODE]`` of a backend: its engine's switches, or the engine it shares (a pause side)."""
    if not mode:
        return SideSpec(name, name)
    if mode.lower() == NOSHARE:
        return SideSpec(f"{name}:{NOSHARE}", name, ((SHARED_PREFIX_ENV, "0"),))
    if mode.lower() in (DECODE, f"{DECODE}-piecewise"):
        graphs = ((CUDAGRAPH_MODE_ENV, "PIECEWISE"),) if mode.lower() != DECODE else ()
        return SideSpec(f"{name}:{mode.lower()}", name, (("MLA_PREFILL_SHARED_DECODE", "1"), *graphs))
    if mode.lower() == NOGATHER or (
        mode.lower().startswith(GATHER) and _window_ms(mode[len(GATHER) :]) is not None
    ):
        window = "0" if mode.lower() == NOGATHER else mode[len(GATHER) :]
        return SideSpec(f"{name}:{mode.lower()}", name, ((GATHER_ENV, window),))
    if mode.lower() == GATHER:
        return SideSpec(f"{name}:{GATHER}", name, ((GATHER_ENV, GATHER_MS),))
    if mode.lower() == PAUSE or mode.lower().startswith(PAUSE + "-"):
        return _pause_side(label, name, mode.lower(), earlier)
    raise ValueError(
        f"side {label!r}: unknown mode {mode!r} (NAME, NAME:{NOSHARE}, NAME:{DECODE}[-piecewise], "
        f"NAME:{GATHER}, NAME:{GATHER}MS, NAME:{NOGATHER}, NAME:{PAUSE} or NAME:{PAUSE}-PART+PART; any but a "
        "pause side with :N, another lifetime)"
    )


def _another_lifetime(label: str, first: SideSpec, lifetime: int) -> SideSpec:
    """``NAME:2``, ``NAME:noshare:3``: another engine configured as ``first`` (its own lifetime, as
    ``stock:2`` is stock's), so that lifetimes of one configuration can be told from a cost."""
    if first.engine:
        raise ValueError(f"side {label!r}: a pause side runs on another side's engine, it has no lifetime")
    if lifetime < 2:
        raise ValueError(f"side {label!r}: a lifetime is 2 or more ({first.label} itself is the first)")
    return SideSpec(f"{first.label}:{lifetime}", first.backend, first.env)


def _pause_side(label: str, name: str, mode: str, earlier: list[SideSpec]) -> SideSpec:
    """``NAME:pause[-PART+PART]``: the calls of the earlier side ``NAME`` (its own engine, the path as
    the add-on sets it), with those parts of the path paused during them."""
    parts = tuple(PAUSE_PARTS) if mode == PAUSE else tuple(mode[len(PAUSE) + 1 :].split("+"))
    unknown = [p for p in parts if p not in PAUSE_PARTS]
    if unknown or not parts:
        raise ValueError(f"side {label!r}: unknown part(s) {unknown}; the parts are {'+'.join(PAUSE_PARTS)}")
    host = next((s for s in earlier if s.label == name), None)
    if host is None:
        raise ValueError(f"side {label!r} runs on the engine of side {name!r}: list {name} before it")
    parts = tuple(path_parts.with_implied(parts))  # what a part implies is paused with it
    suffix = PAUSE if parts == PAUSE_PARTS else f"{PAUSE}-{'+'.join(parts)}"
    return SideSpec(f"{name}:{suffix}", host.backend, host.env, engine=host.label, pause=parts)


def pauses_before_calls(sides: list[SideSpec]) -> dict[str, tuple[str, ...] | None]:
    """Per side, the parts its engine pauses before each of the side's calls (``()``: none, all
    resumed); None where its engine hosts no pause side and is never asked."""
    hosts = {s.engine for s in sides if s.engine}
    return {s.label: (s.pause if (s.engine or s.label) in hosts else None) for s in sides}


def sharing_an_engine(sides: list[SideSpec]) -> set[str]:
    """The sides whose engine runs another side's calls too (a pause side and its host): those asked
    to pause before their calls."""
    return {label for label, parts in pauses_before_calls(sides).items() if parts is not None}


def parse_points(text: str) -> list[tuple[int, int]]:
    """``16x32,8x1024`` -> [(B, N), ...]: B requests of N fresh tokens each."""
    points = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"point {item!r}: write BxN, both positive integers (e.g. 16x32)")
        points.append((int(parts[0]), int(parts[1])))
    return points


def parse_ints(text: str, minimum: int = 1) -> list[int]:
    """``32768,8192`` -> [32768, 8192] (each at least ``minimum``)."""
    values = [int(v) for v in text.split(",")]
    if any(v < minimum for v in values):
        raise ValueError(f"{text!r}: integers of at least {minimum} only")
    return values


@dataclass(frozen=True)
class Point:
    """One scenario at one size: B requests, each a prefix of P cached tokens (0: none) + N fresh."""

    scenario: str
    prefix_len: int
    batch: int
    new_tokens: int
    max_tokens: int = 1

    @property
    def key(self) -> str:
        out = f" out={self.max_tokens}" if self.max_tokens != 1 else ""
        return f"{self.scenario} P={self.prefix_len} B={self.batch} N={self.new_tokens}{out}"

    @property
    def prompt_len(self) -> int:
        return self.prefix_len + self.new_tokens

    def cached_tokens(self) -> int:
        """Prompt tokens the prefix cache serves in a timed run, all requests together."""
        return self.batch * self.prefix_len


def build_points(
    scenarios: list[str],
    prefix_lens: list[int],
    points: list[tuple[int, int]],
    private_prefix_len: int,
    private_points: list[tuple[int, int]],
    decode_prefix_len: int,
    decode_points: list[tuple[int, int]],
    decode_tokens: int,
) -> list[Point]:
    """The run's points, scenario by scenario in the order given."""
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenario(s) {unknown}: choose from {', '.join(SCENARIOS)}")
    out: list[Point] = []
    for scenario in scenarios:
        if scenario == "shared":
            out += [Point("shared", p, b, n) for p in prefix_lens for b, n in points]
        elif scenario == "private":
            out += [Point("private", private_prefix_len, b, n) for b, n in private_points]
        elif scenario == "fresh":
            out += [Point("fresh", 0, b, n) for b, n in points]
        else:
            out += [Point("decode", decode_prefix_len, b, n, decode_tokens) for b, n in decode_points]
    return out


def check_fits(points: list[Point], max_model_len: int) -> None:
    """Every request (its prompt and what it generates) fits ``max_model_len``."""
    too_long = [p.key for p in points if p.prompt_len + p.max_tokens > max_model_len]
    if too_long:
        raise ValueError(f"longer than --max-model-len {max_model_len}: {too_long}")


@functools.lru_cache(maxsize=64)
def _tokens(seed: str, length: int, vocab: int) -> tuple[int, ...]:
    return tuple(seeded_tokens(seed, length, vocab))  # prefixes: made once per process


def prefixes(point: Point, vocab: int) -> list[tuple[int, ...]]:
    """The cached prefixes a point's requests start with, one per request (shared: the same one)."""
    if point.prefix_len == 0:
        return [()] * point.batch
    if point.scenario == "private":
        return [
            _tokens(f"private/{point.prefix_len}/{i}", point.prefix_len, vocab) for i in range(point.batch)
        ]
    # shared and decode: one prefix per length, so the decode mix reuses what the shared points cached
    return [_tokens(f"shared/{point.prefix_len}", point.prefix_len, vocab)] * point.batch


def warm_prompts(point: Point, vocab: int) -> list[list[int]]:
    """What is sent untimed before a point's timed runs so that its prefixes are in the cache."""
    if point.prefix_len == 0:
        return []
    return [list(p) for p in dict.fromkeys(prefixes(point, vocab))]  # a shared prefix once


def timed_prompts(point: Point, rep: int, vocab: int, own: str = "") -> list[list[int]]:
    """Repetition ``rep``'s prompts: each request's prefix + N tokens of its own, new every repetition.
    ``own``: a side sharing its engine with another gets fresh tokens of its own (the same lengths and
    prefixes), or the second to run would find the first's whole prompts cached."""
    tag = f"/{own}" if own else ""
    return [
        [*prefix, *seeded_tokens(f"{point.key}/rep{rep}/request{i}{tag}", point.new_tokens, vocab)]
        for i, prefix in enumerate(prefixes(point, vocab))
    ]
