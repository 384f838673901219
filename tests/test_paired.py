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
    r = paired_ratio([1.0, 4.0, 0.5], [0.8, 3.2, 0.4])
    assert r.ratios == pytest.approx((1.25, 1.25, 1.25))
    assert r.median == pytest.approx(1.25) and r.low == r.median == pytest.approx(r.high)
    assert not r.within_noise and r.verdict == "faster in every step"
    assert str(r) == "1.250x (1.25–1.25)"


def test_a_spread_that_covers_one_is_within_noise() -> None:
    r = paired_ratio([1.0, 1.0, 1.0, 1.0], [0.8, 1.1, 0.9, 0.95])
    assert (r.low, r.high) == pytest.approx((1 / 1.1, 1.25))
    assert r.within_noise and r.verdict == "within noise"
    assert r.spread == "0.91–1.25"


def test_slower_in_every_step() -> None:
    r = paired_ratio([1.0, 2.0], [1.5, 2.5])
    assert r.verdict == "slower in every step" and r.median < 1


def test_one_step_has_no_spread_and_is_noise() -> None:
    r = paired_ratio([2.0], [1.0])
    assert r.median == 2.0 and (r.low, r.high) == (0.0, math.inf)
    assert r.within_noise and r.spread == "no spread (1 step)"


def test_same_order_is_named_noise_next_to_the_verdict() -> None:
    r = paired_ratio([1.0, 1.0], [0.8, 0.9], same_order=True)
    assert r.verdict == "faster in every step"  # the machine drifted between the runs
    assert r.note("strict") == "faster in every step; same order as strict: ratio is noise"
    assert paired_ratio([1.0, 1.0], [0.8, 0.9]).note("strict") == "faster in every step"


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
def test_verdict_says_within_noise_iff_the_interval_covers_one(
    pairs: list[tuple[float, float]], same: bool
) -> None:
    base, cand = [b for b, _ in pairs], [c for _, c in pairs]
    r = paired_ratio(base, cand, same_order=same)
    ratios = [b / c for b, c in pairs]
    # The interval, computed here independently: min-max of the paired ratios, or
    # unbounded for a single step.
    lo, hi = (min(ratios), max(ratios)) if len(ratios) > 1 else (0.0, math.inf)
    assert (r.low, r.high) == (lo, hi)
    covers = lo <= 1.0 <= hi
    assert ("within noise" in r.verdict) == covers
    assert ("within noise" in r.note("strict")) == covers
    assert ("same order as strict" in r.note("strict")) == same
    assert r.low <= r.median <= r.high
    if not covers:
        assert r.verdict == ("faster in every step" if lo > 1 else "slower in every step")
