"""The GPU suite's verdicts (scripts/gpu_harness/verdict.py) on made-up engine records."""

from __future__ import annotations

import copy
import math

import pytest

from scripts.gpu_harness import verdict

BOUND = verdict.BF16_NOISE_BOUND


def record(tokens: list[int], logprobs: list[float], gaps: list[float] | None = None, prompt_len: int = 100):
    """A runner record; ``gaps``: stock's top-1 minus top-2 logprob per position."""
    gaps = gaps or [1.0] * len(tokens)
    return {
        "prompt_len": prompt_len,
        "tokens": tokens,
        "logprobs": logprobs,
        "top2": [[lp, lp - g] for lp, g in zip(logprobs, gaps, strict=True)],
        "num_cached_tokens": 0,
    }


@pytest.fixture
def stock() -> list[dict]:
    return [
        record([5, 6, 7, 8], [-0.5, -1.0, -0.25, -2.0], prompt_len=100),
        record([9, 10, 11], [-0.1, -0.7, -1.5], gaps=[2.0, 0.02, 3.0], prompt_len=7),
    ]


def test_identical_passes_bit_equal_records(stock):
    v = verdict.identical(copy.deepcopy(stock), stock, label="same")
    assert v.passed and v.max_diff == 0.0 and v.flips == [] and v.compared_positions == 7
    assert "PASSED" in str(v)


def test_identical_refuses_the_smallest_logprob_difference(stock):
    cand = copy.deepcopy(stock)
    cand[0]["logprobs"][2] = math.nextafter(cand[0]["logprobs"][2], 0.0)
    v = verdict.identical(cand, stock)
    assert not v.passed and 0 < v.max_diff < 1e-15
    assert "prompt 0: logprob at position 2" in v.reason


def test_identical_refuses_a_top2_difference(stock):
    cand = copy.deepcopy(stock)
    cand[1]["top2"][0][1] -= 1e-3
    v = verdict.identical(cand, stock)
    assert not v.passed and "top-2 logprobs differ at position 0" in v.reason


def test_identical_refuses_a_token_flip_even_at_a_near_tie(stock):
    cand = copy.deepcopy(stock)
    cand[1]["tokens"][1] = 99  # stock's gap there is 0.02: a near-tie, still not identical
    v = verdict.identical(cand, stock)
    assert not v.passed and len(v.flips) == 1 and v.flips[0].position == 1
    assert "tokens differ from position 1" in v.reason


def test_noise_within_the_bound_passes(stock):
    cand = copy.deepcopy(stock)
    cand[0]["logprobs"] = [x + 0.03 for x in cand[0]["logprobs"]]
    v = verdict.bf16_noise(cand, stock)
    assert v.passed and v.max_diff == pytest.approx(0.03) and v.bound == BOUND


def test_flip_at_a_near_tie_is_allowed_and_ends_the_comparison(stock):
    cand = copy.deepcopy(stock)
    cand[1]["tokens"][1:] = [42, 43]  # flip where stock's top-1/top-2 gap is 0.02
    cand[1]["logprobs"][1:] = [-0.69, -9.0]  # after the flip: not compared
    v = verdict.bf16_noise(cand, stock)
    assert v.passed, v.reason
    assert [(f.prompt, f.position, f.allowed) for f in v.flips] == [(1, 1, True)]
    assert v.compared_positions == 4 + 1
    assert "near-tie, allowed" in str(v)


def test_near_tie_flip_must_pick_stocks_runner_up(stock):
    for r in stock:
        r["top2_tokens"] = [[t, t + 1000] for t in r["tokens"]]
    to_runner_up = copy.deepcopy(stock)
    to_runner_up[1]["tokens"][1] = stock[1]["tokens"][1] + 1000
    assert verdict.bf16_noise(to_runner_up, stock).passed
    elsewhere = copy.deepcopy(stock)
    elsewhere[1]["tokens"][1] = 42  # near-tie position, but a third token
    v = verdict.bf16_noise(elsewhere, stock)
    assert not v.passed and not v.flips[0].allowed and "runner-up" in v.reason


def test_at_an_exact_tie_any_tied_token_may_win(stock):
    """bf16 logprobs come in 1/64 steps: three tokens can tie, and stock's own runs pick among them."""
    for r in stock:
        r["top2_tokens"] = [[t, t + 1000] for t in r["tokens"]]
    stock[1]["top2"][1] = [stock[1]["top2"][1][0]] * 2  # top-1 and top-2 exactly tied
    third = copy.deepcopy(stock)
    third[1]["tokens"][1] = 42
    assert verdict.bf16_noise(third, stock).passed


def test_real_flip_is_refused(stock):
    cand = copy.deepcopy(stock)
    cand[0]["tokens"][1] = 77  # stock's gap there is 1.0: no near-tie
    v = verdict.bf16_noise(cand, stock)
    assert not v.passed
    assert [(f.prompt, f.position, f.allowed) for f in v.flips] == [(0, 1, False)]
    assert "prompt 0: greedy token flip at position 1 is not a near-tie" in v.reason
    assert "REFUSED" in str(v)


def test_bound_exceeded_fails(stock):
    cand = copy.deepcopy(stock)
    cand[1]["logprobs"][2] -= 0.2  # the 2%-scale mutant's size of error
    v = verdict.bf16_noise(cand, stock)
    assert not v.passed and v.max_diff == pytest.approx(0.2)
    assert "exceeds the bound" in v.reason and "prompt 1 position 2" in v.reason


def test_difference_before_a_flip_still_counts(stock):
    cand = copy.deepcopy(stock)
    cand[1]["logprobs"][0] -= 0.1
    cand[1]["tokens"][1] = 42  # allowed near-tie flip after an out-of-bound position
    v = verdict.bf16_noise(cand, stock)
    assert not v.passed and v.max_diff == pytest.approx(0.1)


def test_custom_bound(stock):
    cand = copy.deepcopy(stock)
    cand[0]["logprobs"][0] += 0.05
    assert verdict.bf16_noise(cand, stock, bound=0.06).passed
    assert not verdict.bf16_noise(cand, stock, bound=0.04).passed


def test_nan_logprob_fails(stock):
    cand = copy.deepcopy(stock)
    cand[0]["logprobs"][0] = float("nan")
    v = verdict.bf16_noise(cand, stock)
    assert not v.passed and v.max_diff == math.inf


def test_flip_without_recorded_top2_is_refused(stock):
    ref = copy.deepcopy(stock)
    for r in ref:
        del r["top2"]
    cand = copy.deepcopy(ref)
    cand[1]["tokens"][1] = 42
    v = verdict.bf16_noise(cand, ref)
    assert not v.passed and v.flips[0].reference_gap is None


@pytest.mark.parametrize("check", [verdict.identical, verdict.bf16_noise])
def test_mismatched_prompt_sets_fail(stock, check):
    assert not check(stock[:1], stock).passed
    other = copy.deepcopy(stock)
    other[0]["prompt_len"] = 101
    v = check(other, stock)
    assert not v.passed and "prompt_len" in v.reason


def test_shorter_output_without_a_flip_fails(stock):
    cand = copy.deepcopy(stock)
    cand[0]["tokens"] = cand[0]["tokens"][:3]
    cand[0]["logprobs"] = cand[0]["logprobs"][:3]
    v = verdict.bf16_noise(cand, stock)
    assert not v.passed and "3 tokens against 4" in v.reason


def test_verdict_prints_itself(stock, capsys):
    verdict.bf16_noise(stock, stock, label="shim-fi vs stock")
    out = capsys.readouterr().out
    assert out.startswith("shim-fi vs stock: bf16_noise PASSED")
    assert verdict.summary(verdict.bf16_noise(stock, stock))["passed"] is True


def test_bound_is_between_the_measured_noise_and_the_mutant():
    """The justification in verdict.py: FlashInfer noise 0.031 < bound < 2%-scale mutant's 0.2."""
    assert 0.031 < BOUND < 0.2
    assert BOUND >= 1.5 * 0.031


def calibration_of(stock: list[dict], shift: float, flip_gap: float | None = None) -> verdict.Verdict:
    """The verdict of a made-up 'vLLM's own kernel of another family' against stock."""
    other = copy.deepcopy(stock)
    other[0]["logprobs"] = [x + shift for x in other[0]["logprobs"]]
    return verdict.bf16_noise(other, stock)


def test_the_kernel_family_bound_is_the_calibrations_spread_with_headroom(stock):
    wide = calibration_of(stock, 0.094)
    assert not wide.passed  # over the FA3 family's bound, as vLLM's own FA2 was on the H200
    assert verdict.kernel_family_bound(wide) == pytest.approx(0.094 * verdict.KERNEL_FAMILY_HEADROOM)
    assert verdict.kernel_family_bound(calibration_of(stock, 0.01)) == BOUND  # never below the FA3 one
    nothing = verdict.bf16_noise([], [])
    with pytest.raises(ValueError, match="must compare positions"):
        verdict.kernel_family_bound(nothing)


def test_family_noise_takes_the_calibrated_bound_and_any_token_at_a_near_tie(stock):
    calibration = calibration_of(stock, 0.094)
    bound = verdict.kernel_family_bound(calibration)
    cand = copy.deepcopy(stock)
    cand[0]["logprobs"] = [x - 0.1 for x in cand[0]["logprobs"]]  # > 0.06, < 0.1175
    cand[1]["tokens"][1] = 99  # a third token at stock's near-tie (gap 0.02)
    assert not verdict.bf16_noise(cand, stock).passed
    v = verdict.family_noise(cand, stock, calibration)
    assert v.passed and v.kind == "family_noise" and v.bound == bound
    assert "within the bound (family_noise)" in v.reason


def test_family_noise_refuses_what_the_calibration_does_not_cover(stock):
    calibration = calibration_of(stock, 0.094)
    further = copy.deepcopy(stock)
    further[0]["logprobs"] = [x - 0.13 for x in further[0]["logprobs"]]  # a 2%-scale mutant's size
    v = verdict.family_noise(further, stock, calibration)
    assert not v.passed and "exceeds the bound" in v.reason
    flip = copy.deepcopy(stock)
    flip[1]["tokens"][2] = 99  # stock's gap there is 3.0: no near-tie at any bound
    v = verdict.family_noise(flip, stock, calibration)
    assert not v.passed and "is not a near-tie" in v.reason


# --- lifetime_noise: the bound from stock's own lifetimes ---------------------------------------


def _lifetime(stock: list[dict], shift: float, flip_gap: float | None = None) -> list[dict]:
    """A stock lifetime: every logprob moved by ``shift``; with ``flip_gap``, the second prompt's
    second token flips where the reference's top-1/top-2 gap is ``flip_gap``."""
    other = copy.deepcopy(stock)
    for r in other:
        r["logprobs"] = [lp + shift for lp in r["logprobs"]]
    if flip_gap is not None:
        other[1]["tokens"][1] = 99
    return other


def test_the_lifetime_bound_is_the_widest_stock_pair_with_headroom(stock):
    wide = copy.deepcopy(stock)
    wide[1]["top2"][1][1] = wide[1]["top2"][1][0] - 0.1  # stock's gap 0.1 where the other lifetime flips
    pairs = [
        verdict.bf16_noise(_lifetime(stock, 0.02), stock),  # 0.02 apart, passes bf16_noise
        verdict.bf16_noise(_lifetime(wide, 0.0, flip_gap=0.1), wide),  # a flip at gap 0.1: fails it
    ]
    assert pairs[0].passed and not pairs[1].passed
    assert verdict.lifetime_bound(pairs) == pytest.approx(verdict.KERNEL_FAMILY_HEADROOM * 0.1)
    with pytest.raises(ValueError, match="at least one"):
        verdict.lifetime_bound([])


def test_within_stocks_own_spread_passes_and_a_wrong_path_does_not(stock):
    calibration = [verdict.bf16_noise(_lifetime(stock, 0.1), stock)]  # stock's lifetimes 0.1 apart
    assert not calibration[0].passed  # beyond BF16_NOISE_BOUND: bf16_noise alone would fail everyone
    within = verdict.lifetime_noise(_lifetime(stock, 0.11), stock, calibration)
    assert within.passed and within.kind == "lifetime_noise" and within.bound == pytest.approx(0.125)
    assert not verdict.lifetime_noise(_lifetime(stock, 0.13), stock, calibration).passed
    wrong = copy.deepcopy(stock)
    wrong[0]["tokens"][0] = 42  # a flip where stock's gap is 1.0: not a near-tie at any bound here
    assert not verdict.lifetime_noise(wrong, stock, calibration).passed
