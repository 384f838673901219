"""A speedup measured step by step, with its spread and an honest verdict.

Design note
-----------
A benchmark that runs a baseline and a candidate on the same work (the same microbatches
and emulated noise in step ``i``) can compare them step by step: the speedup of step ``i``
is ``baseline[i] / candidate[i]``. Reporting only one number (a ratio of medians) hides how
much those per-step ratios scatter; on a loaded machine they scatter across 1.0 and the
headline is noise. So a ratio is reported as the *median* of the paired per-step ratios
with their *min–max* range, and the verdict comes from the *Wilcoxon signed-rank test* on
the log ratios: under "no difference" each step's log ratio is as likely positive as
negative whatever its size, so every assignment of signs to the ranked ``|log ratio|`` is
equally likely; the exact two-sided p-value is the share of assignments whose sum of
positive ranks is at least as far from its mean as the observed one. The verdict claims a
difference (``"faster in k of n steps"``, ``"slower in ..."``, ``k`` the steps on the
winning side) only when that p-value is at most ``ALPHA`` (5 %), else it says ``"within
noise"``. Unlike "the min–max excludes 1.0", or a sign test that counts steps, a couple of
steps a load spike made slightly slower (0.97x among 1.1x–1.25x) do not flip the verdict,
since their ranks are small; and a handful of steps can never claim anything: with fewer
than 6 steps even "faster in every step" is ``within noise`` (5 of 5 has p = 0.0625), so a
command that wants a verdict times at least 6 paired steps. Steps with a ratio of exactly
1.0 are dropped, tied sizes share their mean rank (the exact distribution is counted on
half-ranks).

A candidate that never left the baseline's order (``same_order``: both ran the hint's
order, zero deviations) ran the same tasks in the same order; whatever its ratio, it is
noise (or drift of the machine between the runs), and the note says so.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ALPHA", "PairedRatio", "min_judged_steps", "paired_ratio", "signed_rank_test"]

#: How the spread is computed, for labels.
SPREAD_METHOD = "min–max"

#: The test's level: a difference is claimed when its two-sided p-value is at most this.
ALPHA = 0.05


def signed_rank_test(ratios: Sequence[float]) -> float:
    """The exact two-sided Wilcoxon signed-rank p-value of ``log(ratios)`` against 0."""
    return _signed_rank(ratios)[0]


def _signed_rank(ratios: Sequence[float]) -> tuple[float, int]:
    """``(p-value, side)``: side > 0 when the positive log ratios outrank the negative ones,
    < 0 when the negative do, 0 on a tie."""
    d = [math.log(r) for r in ratios if r != 1.0]
    n = len(d)
    if n == 0:
        return 1.0, 0
    order = sorted(range(n), key=lambda i: abs(d[i]))
    half_ranks = [0] * n  # 2 x the rank (mean rank for tied sizes): integers
    i = 0
    while i < n:
        j = i
        while j + 1 < n and abs(d[order[j + 1]]) == abs(d[order[i]]):
            j += 1
        for k in range(i, j + 1):
            half_ranks[order[k]] = i + j + 2  # 2 x the mean of ranks i+1 .. j+1
        i = j + 1
    w = sum(h for h, x in zip(half_ranks, d, strict=True) if x > 0)
    # counts[s]: sign assignments whose positive half-ranks sum to s.
    counts = [1] + [0] * sum(half_ranks)
    top = 0
    for h in half_ranks:
        for s in range(top, -1, -1):
            if counts[s]:
                counts[s + h] += counts[s]
        top += h
    total = 2**n
    lower = sum(counts[: w + 1]) / total
    upper = sum(counts[w:]) / total
    side = (w > top - w) - (w < top - w)
    return min(1.0, 2 * min(lower, upper)), side


@dataclass(frozen=True, kw_only=True)
class PairedRatio:
    """The per-step ratios ``baseline[i] / candidate[i]`` of paired steps, summarized.

    Attributes:
        ratios: One ratio per paired step (> 1: the candidate was faster in that step).
        same_order: The candidate ran the same task order as the baseline in every step.
    """

    ratios: tuple[float, ...]
    same_order: bool = False

    def __post_init__(self) -> None:
        if not self.ratios:
            raise ValueError("PairedRatio needs at least one paired step")
        bad = [r for r in self.ratios if not (math.isfinite(r) and r > 0)]
        if bad:
            raise ValueError(f"ratios must be finite and > 0, got {bad}")

    @property
    def steps(self) -> int:
        """Number of paired steps."""
        return len(self.ratios)

    @property
    def median(self) -> float:
        """Median of the per-step ratios (the headline speedup)."""
        return statistics.median(self.ratios)

    @property
    def low(self) -> float:
        """Lower end of the spread: the smallest ratio (0 with one step: no spread)."""
        return min(self.ratios) if self.steps > 1 else 0.0

    @property
    def high(self) -> float:
        """Upper end of the spread: the largest ratio (inf with one step: no spread)."""
        return max(self.ratios) if self.steps > 1 else math.inf

    @property
    def faster_steps(self) -> int:
        """Steps in which the candidate was faster (ratio > 1)."""
        return sum(r > 1.0 for r in self.ratios)

    @property
    def slower_steps(self) -> int:
        """Steps in which the candidate was slower (ratio < 1)."""
        return sum(r < 1.0 for r in self.ratios)

    @property
    def p_value(self) -> float:
        """The signed-rank test's two-sided p-value (see the design note)."""
        return signed_rank_test(self.ratios)

    @property
    def within_noise(self) -> bool:
        """No step-by-step evidence of a difference: the signed-rank test's p-value is
        above ``ALPHA``."""
        return self.p_value > ALPHA

    @property
    def judged_steps(self) -> int:
        """The steps the test counts: ratios of exactly 1.0 (ties) are dropped."""
        return sum(r != 1.0 for r in self.ratios)

    @property
    def verdict(self) -> str:
        """``"too few steps to judge: n = 3 < 6"`` where the test cannot decide whatever the
        steps showed (see ``min_judged_steps``); else ``"within noise"``, or ``"faster in k
        of n steps"`` / ``"slower in k of n steps"`` (the candidate against the baseline)
        when the signed-rank test says so; the direction is the side whose log ratios
        outrank the other's."""
        n, least = self.judged_steps, min_judged_steps()
        if n < least:
            ties = self.steps - n
            dropped = f" ({ties} of {self.steps} steps tied at 1.0)" if ties else ""
            return f"too few steps to judge: n = {n} < {least}{dropped}"
        if self.within_noise:
            return "within noise"
        if _signed_rank(self.ratios)[1] > 0:
            return f"faster in {self.faster_steps} of {self.steps} steps"
        return f"slower in {self.slower_steps} of {self.steps} steps"

    @property
    def spread(self) -> str:
        """The spread as text: ``"1.05–1.31"``, or ``"no spread (1 step)"``."""
        if self.steps == 1:
            return "no spread (1 step)"
        return f"{self.low:.2f}–{self.high:.2f}"

    def note(self, baseline: str = "the baseline") -> str:
        """The verdict, followed by ``"same order as <baseline>: ratio is noise"`` for a
        candidate that ran the baseline's order.

        Args:
            baseline: The baseline's name, for the text.

        Returns:
            E.g. ``"within noise"`` or ``"faster in 8 of 8 steps; same order as strict:
            ratio is noise"``.
        """
        if self.same_order:
            return f"{self.verdict}; same order as {baseline}: ratio is noise"
        return self.verdict

    def __str__(self) -> str:
        return f"{self.median:.3f}x ({self.spread})"


@functools.cache
def min_judged_steps(limit: int = 64) -> int:
    """The fewest paired steps (ratios other than exactly 1.0) on which the signed-rank test
    can find a difference at ``ALPHA``: its most extreme outcome, every step on one side,
    has p = 2 / 2**n, so fewer steps are "within noise" whatever they showed — a verdict the
    test had no power to give. ``PairedRatio.verdict`` says "too few steps to judge" there.

    Args:
        limit: Give up beyond this many steps.

    Returns:
        That number of steps (6 at the 5 % level).

    Raises:
        ValueError: Not even ``limit`` steps all on one side are significant.
    """
    for n in range(1, limit + 1):
        if signed_rank_test((2.0,) * n) <= ALPHA:
            return n
    raise ValueError(f"no outcome of up to {limit} paired steps is significant at {ALPHA}")


def paired_ratio(
    baseline: Sequence[float], candidate: Sequence[float], *, same_order: bool = False
) -> PairedRatio:
    """The speedup of ``candidate`` over ``baseline``, step by step.

    Args:
        baseline: Seconds of each step under the baseline.
        candidate: Seconds of the same steps (same work, same order of steps) under the
            candidate.
        same_order: The candidate ran the baseline's task order in every step (say so in
            the note: its ratio is noise).

    Returns:
        The ``PairedRatio`` of ``baseline[i] / candidate[i]``.

    Raises:
        ValueError: The sequences are empty or of different lengths, or a time is not a
            finite positive number.
    """
    if len(baseline) != len(candidate):
        raise ValueError(
            f"paired steps need equal lengths: {len(baseline)} baseline, {len(candidate)} candidate"
        )
    bad = [t for t in (*baseline, *candidate) if not (math.isfinite(t) and t > 0)]
    if bad:
        raise ValueError(f"step times must be finite and > 0, got {bad}")
    return PairedRatio(
        ratios=tuple(b / c for b, c in zip(baseline, candidate, strict=True)),
        same_order=same_order,
    )
