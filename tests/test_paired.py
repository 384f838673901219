"""A speedup over paired steps: its ratios, spread and noise verdict (pure, no processes)."""

from __future__ import annotations

import math
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

import rrfp_async as rr
from rrfp_async.observability import PairedRatio, paired_ratio
from rrfp_async.observability._paired import min_judged_steps

pytestmark = pytest.mark.timeout(60)


def test_ratios_are_paired_step_by_step_not_a_ratio_of_medians() -> None:
    # Step 0 is long for both, step 2 short for both: pairing compares like with like.
    r = paired_ratio([1.0, 4.0, 0.5] * 2, [0.8, 3.2, 0.4] * 2)
    assert r.ratios == pytest.approx((1.25,) * 6)
    assert r.median == pytest.approx(1.25) and r.low == r.median == pytest.approx(r.high)
    assert not r.within_noise and r.verdict == "faster in 6 of 6 steps"
    assert str(r) == "1.250x (1.25–1.25)"


def test_few_steps_never_claim_a_difference() -> None:
    """5 of 5 faster happens by chance with p = 2/32: not evidence at 5 %, and no outcome of
    5 steps could be: the verdict says the test cannot judge, not that the two are alike."""
    r = paired_ratio([1.0] * 5, [0.5] * 5)
    assert r.p_value == pytest.approx(0.0625) and r.within_noise
    assert r.verdict == "too few steps to judge: n = 5 < 6"
    assert min_judged_steps() == 6
    assert paired_ratio([1.0] * 6, [0.5] * 6).verdict == "faster in 6 of 6 steps"
    ties = paired_ratio([1.0] * 7, [0.5] * 5 + [1.0] * 2)  # ties are not counted
    assert ties.verdict == "too few steps to judge: n = 5 < 6 (2 of 7 steps tied at 1.0)"


def test_slightly_slower_steps_from_load_spikes_do_not_flip_the_verdict() -> None:
    """Two steps at 0.97x among eight at 1.1x-1.25x: their ranks are the smallest, so the
    evidence stands (a count of steps, 8 of 10, would be p = 0.11: 'within noise')."""
    cand = [1 / x for x in (1.10, 1.12, 1.15, 1.18, 1.2, 1.22, 1.24, 1.25, 0.97, 0.98)]
    r = paired_ratio([1.0] * 10, cand)
    assert (r.faster_steps, r.slower_steps) == (8, 2)
    # The losses hold ranks 1 and 2: W- = 3, and 5 of the 1024 sign assignments have a
    # negative rank sum <= 3 ({}, {1}, {2}, {3}, {1, 2}); two-sided: 10 / 1024.
    assert r.p_value == pytest.approx(10 / 1024)
    assert r.verdict == "faster in 8 of 10 steps" and r.spread == "0.97–1.25"


def test_a_large_slow_step_weighs_as_much_as_its_rank() -> None:
    """The slowest step is also the largest change: 7 wins of 1.11x against one loss of
    0.83x (rank 8) is no evidence."""
    r = paired_ratio([1.0] * 8, [0.9] * 7 + [1.2])
    assert r.within_noise and r.verdict == "within noise"


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
    assert (
        rr.observability.paired_ratio is paired_ratio
        and rr.observability.PairedRatio is PairedRatio
    )


times = st.floats(min_value=1e-3, max_value=1e3, allow_nan=False)


def _brute_p(ratios: list[float]) -> tuple[float, float]:
    """The signed-rank test computed independently: mean ranks of |log ratio| (ties
    averaged), then every one of the 2**n sign assignments; p = the share whose positive
    rank sum is at least as far from its mean as the observed one. Also W+ - W-."""
    d = [math.log(x) for x in ratios if x != 1.0]
    mags = sorted(abs(x) for x in d)
    rank = {m: statistics.mean(i + 1 for i, v in enumerate(mags) if v == m) for m in set(mags)}
    ranks = [rank[abs(x)] for x in d]
    n, mean = len(d), sum(ranks) / 2
    w = sum(rk for rk, x in zip(ranks, d, strict=True) if x > 0)
    far = abs(w - mean)
    hits = 0
    for bits in range(2**n):
        wb = sum(rk for i, rk in enumerate(ranks) if bits >> i & 1)
        hits += abs(wb - mean) >= far - 1e-9
    return (hits / 2**n if n else 1.0), 2 * w - sum(ranks)


ratio_values = st.sampled_from([0.8, 0.9, 0.97, 1.0, 1.03, 1.1, 1.25, 2.0]) | st.floats(0.5, 2.0)


@given(st.lists(ratio_values, min_size=1, max_size=12), st.booleans())
def test_verdict_is_the_exact_signed_rank_test(ratios: list[float], same: bool) -> None:
    r = paired_ratio([1.0] * len(ratios), [1 / x for x in ratios], same_order=same)
    got = list(r.ratios)
    p, lead = _brute_p(got)
    assert r.p_value == pytest.approx(p, abs=1e-12)
    noise = p > 0.05
    judged = sum(x != 1.0 for x in got) >= 6
    assert ("within noise" in r.verdict) == (noise and judged)
    assert ("within noise" in r.note("strict")) == (noise and judged)
    assert r.verdict.startswith("too few steps to judge") == (not judged)
    assert judged or noise  # fewer than 6 steps: never significant
    assert ("same order as strict" in r.note("strict")) == same
    assert (r.low, r.high) == ((min(got), max(got)) if len(got) > 1 else (0.0, math.inf))
    assert r.low <= r.median <= r.high
    if not noise:
        up, down = sum(x > 1 for x in got), sum(x < 1 for x in got)
        word, count = ("faster", up) if lead > 0 else ("slower", down)
        assert r.verdict == f"{word} in {count} of {len(got)} steps"
