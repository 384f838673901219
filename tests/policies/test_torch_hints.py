"""``hint_from_torch``: torch.distributed.pipelining's own orders, converted task by task.

torch's order is taken independently of the converter: multi-stage schedules are built here
on their own stand-in stages and compared with what torch's runtime executes
(``pipeline_order_with_comms``, compute actions only) and with ``pipeline_order``; the
single-stage ``ScheduleGPipe`` / ``Schedule1F1B`` are compared with what their
``_step_microbatches`` loop actually runs on every rank (recorded with a stand-in stage).
"""

from __future__ import annotations

import asyncio
import enum
import random
from types import SimpleNamespace
from typing import Any

import pytest

pipelining = pytest.importorskip("torch.distributed.pipelining")
schedules = pytest.importorskip("torch.distributed.pipelining.schedules")

import rrfp_async as rr  # noqa: E402
from rrfp_async import Durations, LocalPipeline, StepSchedule, Task  # noqa: E402
from rrfp_async.errors import HintError  # noqa: E402
from rrfp_async.policies import hint_from_torch, validate_hint  # noqa: E402
from rrfp_async.sim import CostModelExecutor, VirtualEventLoop  # noqa: E402
from tests._virtual import run_virtual  # noqa: E402

MULTI_CASES: dict[str, list[tuple[int, int, int]]] = {
    "ScheduleInterleaved1F1B": [(2, 4, 2), (4, 8, 2), (3, 6, 3), (4, 6, 2), (2, 3, 1)],
    "ScheduleLoopedBFS": [(2, 4, 2), (4, 8, 2), (3, 5, 3)],
    "ScheduleInterleavedZeroBubble": [(2, 4, 2), (4, 8, 2), (3, 6, 3), (4, 2, 2)],
    "ScheduleZBVZeroBubble": [(2, 4, 2), (4, 8, 2), (4, 3, 2), (3, 6, 2)],
    "ScheduleDualPipeV": [(2, 4, 2), (4, 8, 2), (3, 9, 2), (4, 12, 2)],
}
SINGLE_CASES: dict[str, list[tuple[int, int]]] = {
    "ScheduleGPipe": [(1, 3), (2, 4), (4, 8), (3, 5)],
    "Schedule1F1B": [(1, 1), (2, 4), (4, 8), (3, 5)],
}
VSHAPE = {"ScheduleZBVZeroBubble", "ScheduleDualPipeV"}
SPLIT = {"ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV"}


def torch_class(name: str) -> type:
    cls = getattr(pipelining, name, None)
    if cls is None:
        pytest.skip(f"this torch has no {name}")
    return cls  # type: ignore[no-any-return]


def multi_cases() -> list[tuple[str, int, int, int]]:
    return [(n, p, m, v) for n, sizes in MULTI_CASES.items() for p, m, v in sizes]


def single_cases() -> list[tuple[str, int, int]]:
    return [(n, p, m) for n, sizes in SINGLE_CASES.items() for p, m in sizes]


def build_multi(cls: type, p: int, m: int, v: int) -> Any:
    """torch's schedule on plain namespaces as its stages (what the constructor reads)."""
    stages = [
        SimpleNamespace(
            stage_index=c * p,
            num_stages=p * v,
            group_size=p,
            group_rank=0,
            submod=None,
            is_first=c == 0,
            is_last=False,
            stage_index_to_group_rank={},
        )
        for c in range(v)
    ]
    return cls(stages, m, loss_fn=lambda out, target: out)


def compute_tasks(actions: list[Any]) -> list[Task]:
    """The compute actions of one torch rank, by their text form (``2F3``), in order."""
    out: list[Task] = []
    for a in actions:
        if a is None:
            continue
        if a.sub_actions is not None:
            out += compute_tasks(list(a.sub_actions))
        elif a.computation_type.value in ("F", "B", "I", "W"):
            out.append(Task.parse(str(a)))
    return out


def split(order: list[Task]) -> list[Task]:
    out: list[Task] = []
    for t in order:
        out += [Task(t.stage, "I", t.mb), Task(t.stage, "W", t.mb)] if t.kind == "B" else [t]
    return out


def expected_from(order: dict[int, list[Any]], is_split: bool) -> dict[int, list[Task]]:
    tasks = {r: compute_tasks(order[r]) for r in sorted(order)}
    return {r: split(t) if is_split else t for r, t in tasks.items()}


class RecordingStage:
    """A single-stage schedule's stage that records what ``_step_microbatches`` runs."""

    def __init__(self, rank: int, p: int) -> None:
        self.stage_index = rank
        self.num_stages = p
        self.group_size = p
        self.group_rank = rank
        self.is_first = rank == 0
        self.is_last = rank == p - 1
        self.submod = None
        self.has_backward = True
        self.done: list[Task] = []

    def get_fwd_recv_ops(self, *args: Any, **kwargs: Any) -> list[Any]:
        return []

    get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = get_fwd_recv_ops

    def forward_one_chunk(self, mb: int, *args: Any, **kwargs: Any) -> None:
        self.done.append(Task(self.stage_index, "F", mb))

    def backward_one_chunk(self, mb: int, *args: Any, **kwargs: Any) -> None:
        self.done.append(Task(self.stage_index, "B", mb))

    def perform_reduce_grad(self, *args: Any, **kwargs: Any) -> None:
        pass

    def clear_runtime_states(self) -> None:
        pass


def torch_executes(cls: type, p: int, m: int) -> dict[int, list[Task]]:
    """Run ``cls._step_microbatches`` on every rank with recording stages (no communication:
    every p2p op list is empty) and return what each rank computed, in order."""
    out = {}
    for r in range(p):
        stage = RecordingStage(r, p)
        sch: Any = cls(stage, m)
        sch._initialize_stage = lambda *a, **k: None  # shape inference / p2p warm-up
        sch._step_microbatches()
        out[r] = stage.done
    return out


def check_runs(plan: rr.StepPlan, hint: dict[int, list[Task]]) -> None:
    """The hint runs to completion in virtual time: strict with equal costs replays it
    exactly; readiness-first with uneven costs runs every task once."""
    schedule = StepSchedule.build(plan, hint)
    nv, m = plan.num_virtual, plan.microbatches
    unit = Durations.from_arrays(plan, [[1.0] * m for _ in range(nv)])
    stats = run_virtual(
        LocalPipeline(schedule, CostModelExecutor(unit), policy="strict").run_step(list(range(m)))
    )
    assert {r: [e.task for e in s.executed] for r, s in enumerate(stats)} == hint
    rng = random.Random(7)
    uneven = Durations.from_arrays(
        plan, [[rng.uniform(0.2, 3.0) for _ in range(m)] for _ in range(nv)]
    )
    pipe = LocalPipeline(schedule, CostModelExecutor(uneven), policy="readiness_first")
    stats = run_virtual(pipe.run_step(list(range(m))))
    for r, s in enumerate(stats):
        assert sorted(e.task for e in s.executed) == sorted(hint[r])


@pytest.mark.parametrize(("name", "p", "m", "v"), multi_cases())
def test_multi_stage_schedule_equals_torchs_order(name: str, p: int, m: int, v: int) -> None:
    cls = torch_class(name)
    sch = build_multi(cls, p, m, v)
    plan, hint = hint_from_torch(cls, stages=p, microbatches=m, chunks=v)
    is_split = name in SPLIT
    assert (plan.stages, plan.microbatches, plan.topology.chunks) == (p, m, v)
    assert plan.split_backward is is_split
    assert plan.topology.placement == ("vshape" if name in VSHAPE and v > 1 else "interleaved")
    # What torch's runtime executes, and its compute-only order, task by task.
    assert hint == expected_from(sch.pipeline_order_with_comms, is_split)
    assert hint == expected_from(sch.pipeline_order, is_split)
    validate_hint(plan, hint)
    for r in range(p):  # torch places stage v on the rank we place it on
        assert all(plan.rank_of(t) == r for t in hint[r])
        assert all(sch.stage_index_to_group_rank[t.stage] == r for t in hint[r])
    check_runs(plan, hint)


@pytest.mark.parametrize(("name", "p", "m"), single_cases())
def test_single_stage_schedule_equals_what_torch_runs(name: str, p: int, m: int) -> None:
    cls = torch_class(name)
    plan, hint = hint_from_torch(cls, stages=p, microbatches=m)
    assert (plan.stages, plan.microbatches, plan.topology.chunks) == (p, m, 1)
    assert not plan.split_backward and plan.topology.placement == "interleaved"
    assert hint == torch_executes(cls, p, m)
    validate_hint(plan, hint)
    check_runs(plan, hint)


@pytest.mark.parametrize(("name", "p", "m"), single_cases())
def test_single_stage_schedule_matches_torchs_pipeline_order(name: str, p: int, m: int) -> None:
    """torch's ``pipeline_order`` of single-stage schedules (a newer, descriptive order),
    where it is right: torch 2.13's 1F1B starts the last rank at microbatch 1."""
    cls = torch_class(name)
    order = cls(RecordingStage(0, p), m).pipeline_order
    if order is None:
        pytest.skip(f"this torch has no pipeline_order for {name}")
    _, hint = hint_from_torch(cls, stages=p, microbatches=m)
    expected = expected_from(order, False)
    ranks = range(p - 1) if name == "Schedule1F1B" else range(p)
    for r in ranks:
        assert hint[r] == expected[r]


def test_the_same_order_from_a_name_an_instance_and_action_lists() -> None:
    cls = torch_class("ScheduleDualPipeV")
    sch = build_multi(cls, 3, 9, 2)
    want = hint_from_torch(cls, stages=3, microbatches=9, chunks=2)
    assert hint_from_torch("DualPipeV", stages=3, microbatches=9) == want
    assert hint_from_torch(sch) == want
    assert hint_from_torch(sch.pipeline_order) == want
    assert hint_from_torch(sch.pipeline_order_with_comms, stages=3, microbatches=9) == want
    as_text = {
        r: [str(a) if a is not None else "" for a in o] for r, o in sch.pipeline_order.items()
    }
    assert any("OVERLAP_F_B" in a for o in as_text.values() for a in o)
    assert hint_from_torch(as_text) == want


def test_overlapped_f_b_becomes_its_forward_then_its_backward() -> None:
    cls = torch_class("ScheduleDualPipeV")
    sch = build_multi(cls, 2, 4, 2)
    overlaps = [a for a in sch.pipeline_order[0] if a is not None and a.sub_actions]
    assert overlaps, "DualPipeV has no overlapped actions at this size"
    _, hint = hint_from_torch(sch.pipeline_order)
    for a in overlaps:
        f, b = a.sub_actions
        i = hint[0].index(Task(f.stage_index, "F", f.microbatch_index))
        assert hint[0][i + 1 : i + 3] == [
            Task(b.stage_index, "I", b.microbatch_index),
            Task(b.stage_index, "W", b.microbatch_index),
        ]


def test_single_stage_instance_uses_what_step_microbatches_runs() -> None:
    cls = torch_class("Schedule1F1B")
    sch = cls(RecordingStage(0, 4), 6)
    assert hint_from_torch(sch) == hint_from_torch(cls, stages=4, microbatches=6)


def test_split_backward_and_ordered_weights_on_a_full_backward_order() -> None:
    cls = torch_class("Schedule1F1B")
    plan, hint = hint_from_torch(
        cls, stages=3, microbatches=5, split_backward=True, ordered_weights=True
    )
    assert plan.split_backward and plan.ordered_weights
    assert hint == {r: split(o) for r, o in torch_executes(cls, 3, 5).items()}
    check_runs(plan, hint)


def test_readme_example_runs_readiness_first() -> None:
    cls = torch_class("ScheduleInterleavedZeroBubble")
    plan, hint = rr.policies.hint_from_torch(cls, stages=4, microbatches=8, chunks=2)
    schedule = StepSchedule.build(plan, hint)
    costs = Durations.from_arrays(plan, [[1.0] * 8 for _ in range(plan.num_virtual)])
    pipe = LocalPipeline(schedule, CostModelExecutor(costs), policy="readiness_first")
    with asyncio.Runner(loop_factory=VirtualEventLoop) as runner:
        stats = runner.run(pipe.run_step(list(range(8))))
    assert [sorted(e.task for e in s.executed) for s in stats] == [
        sorted(plan.tasks_of(r)) for r in range(4)
    ]


class LegacyKind(enum.Enum):
    """torch < 2.5: integer-valued computation types, ``BACKWARD`` and ``WEIGHT``."""

    FORWARD = 1
    BACKWARD = 2
    WEIGHT = 3
    SEND_F = 6


def legacy(stage: int, kind: str, mb: int) -> SimpleNamespace:
    return SimpleNamespace(
        stage_index=stage,
        computation_type=LegacyKind[kind],
        microbatch_index=mb,
        sub_actions=None,
    )


def test_legacy_actions_backward_is_input_backward_next_to_weight() -> None:
    zb = {
        0: [
            legacy(0, "FORWARD", 0),
            legacy(0, "SEND_F", 0),
            None,
            legacy(0, "BACKWARD", 0),
            legacy(0, "WEIGHT", 0),
        ],
        1: [legacy(1, "FORWARD", 0), legacy(1, "BACKWARD", 0), legacy(1, "WEIGHT", 0)],
    }
    plan, hint = hint_from_torch(zb)
    assert plan.split_backward
    assert hint == {
        0: [Task(0, "F", 0), Task(0, "I", 0), Task(0, "W", 0)],
        1: [Task(1, "F", 0), Task(1, "I", 0), Task(1, "W", 0)],
    }
    full = {0: [legacy(0, "FORWARD", 0), legacy(0, "BACKWARD", 0)]}
    plan, hint = hint_from_torch(full)
    assert not plan.split_backward and hint == {0: [Task(0, "F", 0), Task(0, "B", 0)]}


def A(text: str) -> Any:
    """torch's own action from its text form."""
    return schedules._Action.from_str(text)


@pytest.mark.parametrize(
    ("schedule", "kwargs", "match"),
    [
        (42, {}, "takes a torch.distributed.pipelining schedule"),
        (int, {"stages": 2, "microbatches": 2}, "not a concrete torch"),
        ("NoSuchSchedule", {"stages": 2, "microbatches": 2}, "no pipeline schedule named"),
        ("PipelineScheduleMulti", {"stages": 2, "microbatches": 2}, "no per-rank order"),
        ("1F1B", {"stages": 2}, "needs the pipeline size"),
        ("1F1B", {"stages": 0, "microbatches": 2}, "stages must be an int >= 1"),
        ("1F1B", {"stages": 4, "microbatches": 2}, "at least as many microbatches"),
        ("1F1B", {"stages": 2, "microbatches": 4, "chunks": 2}, "one stage per rank"),
        ("ZBVZeroBubble", {"stages": 2, "microbatches": 4, "chunks": 3}, "rejects"),
        (
            "InterleavedZeroBubble",
            {"stages": 2, "microbatches": 4, "split_backward": False},
            "needs split_backward",
        ),
        (
            "GPipe",
            {"stages": 2, "microbatches": 2, "ordered_weights": True},
            "ordered_weights needs a split",
        ),
        ({0: [A("0F0"), A("0B0")]}, {"stages": 2}, "1 ranks, but stages=2"),
        ({0: [A("0F0"), A("0B0")]}, {"microbatches": 2}, "covers microbatches 0..0"),
        ({0: [A("0F0"), A("0B0")]}, {"chunks": 2}, "1 stage.s. per rank, but chunks=2"),
        ({1: [A("0F0")]}, {}, "one action list per rank"),
        ({0: [None, A("0SEND_F0")]}, {}, "no compute actions"),
        ({0: ["0F0", "0F1"], 1: ["1F0", "0B0"]}, {}, "stage 0 has tasks on rank 0 and"),
        ({0: ["0F0", "2F0"], 1: ["1F0"]}, {}, "3 virtual stages on 2 ranks"),
        (
            {0: ["0F0", "3F0"], 1: ["1F0", "2F0"], 2: ["5F0", "4F0"]},
            {},
            "neither interleaved nor V-shape",
        ),
        ({0: ["0B0", "0F0"]}, {}, "before its dependency"),
        ({0: ["0F0", "0F0", "0B0"]}, {}, "appears twice"),
        ({0: ["0F0", "0B0", "zzz"]}, {}, "cannot parse action"),
        ({0: [object()]}, {}, "not a torch pipelining action"),
        (
            {0: [SimpleNamespace(stage_index=0, computation_type="FOO", microbatch_index=0)]},
            {},
            "unsupported torch action",
        ),
        (
            {0: [SimpleNamespace(stage_index=0, computation_type="F", microbatch_index=None)]},
            {},
            "needs a stage and a microbatch",
        ),
    ],
)
def test_unsupported_or_inconsistent_input_is_a_hint_error(
    schedule: Any, kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(HintError, match=match):
        hint_from_torch(schedule, **kwargs)


def test_torchs_own_1f1b_pipeline_order_is_never_silently_accepted() -> None:
    """torch 2.13's Schedule1F1B.pipeline_order misses F0 on the last rank: converting it
    either gives the right order (a fixed torch) or fails loudly."""
    cls = torch_class("Schedule1F1B")
    order = cls(RecordingStage(0, 3), 4).pipeline_order
    if order is None:
        pytest.skip("this torch has no pipeline_order for Schedule1F1B")
    try:
        _, hint = hint_from_torch(order)
    except HintError:
        return
    assert hint == torch_executes(cls, 3, 4)
