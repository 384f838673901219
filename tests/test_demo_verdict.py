"""The verdict on a paired speedup (``PairedRatio.verdict``, what the demo, ``bench`` and the
examples print): a verdict only where the test can decide; below 6 paired steps, "too few
steps to judge", with the numbers."""

from __future__ import annotations

import re

import pytest
from rich.console import Console

from rrfp_async.cli import speedup_table
from rrfp_async.observability import PairedRatio, paired_ratio
from rrfp_async.observability._paired import min_judged_steps


def test_the_threshold_is_the_runtime_tests_own() -> None:
    # 5 of 5 faster: p = 2 / 32 = 0.0625 > 5 %; 6 of 6: p = 0.03125.
    assert min_judged_steps() == 6
    assert PairedRatio(ratios=(2.0,) * 5).within_noise
    assert not PairedRatio(ratios=(2.0,) * 6).within_noise


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_too_few_steps_to_judge_whatever_the_ratios_say(n: int) -> None:
    # Every step much faster: still no verdict the test could back.
    r = paired_ratio([2.0] * n, [1.0] * n)
    assert r.verdict == f"too few steps to judge: n = {n} < 6"
    assert r.note("strict") == r.verdict
    assert "within noise" not in r.note("strict")
    # The figures stay the runtime's.
    assert r.median == 2.0 and r.within_noise and r.steps == n


def test_from_six_steps_the_tests_verdict() -> None:
    faster = paired_ratio([2.0] * 6, [1.0] * 6)
    assert faster.verdict == "faster in 6 of 6 steps"
    slower = paired_ratio([1.0] * 8, [1.5] * 8)
    assert slower.verdict == "slower in 8 of 8 steps"
    mixed = [1.1, 0.9, 1.2, 0.8, 1.05, 0.95]
    noise = paired_ratio(mixed, [1.0] * 6)
    assert noise.verdict == "within noise" == PairedRatio(ratios=tuple(mixed)).verdict


def test_ties_do_not_count_and_the_verdict_says_so() -> None:
    # 6 steps, one exactly 1.0: the test sees 5.
    r = paired_ratio([2.0] * 5 + [1.0], [1.0] * 6)
    assert r.judged_steps == 5
    assert r.verdict == "too few steps to judge: n = 5 < 6 (1 of 6 steps tied at 1.0)"


def test_same_order_keeps_its_note() -> None:
    r = paired_ratio([1.0] * 3, [0.9] * 3, same_order=True)
    assert r.same_order
    assert r.note("strict") == (
        "too few steps to judge: n = 3 < 6; same order as strict: ratio is noise"
    )


def test_the_demos_table_prints_it() -> None:
    """The table the demo and ``bench pipeline`` print (the runtime's ``speedup_table``)
    shows it; before, 3 steps were said to be "within noise"."""
    base = [0.2, 0.2, 0.2]
    rows = [
        ("strict", 0.2, paired_ratio(base, base)),
        ("readiness_first", 0.16, paired_ratio(base, [0.1, 0.16, 0.25])),
    ]
    con = Console(width=200, record=True)
    con.print(speedup_table("t", rows, steps=3, microbatches=8, base="strict"))
    text = con.export_text()
    assert re.search(r"readiness_first .* too few steps to judge: n = 3 < 6 ", text), text
    assert "within noise" not in text
