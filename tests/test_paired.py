"""A speedup over paired steps: its ratios, spread and noise verdict (pure, no processes)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

import rrfp_async as rr
from rrfp_async.observability import PairedRatio, paired_ratio

pytestmark = pytest.mark.timeout(60)


def test_ratios_are_paired_step_by_step_not_a_ratio_of_medians() -> None:
    # Step 0 is long for both, step 2 short for both: pairing compares like with like.
    r = paired_ratio([1.0, 4.0, 0.5] * 2, [0.8, 3.2, 0.4] * 2)
    assert r.ratios == pytest.approx((1.25,) * 6)
    assert r.median == pytest.approx(1.25) and r.low == r.median == pytest.approx(r.high)
    assert not r.within_noise and r.verdict == "faster in 6 of 6 steps"
    assert str(r) == "1.250x (1.25–1.25)"


def test_few_steps_never_claim_a_difference() -> None:
    """5 of 5 faster happens by chance with p = 2/32: not evidence at 5 %."""
    r = paired_ratio([1.0] * 5, [0.5] * 5)
    assert r.p_value == pytest.approx(0.0625) and r.within_noise and r.verdict == "within noise"
    assert paired_ratio([1.0] * 6, [0.5] * 6).verdict == "faster in 6 of 6 steps"


def test_one_slow_step_among_many_does_not_flip_the_verdict() -> None:
    """A load spike in one step of 8: 7 of 8 faster is still evidence (p = 0.07 > 5 % is
    not; 8 of 9 with p = 0.039 is)."""
    assert paired_ratio([1.0] * 8, [0.9] * 7 + [1.2]).verdict == "within noise"
    r = paired_ratio([1.0] * 9, [0.9] * 8 + [1.2])
    assert r.faster_steps == 8 and r.slower_steps == 1 and r.p_value == pytest.approx(20 / 512)
    assert r.verdict == "faster in 8 of 9 steps" and r.spread == "0.83–1.11"


def test_slower() -> None:
    r = paired_ratio([1.0, 2.0] * 3, [1.5, 2.5] * 3)
    assert r.verdict == "slower in 6 of 6 steps" and r.median < 1


def test_equal_steps_count_for_neither_side() -> None:
    r = paired_ratio([1.0] * 8, [1.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5])
    assert (r.faster_steps, r.slower_steps) == (6, 0)
    assert r.verdict == "faster in 6 of 8 steps"


def test_one_step_has_no_spread_and_is_noise() -> None:
    r = paired_ratio([2.0], [1.0])
    assert r.median == 2.0 and (r.low, r.high) == (0.0, math.inf)
    assert r.within_noise and r.spread == "no spread (1 step)"


def test_same_order_is_named_noise_next_to_the_verdict() -> None:
    r = paired_ratio([1.0] * 6, [0.8] * 6, same_order=True)
    assert r.verdict == "faster in 6 of 6 steps"  # the machine drifted between the runs
    assert r.note("strict") == "faster in 6 of 6 steps; same order as strict: ratio is noise"
    assert paired_ratio([1.0] * 6, [0.8] * 6).note("strict") == "faster in 6 of 6 steps"


@pytest.mark.parametrize(
    ("base", "cand", "msg"),
    [
        ([], [], "at least one"),
        ([1.0], [1.0, 2.0], "equal lengths"),
        ([1.0], [0.0], "finite and > 0"),
        ([math.nan], [1.0], "finite and > 0"),
        ([1.0], [math.inf], "finite and > 0"),
    ],
)
def test_bad_input_is_refused(base: list[float], cand: list[float], msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        paired_ratio(base, cand)


def test_public() -> None:
    assert rr.paired_ratio is paired_ratio and rr.PairedRatio is PairedRatio


times = st.floats(min_value=1e-3, max_value=1e3, allow_nan=False)


@given(st.lists(st.tuples(times, times), min_size=1, max_size=12), st.booleans())
def test_verdict_is_the_exact_sign_test(pairs: list[tuple[float, float]], same: bool) -> None:
    base, cand = [b for b, _ in pairs], [c for _, c in pairs]
    r = paired_ratio(base, cand, same_order=same)
    ratios = [b / c for b, c in pairs]
    # The test computed here independently: every outcome of n fair coin flips (n <= 12)
    # as likely as any other; p = the share of outcomes at least as lopsided as this one.
    up, down = sum(x > 1 for x in ratios), sum(x < 1 for x in ratios)
    n = up + down
    k = max(up, down)
    extreme = sum(
        1 for bits in range(2**n) if max(bin(bits).count("1"), n - bin(bits).count("1")) >= k
    )
    p = extreme / 2**n if n else 1.0
    assert r.p_value == pytest.approx(p)
    noise = p > 0.05
    assert ("within noise" in r.verdict) == noise
    assert ("within noise" in r.note("strict")) == noise
    assert ("same order as strict" in r.note("strict")) == same
    assert (r.low, r.high) == ((min(ratios), max(ratios)) if len(ratios) > 1 else (0.0, math.inf))
    assert r.low <= r.median <= r.high
    if not noise:
        word, count = ("faster", up) if up > down else ("slower", down)
        assert r.verdict == f"{word} in {count} of {len(ratios)} steps"
