"""Verdicts on engine outputs: is a scenario's greedy decode what stock vLLM's is?

A record is one prompt's result as engine_runner.py writes it: ``prompt_len``, ``tokens``, their
``logprobs`` and ``top2`` (the two highest logprobs at each position). A verdict compares a
candidate's records with stock's, prompt by prompt:

* :func:`identical`: the same kernel on both sides: equal tokens, bit-equal logprobs and top-2.
* :func:`bf16_noise`: another kernel: while the tokens agree, the largest ``|logprob difference|``
  stays within ``bound``; a greedy flip is allowed only at a near-tie of stock (its top-1 and top-2
  within ``bound``) and, unless exactly tied, only to stock's runner-up; after a flip that sequence
  is not compared further.
* :func:`family_noise` (a kernel of another family, FA2-like: the bound vLLM's own kernel of that
  family gives, :func:`kernel_family_bound`) and :func:`lifetime_noise` (a prompt set on which stock
  differs between its own engine lifetimes: the bound those give, :func:`lifetime_bound`).

:data:`BF16_NOISE_BOUND` = 0.06: FLASHINFER against stock's FA3 on the sharp checkpoint differed by
0.031 at most (about 2x headroom); a softmax scale 2% off moved logprobs by up to 0.2 and flipped
tokens away from near-ties, and an LSE in base 2 fails too (the mutation scenarios prove both). The
bound is re-justified by each new set of GPU measurements (docs/gpu-verification.md).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

BF16_NOISE_BOUND = 0.06
KERNEL_FAMILY_HEADROOM = 1.25


@dataclass
class Flip:
    """A position where the candidate's greedy token differs from the reference's."""

    prompt: int
    position: int
    reference_token: int
    candidate_token: int
    reference_gap: float | None  # stock's top-1 minus top-2 logprob there (None: not recorded)
    allowed: bool

    def __str__(self) -> str:
        gap = "unknown" if self.reference_gap is None else f"{self.reference_gap:.4g}"
        what = "near-tie, allowed" if self.allowed else "REFUSED"
        flip = f"{self.reference_token} -> {self.candidate_token}"
        return f"prompt {self.prompt} position {self.position}: {flip} (stock top-1/top-2 gap {gap}; {what})"


@dataclass
class Verdict:
    kind: str
    passed: bool
    max_diff: float
    flips: list[Flip] = field(default_factory=list)
    reason: str = ""
    compared_positions: int = 0
    bound: float | None = None
    label: str = ""

    def __str__(self) -> str:
        head = f"{self.label}: " if self.label else ""
        bound = "" if self.bound is None else f", bound {self.bound:g}"
        verdict = "PASSED" if self.passed else "FAILED"
        outcome = f"{self.kind} {verdict}: max |logprob diff| {self.max_diff:.4g}"
        counts = f"over {self.compared_positions} positions{bound}, {len(self.flips)} flip(s)"
        return "\n".join(
            [f"{head}{outcome} {counts}; {self.reason}", *(f"  flip at {f}" for f in self.flips)]
        )


def _shape_problem(candidate: Sequence[dict], reference: Sequence[dict]) -> str | None:
    if len(candidate) != len(reference):
        return f"{len(candidate)} records against {len(reference)}"
    for i, (c, r) in enumerate(zip(candidate, reference, strict=True)):
        if c.get("prompt_len") != r.get("prompt_len"):
            return f"prompt {i}: prompt_len {c.get('prompt_len')} against {r.get('prompt_len')}"
    return None


def _finish(verdict: Verdict) -> Verdict:
    print(verdict, flush=True)
    return verdict


def identical(candidate: Sequence[dict], reference: Sequence[dict], label: str = "") -> Verdict:
    """Same kernel on both sides: equal tokens and bit-equal logprobs (and top-2 logprobs)."""
    problem = _shape_problem(candidate, reference)
    if problem is not None:
        return _finish(Verdict("identical", False, math.inf, reason=problem, label=label))
    max_diff, positions = 0.0, 0
    flips: list[Flip] = []
    problems: list[str] = []
    for i, (c, r) in enumerate(zip(candidate, reference, strict=True)):
        ct, rt = c["tokens"], r["tokens"]
        same = 0  # positions before the first differing token
        while same < min(len(ct), len(rt)) and ct[same] == rt[same]:
            same += 1
        if ct != rt:
            if same < min(len(ct), len(rt)):
                flips.append(Flip(i, same, rt[same], ct[same], _gap(r, same), False))
            problems.append(f"prompt {i}: tokens differ from position {same}")
        diffs = [abs(a - b) for a, b in zip(c["logprobs"][:same], r["logprobs"][:same], strict=True)]
        positions += len(diffs)
        max_diff = max([max_diff, *diffs])
        if c["logprobs"][:same] != r["logprobs"][:same]:
            j = next(j for j, d in enumerate(diffs) if d != 0 or c["logprobs"][j] != r["logprobs"][j])
            problems.append(f"prompt {i}: logprob at position {j} differs by {diffs[j]:.3g}")
        ctop, rtop = c.get("top2"), r.get("top2")
        if ctop is not None and rtop is not None:
            bad = [j for j in range(same) if list(ctop[j]) != list(rtop[j])]
            if bad:
                problems.append(f"prompt {i}: top-2 logprobs differ at position {bad[0]}")
    reason = "; ".join(problems) or "tokens equal, logprobs bit-equal"
    return _finish(Verdict("identical", not problems, max_diff, flips, reason, positions, None, label))


def _gap(record: dict, position: int) -> float | None:
    """Stock's top-1 minus top-2 logprob at ``position``, where the runner recorded both."""
    top2 = record.get("top2")
    if not top2 or position >= len(top2) or len(top2[position]) < 2:
        return None
    return float(top2[position][0]) - float(top2[position][1])


def _runner_up(record: dict, position: int) -> int | None:
    """Stock's second-best token at ``position``, where the runner recorded it."""
    tokens = record.get("top2_tokens")
    if not tokens or position >= len(tokens):
        return None
    # The top-2 token other than the chosen one (an exact tie may list them either way).
    others = [int(t) for t in tokens[position] if t != record["tokens"][position]]
    return others[0] if others else None


def bf16_noise(
    candidate: Sequence[dict],
    reference: Sequence[dict],
    bound: float = BF16_NOISE_BOUND,
    label: str = "",
    runner_up_only: bool = True,
    kind: str = "bf16_noise",
) -> Verdict:
    """Another kernel: logprobs within ``bound`` while tokens agree; flips only at stock near-ties
    (and, with ``runner_up_only``, only to stock's runner-up there)."""
    problem = _shape_problem(candidate, reference)
    if problem is not None:
        return _finish(Verdict(kind, False, math.inf, reason=problem, bound=bound, label=label))
    max_diff, positions = 0.0, 0
    worst = ""
    flips: list[Flip] = []
    problems: list[str] = []
    for i, (c, r) in enumerate(zip(candidate, reference, strict=True)):
        ct, rt = c["tokens"], r["tokens"]
        for j in range(min(len(ct), len(rt))):
            if ct[j] != rt[j]:
                gap = _gap(r, j)
                allowed = gap is not None and gap <= bound
                runner_up = _runner_up(r, j)
                if not allowed:
                    problems.append(f"prompt {i}: greedy token flip at position {j} is not a near-tie")
                elif runner_up_only and runner_up is not None and ct[j] != runner_up and gap > 0:
                    # At an exact tie (gap 0) more than two tokens can share the top logprob
                    # (bf16 logprobs come in steps of 1/64): stock's own runs pick among them.
                    allowed = False
                    problems.append(
                        f"prompt {i}: at the near-tie at position {j} the candidate chose {ct[j]}, "
                        f"not stock's runner-up {runner_up}"
                    )
                flips.append(Flip(i, j, rt[j], ct[j], gap, allowed))
                break  # the rest of this sequence continues from another token
            d = abs(c["logprobs"][j] - r["logprobs"][j])
            positions += 1
            if not math.isfinite(d):  # NaN would slip through a comparison
                d = math.inf
            if d > max_diff:
                max_diff, worst = d, f"prompt {i} position {j}"
        else:
            if len(ct) != len(rt):
                problems.append(f"prompt {i}: {len(ct)} tokens against {len(rt)} without a flip")
    if max_diff > bound:
        problems.insert(0, f"max |logprob diff| {max_diff:.4g} at {worst} exceeds the bound {bound:g}")
    within = "bf16 noise" if kind == "bf16_noise" else f"the bound ({kind})"
    reason = "; ".join(problems) or f"within {within} (largest difference at {worst or 'none'})"
    return _finish(Verdict(kind, not problems, max_diff, flips, reason, positions, bound, label))


def kernel_family_bound(calibration: Verdict, headroom: float = KERNEL_FAMILY_HEADROOM) -> float:
    """The bound for a kernel of another family than stock's: ``headroom`` x the largest logprob
    difference or near-tie gap of ``calibration`` (vLLM's own kernel of that family against stock,
    passed or not); never below :data:`BF16_NOISE_BOUND`."""
    if calibration.compared_positions == 0 or not math.isfinite(calibration.max_diff):
        raise ValueError(f"a calibration must compare positions and stay finite: {calibration}")
    gaps = [f.reference_gap for f in calibration.flips if f.reference_gap is not None]
    return max(BF16_NOISE_BOUND, headroom * max([calibration.max_diff, *gaps]))


def family_noise(
    candidate: Sequence[dict], reference: Sequence[dict], calibration: Verdict, label: str = ""
) -> Verdict:
    """Another kernel family: :func:`bf16_noise` with :func:`kernel_family_bound` of ``calibration``,
    a near-tie flip to any token (vLLM's own FA2 picked a third token at one, docs/gpu-verification.md)."""
    bound = kernel_family_bound(calibration)
    return bf16_noise(candidate, reference, bound, label, runner_up_only=False, kind="family_noise")


def lifetime_calibrations(lifetimes: Sequence[tuple[str, Sequence[dict]]]) -> list[Verdict]:
    """Stock against stock: :func:`bf16_noise` of every pair of ``lifetimes`` (label, records)."""
    return [
        bf16_noise(a, b, label=f"{la} vs {lb}") for (la, a), (lb, b) in itertools.combinations(lifetimes, 2)
    ]


def lifetime_bound(calibrations: Sequence[Verdict], headroom: float = KERNEL_FAMILY_HEADROOM) -> float:
    """The widest of ``calibrations`` (stock lifetimes against each other), each read as
    :func:`kernel_family_bound` reads one."""
    if not calibrations:
        raise ValueError("a lifetime bound needs at least one stock-against-stock verdict")
    return max(kernel_family_bound(c, headroom) for c in calibrations)


def lifetime_noise(
    candidate: Sequence[dict], reference: Sequence[dict], calibrations: Sequence[Verdict], label: str = ""
) -> Verdict:
    """No further from a stock lifetime than stock's lifetimes are from each other (a prompt set where
    they differ beyond :data:`BF16_NOISE_BOUND`: the shared-prefix set): :func:`bf16_noise` with
    :func:`lifetime_bound`, a near-tie flip to any token (stock's own lifetimes pick different ones)."""
    bound = lifetime_bound(calibrations)
    return bf16_noise(candidate, reference, bound, label, runner_up_only=False, kind="lifetime_noise")


def summary(verdict: Verdict) -> dict[str, Any]:
    """The verdict as plain data (for JSON)."""
    keys = ("kind", "label", "passed", "max_diff", "bound", "compared_positions", "reason")
    return {**{k: getattr(verdict, k) for k in keys}, "flips": [vars(f) for f in verdict.flips]}
