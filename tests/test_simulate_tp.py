"""TP coordination in the simulator (``simulate(tp=..., tp_latency=..., tp_check=...)``) and
the model of its cost (``rrfp_async.sim._sim_tp``).

* latency 0 (and no check) reproduces the step without TP exactly, for random pipelines;
* causality: the TP group starts each task no earlier than the leader's decision plus the
  latency, and no earlier than the leader's dispatch; a decision not sent ahead delays its
  task by the full latency; the look-ahead really sends some ahead (not vacuous);
* a latency never makes a fixed-order (``strict``) step faster, and more latency never less
  slow; the end-of-step check adds exactly itself;
* the model: exact fits pick their own form, leave-one-out on exact data is exact.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rrfp_async import PlanError, simulate
from rrfp_async.sim._sim_tp import TP_DECISION_LATENCY, TPTerm, fit_tp_term, leave_one_out

POLICIES = ["strict", "readiness_first", "greedy", "backfill"]


@st.composite
def configs(draw: st.DrawFn, policies: list[str] = POLICIES) -> dict[str, object]:
    chunks = draw(st.sampled_from([1, 1, 2]))
    hints = ["1f1b", "breadth_first_weighted"] if chunks == 1 else ["bfw", "backward_first"]
    return {
        "stages": draw(st.integers(1, 6)),
        "chunks": chunks,
        "microbatches": draw(st.integers(1, 16)),
        "hint": draw(st.sampled_from(hints)),
        "policy": draw(st.sampled_from(policies)),
        "workload": draw(st.sampled_from(["uniform", "text", "multimodal"])),
        "jitter": draw(st.sampled_from([0.0, 0.2, 0.5])),
        "latency": draw(st.sampled_from([0.0, 1e-4, 1e-3])),
        "memory_factor": draw(st.sampled_from([None, 2.0])),
        "seed": draw(st.integers(0, 2**16)),
    }


def _spans(r: object) -> object:
    return [[(e.task, e.start, e.end) for e in rank] for rank in r.executed]  # type: ignore[attr-defined]


@given(configs(), st.sampled_from([2, 8, 32]))
def test_tp_latency_zero_is_the_step_without_tp(cfg: dict[str, object], tp: int) -> None:
    free = simulate(**cfg)  # type: ignore[arg-type]
    zero = simulate(**cfg, tp=tp, tp_latency=0.0, tp_check=0.0)  # type: ignore[arg-type]
    assert zero.makespan == free.makespan
    assert _spans(zero) == _spans(free)
    assert zero.tp == tp and zero.tp_decisions is None


@given(configs(), st.sampled_from([1e-4, 1e-3, 5e-3]))
def test_each_task_waits_for_its_decision_plus_the_latency(
    cfg: dict[str, object], lat: float
) -> None:
    r = simulate(**cfg, tp=8, tp_latency=lat, tp_check=0.0, tp_deduce=False)  # type: ignore[arg-type]
    assert r.tp_decisions is not None and r.tp_latency == lat
    eps = 1e-9
    for rank, decisions in zip(r.executed, r.tp_decisions, strict=True):
        assert [d.task for d in decisions] == [e.task for e in rank]
        for e, d in zip(rank, decisions, strict=True):
            assert not d.deduced
            assert d.decided <= e.start + eps  # decided before (or when) the leader dispatched
            assert d.start >= d.decided + lat - eps  # causality: the followers received it
            assert d.start >= e.start - eps
            # The group starts at the later of the two, not later.
            assert d.start == pytest.approx(max(e.start, d.decided + lat), abs=eps)
            if d.decided == e.start:  # decided on the spot: the full latency on this task
                assert d.start >= e.start + lat - eps


def test_the_look_ahead_sends_decisions_ahead() -> None:
    # Not vacuous: with tasks longer than the latency, decisions sent ahead cost nothing.
    r = simulate(
        stages=4, microbatches=16, hint="1f1b", policy="readiness_first", tp=8, tp_latency=1e-3
    )
    assert r.tp_decisions is not None
    ahead = [d for rank in r.tp_decisions for d in rank if d.start == d.decided + 1e-3]
    free = [
        (d, e)
        for rank, ex in zip(r.tp_decisions, r.executed, strict=True)
        for d, e in zip(rank, ex, strict=True)
        if d.decided < e.start and d.start == e.start
    ]
    assert free and ahead, (len(free), len(ahead))


@given(configs(policies=["strict"]), st.sampled_from([1e-4, 1e-3]), st.sampled_from([2.0, 5.0]))
def test_a_latency_never_makes_a_fixed_order_step_faster(
    cfg: dict[str, object], lat: float, more: float
) -> None:
    free = simulate(**cfg).makespan  # type: ignore[arg-type]
    tp = {"tp": 8, "tp_check": 0.0}
    low = simulate(**cfg, **tp, tp_latency=lat, tp_deduce=False).makespan  # type: ignore[arg-type]
    high = simulate(**cfg, **tp, tp_latency=lat * more, tp_deduce=False).makespan  # type: ignore[arg-type]
    assert free <= low + 1e-12 <= high + 2e-12
    assert low >= free + lat - 1e-9  # at least the first decision is on the critical path
    # Deduced decisions start earlier, never later: in a fixed order that cannot slow the
    # step (and strict chooses the ready head, so its followers deduce).
    ded = simulate(**cfg, **tp, tp_latency=lat).makespan  # type: ignore[arg-type]
    ded_high = simulate(**cfg, **tp, tp_latency=lat * more).makespan  # type: ignore[arg-type]
    assert free <= ded + 1e-12 <= low + 2e-12
    assert ded <= ded_high + 2e-12


@given(configs(), st.sampled_from([1e-4, 1e-3, 5e-3]))
def test_followers_deduce_exactly_the_ready_head_with_local_inputs(
    cfg: dict[str, object], lat: float
) -> None:
    # A deduced task is the hint's next task and has no input message (so it is ready on
    # every TP rank at the same decision); it starts with the leader's dispatch. Every
    # other task waits for its decision plus the latency, as without deduction.
    r = simulate(**cfg, tp=8, tp_latency=lat, tp_check=0.0)  # type: ignore[arg-type]
    assert r.tp_decisions is not None and r.schedule is not None
    eps = 1e-9
    for rank, (ex, decisions) in enumerate(zip(r.executed, r.tp_decisions, strict=True)):
        prog = r.schedule.program(rank)
        started: set[int] = set()
        for e, d in zip(ex, decisions, strict=True):
            pos = prog.pos[e.task]
            head = min(set(range(len(prog.order))) - started)
            if d.deduced:
                assert pos == head and prog.src_rank[pos] < 0, (rank, e.task)
                assert d.start == e.start
            else:
                assert d.start == pytest.approx(max(e.start, d.decided + lat), abs=eps)
            started.add(pos)


def test_deduction_takes_the_latency_off_a_first_stage() -> None:
    # Not vacuous: on a single stage every input is local, so every decision is deduced and
    # coordination costs nothing; without deduction each task pays the latency.
    kw: dict[str, object] = {"stages": 1, "microbatches": 8, "tp": 8, "tp_check": 0.0}
    free = simulate(stages=1, microbatches=8)
    on = simulate(**kw, tp_latency=1e-3)  # type: ignore[arg-type]
    off = simulate(**kw, tp_latency=1e-3, tp_deduce=False)  # type: ignore[arg-type]
    assert on.tp_decisions is not None and all(d.deduced for d in on.tp_decisions[0])
    assert on.makespan == free.makespan
    assert off.makespan >= free.makespan + 1e-3
    # Four stages: the first stage's forwards and the last stage's backwards are deduced,
    # a middle stage's tasks (an input message each) are not.
    r = simulate(stages=4, microbatches=8, tp=8, tp_latency=1e-3, tp_check=0.0)
    assert r.tp_decisions is not None
    assert any(d.deduced for d in r.tp_decisions[0])
    assert not any(d.deduced for d in r.tp_decisions[1])


def test_the_end_of_step_check_adds_itself_and_tp_defaults_to_the_model() -> None:
    kw: dict[str, object] = {"stages": 4, "microbatches": 8, "workload": "text", "jitter": 0.2}
    free = simulate(**kw)  # type: ignore[arg-type]
    chk = simulate(**kw, tp=8, tp_latency=0.0, tp_check=2e-3)  # type: ignore[arg-type]
    assert chk.makespan == pytest.approx(free.makespan + 2e-3)
    model = simulate(**kw, tp=8)  # type: ignore[arg-type]
    assert model.tp_latency == TP_DECISION_LATENCY(8) > 0
    assert model.makespan > free.makespan
    one = simulate(**kw, tp=1, tp_latency=1e-3)  # type: ignore[arg-type]
    assert one.makespan == free.makespan and one.tp_latency == 0.0  # TP 1: nothing to coordinate


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"tp": 0}, "tp must be"),
        ({"tp": 2.0}, "tp must be"),
        ({"tp": 2, "tp_latency": -1e-3}, "tp_latency"),
        ({"tp": 2, "tp_latency": math.nan}, "tp_latency"),
        ({"tp": 2, "tp_check": -1.0}, "tp_check"),
        ({"tp": 2, "tp_deduce": "yes"}, "tp_deduce must be True or False"),
    ],
)
def test_tp_arguments_are_validated(kw: dict[str, object], match: str) -> None:
    with pytest.raises(PlanError, match=match):
        simulate(stages=2, microbatches=2, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("form", ["log2", "linear"])
def test_an_exact_fit_picks_its_own_form_and_predicts_left_out_points(form: str) -> None:
    truth = TPTerm(form=form, a=300e-6, b=150e-6)  # type: ignore[arg-type]
    pts = [(tp, truth(tp)) for tp in (2, 4, 8, 16)]
    term, other = fit_tp_term(pts)
    assert term.form == form and other is not None and other.form != form
    assert term.a == pytest.approx(truth.a) and term.b == pytest.approx(truth.b)
    assert term.residual < 1e-12 < other.residual
    for tp, measured, predicted in leave_one_out(pts, form):  # type: ignore[arg-type]
        assert predicted == pytest.approx(measured), tp
    assert truth(1) == 0.0 and TPTerm(form="linear", a=-1.0, b=0.0)(4) == 0.0
    with pytest.raises(PlanError, match="two or more"):
        fit_tp_term([(2, 1.0), (2, 2.0)])
