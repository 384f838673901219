"""The admission ledger (pure): the banker's check against the hint."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

import rrfp_async as rr
from rrfp_async._tasks import activation_delta, parse_tasks


def test_ledger_admits_within_the_hint_safety() -> None:
    # Rank 0 of 1F1B with P=2, M=3: F0 F1 B0 F2 B1 B2, bound 2.
    order = parse_tasks("0F0 0F1 0B0 0F2 0B1 0B2")
    led = rr.policies.AdmissionLedger(order, 2)
    assert led.admissible(rr.Task(0, "F", 0))
    # F2 first would leave F0 and F1 of the hint needing 2 more slots: 3 > 2, refused.
    assert not led.admissible(rr.Task(0, "F", 2))
    led.start_at(0)
    assert led.admissible(rr.Task(0, "F", 1)) and not led.admissible(rr.Task(0, "F", 2))
    led.start_at(1)
    assert led.inflight == 2 == led.peak and led.head == 2
    # At the bound: only the backward may start.
    assert led.filter_admissible([2, 3]) == [2]
    assert [led.admissible_at(k) for k in (2, 3)] == [True, False]
    led.start_at(2)
    led.finish_at(2)
    assert led.inflight == 1 and led.admissible(rr.Task(0, "F", 2))


def test_head_is_always_admissible_and_bound_holds() -> None:
    plan = rr.StepPlan(topology=rr.Topology(stages=4, chunks=2), microbatches=8)
    hint = rr.policies.make_hint("interleaved", plan)
    for r in range(4):
        order = hint[r]
        led = rr.policies.AdmissionLedger(order, rr.policies.hint_peak(order))
        for k in range(len(order)):
            assert led.admissible_at(k), (r, order[k])
            led.start_at(k)
            led.finish_at(k)
            assert led.inflight <= led.bound


@given(
    kinds=st.lists(st.sampled_from("FBW"), min_size=1, max_size=40),
    bound=st.integers(1, 6),
    started=st.lists(st.integers(0, 39), max_size=20),
    inflight=st.integers(0, 6),
)
def test_filter_admissible_is_the_bankers_test(
    kinds: list[str], bound: int, started: list[int], inflight: int
) -> None:
    # Against the definition: a forward at k is admitted iff inflight + 1 + the largest
    # prefix sum of the not-started deltas strictly before k stays within the bound.
    order = [rr.Task(0, k, i) for i, k in enumerate(kinds)]  # type: ignore[arg-type]
    led = rr.policies.AdmissionLedger(order, bound)
    for k in sorted({s for s in started if s < len(order)}):
        led.start_at(k)
    led.inflight = inflight
    ready = [k for k in range(len(order)) if not led._started[k]]
    delta = [activation_delta(t.kind) for t in order]

    def reference(k: int) -> bool:
        if delta[k] <= 0:
            return True
        s = m = 0
        for j in range(led.head, k):
            if not led._started[j]:
                s += delta[j]
                m = max(m, s)
        return inflight + 1 + m <= bound

    assert led.filter_admissible(ready) == [k for k in ready if reference(k)]
