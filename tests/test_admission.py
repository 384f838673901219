"""The admission ledger (pure): the banker's check against the hint."""

from __future__ import annotations

import rrfp_async as rr
from rrfp_async._tasks import parse_tasks


def test_ledger_admits_within_the_hint_safety() -> None:
    # Rank 0 of 1F1B with P=2, M=3: F0 F1 B0 F2 B1 B2, bound 2.
    order = parse_tasks("0F0 0F1 0B0 0F2 0B1 0B2")
    led = rr.AdmissionLedger(order, 2)
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
    hint = rr.make_hint("interleaved", plan)
    for r in range(4):
        order = hint[r]
        led = rr.AdmissionLedger(order, rr.hint_peak(order))
        for k in range(len(order)):
            assert led.admissible_at(k), (r, order[k])
            led.start_at(k)
            led.finish_at(k)
            assert led.inflight <= led.bound
