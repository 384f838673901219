"""Any ``torch.distributed.pipelining`` schedule as a hint.

``hint_from_torch`` turns a torch pipeline schedule into a step plan and a hint, so the
orders torch ships (GPipe, 1F1B, interleaved 1F1B, looped BFS, interleaved zero-bubble,
ZB-V, DualPipeV) run readiness-first: the torch order ranks the tasks, a policy decides how
strictly to follow it.

Where the order comes from:

* a multi-stage schedule **class** (or its name, as
  ``torch.distributed.pipelining.schedules.get_schedule_class`` knows it): the class is
  instantiated with light stand-ins for its ``PipelineStage`` objects (one per virtual
  stage) that carry only the sizes a schedule constructor reads (``num_stages``,
  ``group_size``, ``group_rank``, ``stage_index``, ...); no process group, module or tensor
  is involved. The constructor computes torch's own
  per-rank order (``pipeline_order``, from which torch's runtime derives what it executes)
  exactly as for a real run, with torch's own size checks.
* ``ScheduleGPipe`` / ``Schedule1F1B`` (and subclasses): these run one virtual stage per rank and
  execute ``_step_microbatches``, a hand-written loop; older torch versions have no
  ``pipeline_order`` for them, and torch 2.13's ``Schedule1F1B.pipeline_order`` (a
  visualisation aid) is wrong on the last rank (it starts at microbatch 1). So their order
  is generated here as ``_step_microbatches`` runs it: GPipe all forwards then all
  backwards; 1F1B ``min(M, P - s)`` warm-up forwards on rank ``s``, then alternately one
  backward and one forward, then the remaining backwards (1F1B needs M >= P, as in torch).
  Other single-stage schedules are instantiated and their ``pipeline_order`` is used.
* a schedule **instance**: its ``pipeline_order`` (GPipe / 1F1B: generated, as above);
* a **mapping** ``{rank: [action | None, ...]}`` such as an instance's ``pipeline_order``
  (actions may also be given in torch's text form, ``"2F3"``).

Only compute actions become tasks; bubbles (``None``) and communication / memory actions
(``SEND_F``, ``RECV_F``, ``SEND_B``, ``RECV_B``, ``UNSHARD``, ``RESHARD``,
``REDUCE_GRAD``) are dropped: readiness-first waits on data, not on slots.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any, cast

from .._check import check_count
from .._errors import HintError
from .._tasks import Kind, Placement, StepPlan, Task, Topology
from ._validate import validate_hint

__all__ = ["hint_from_torch"]

# torch's computation types by enum *name* (names are stable across torch versions; the values
# changed from ints to the one-letter strings in torch 2.5).
_COMPUTE: dict[str, Kind] = {
    "FORWARD": "F",
    "FULL_BACKWARD": "B",
    "BACKWARD_INPUT": "I",
    "BACKWARD_WEIGHT": "W",
    "WEIGHT": "W",  # torch < 2.5
    "F": "F",  # plain one-letter computation types
    "B": "B",
    "I": "I",
    "W": "W",
}
_LEGACY_BACKWARD = "BACKWARD"  # torch < 2.5: full backward, or input backward next to W actions
_NOT_COMPUTE = frozenset(
    {"SEND_F", "RECV_F", "SEND_B", "RECV_B", "UNSHARD", "RESHARD", "REDUCE_GRAD"}
)


def _loss(output: Any, target: Any) -> Any:
    """A loss function for the schedule constructors (never called)."""
    return output


class _StandInStage:
    """The sizes of one torch ``PipelineStage`` (a virtual stage), as a schedule constructor
    reads them."""

    def __init__(self, stage_index: int, num_stages: int, group_size: int) -> None:
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group_size = group_size
        self.group_rank = 0
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.submod = None
        self.has_backward = True
        self.stage_index_to_group_rank = {v: v % group_size for v in range(num_stages)}

    def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> None:
        """No-op: older constructors prepared p2p buffers here."""

    def _prepare_backward_infra(self, *args: Any, **kwargs: Any) -> None:
        """No-op: older constructors prepared p2p buffers here."""


def _schedules() -> Any:
    """``torch.distributed.pipelining.schedules``, imported on first use."""
    try:
        from torch.distributed.pipelining import schedules
    except ImportError as exc:  # pragma: no cover - torch without distributed support
        raise HintError(f"torch.distributed.pipelining is not available: {exc}") from exc
    return schedules


def _generated_order(cls: type, stages: int, microbatches: int) -> dict[int, list[Task]] | None:
    """The order ``cls._step_microbatches`` runs on each rank for the GPipe and 1F1B
    families (None for any other schedule).

    Raises:
        HintError: 1F1B with fewer microbatches than stages (torch rejects it too).
    """
    schedules = _schedules()
    p, m = stages, microbatches
    out: dict[int, list[Task]] = {}
    if issubclass(cls, schedules.ScheduleGPipe):
        for s in range(p):
            out[s] = [Task(s, "F", i) for i in range(m)] + [Task(s, "B", i) for i in range(m)]
        return out
    if issubclass(cls, schedules.Schedule1F1B):
        if m < p:
            raise HintError(
                f"torch's {cls.__name__} needs at least as many microbatches as stages,"
                f" got microbatches={m} < stages={p}"
            )
        for s in range(p):
            warm = min(m, p - s)
            order = [Task(s, "F", i) for i in range(warm)]
            for i in range(m):
                order.append(Task(s, "B", i))
                if warm + i < m:
                    order.append(Task(s, "F", warm + i))
            out[s] = order
        return out
    return None


def _class_order(
    cls: type, stages: int | None, microbatches: int | None, chunks: int | None
) -> dict[int, list[Task]]:
    """The per-rank tasks of schedule class ``cls`` (torch's order, or the generated one)."""
    schedules = _schedules()
    name = cls.__name__
    if not issubclass(cls, schedules._PipelineSchedule) or inspect.isabstract(cls):
        raise HintError(
            f"{cls.__module__}.{name} is not a concrete torch.distributed.pipelining schedule"
        )
    if stages is None or microbatches is None:
        raise HintError(
            f"hint_from_torch({name}) needs the pipeline size: stages=P and microbatches=M"
        )
    p = check_count("stages", stages, error=HintError)
    m = check_count("microbatches", microbatches, error=HintError)
    single = issubclass(cls, schedules.PipelineScheduleSingle)
    v = check_count("chunks", (1 if single else 2) if chunks is None else chunks, error=HintError)
    if single and v != 1:
        raise HintError(f"torch's {name} runs one stage per rank (chunks=1), got chunks={v}")
    generated = _generated_order(cls, p, m)
    if generated is not None:
        return generated
    args: tuple[Any, ...]
    if single:
        args = (_StandInStage(0, p, p), m)
    else:
        args = ([_StandInStage(c * p, p * v, p) for c in range(v)], m)
    try:
        schedule = cls(*args, loss_fn=_loss)
    except Exception as exc:
        raise HintError(
            f"torch's {name} rejects stages={p}, microbatches={m}, chunks={v}: {exc}"
        ) from exc
    order = _pipeline_order(schedule)
    if not order:
        raise HintError(
            f"torch's {name} builds no per-rank order (pipeline_order) by itself; load one"
            " (e.g. from CSV) and pass schedule.pipeline_order"
        )
    return _convert(cast("Mapping[int, Sequence[Any]]", order))


def _pipeline_order(schedule: Any) -> Any:
    """A torch schedule's per-rank action table, or None: only schedules that build one have
    ``pipeline_order`` (which do varies by class and torch version)."""
    return getattr(schedule, "pipeline_order", None)


def _kind_name(action: Any) -> str:
    ct = action.computation_type
    # torch's _ComputationType is an enum (its .name); a plain value stands for itself.
    return str(getattr(ct, "name", ct))


def _convert_rank(rank: int, actions: Sequence[Any], parse: Any) -> list[Task]:
    """One rank's compute tasks, in order; B of torch < 2.5 next to W becomes I."""
    flat: list[tuple[int, str, Any, int]] = []  # (stage, kind name, microbatch, position)

    def visit(a: Any, i: int) -> None:
        if a is None:
            return
        if isinstance(a, str):
            if not a.strip():
                return
            try:
                a = parse(a)
            except Exception as exc:
                raise HintError(f"rank {rank}: cannot parse action {a!r}: {exc}") from exc
            if a is None:
                return
        try:
            kind = _kind_name(a)
            # Newer torch's _Action has sub_actions (overlapped F+B); older ones have none.
            sub = getattr(a, "sub_actions", None)
        except AttributeError as exc:
            raise HintError(
                f"rank {rank}: position {i} is not a torch pipelining action: {a!r}"
            ) from exc
        if sub:  # an overlapped F+B (DualPipeV): its sub-actions in order
            for s in sub:
                visit(s, i)
            return
        if kind in _NOT_COMPUTE:
            return
        if kind not in _COMPUTE and kind != _LEGACY_BACKWARD:
            raise HintError(f"rank {rank}: position {i}: unsupported torch action {a!s}")
        flat.append((a.stage_index, kind, a.microbatch_index, i))

    for i, a in enumerate(actions):
        visit(a, i)
    legacy_b: Kind = "I" if any(_COMPUTE.get(k) == "W" for _, k, _, _ in flat) else "B"
    out: list[Task] = []
    for stage, kind, mb, i in flat:
        if not isinstance(stage, int) or not isinstance(mb, int) or stage < 0 or mb < 0:
            raise HintError(
                f"rank {rank}: position {i}: a compute action needs a stage and a"
                f" microbatch >= 0, got stage={stage!r}, microbatch={mb!r}"
            )
        out.append(Task(stage, _COMPUTE.get(kind, legacy_b), mb))
    return out


def _convert(order: Mapping[int, Sequence[Any]]) -> dict[int, list[Task]]:
    """Every rank's compute tasks of a torch per-rank action mapping."""
    ranks = sorted(order)
    if not ranks or ranks != list(range(len(ranks))):
        raise HintError(f"the order needs one action list per rank 0..P-1, got ranks {ranks}")
    schedules = _schedules()
    parse = schedules._Action.from_str
    return {r: _convert_rank(r, order[r], parse) for r in ranks}


def _placement(topo_ranks: dict[int, int], stages: int, chunks: int) -> Placement:
    for placement in ("interleaved", "vshape"):
        topo = Topology(stages=stages, chunks=chunks, placement=placement)
        if all(topo.rank_of(v) == r for v, r in topo_ranks.items()):
            return placement
    shown = ", ".join(f"{v}->{r}" for v, r in sorted(topo_ranks.items()))
    raise HintError(
        f"the order places its stages on ranks as {shown}: neither interleaved nor V-shape"
    )


def hint_from_torch(
    schedule: Any,
    *,
    stages: int | None = None,
    microbatches: int | None = None,
    chunks: int | None = None,
    split_backward: bool | None = None,
    ordered_weights: bool = False,
) -> tuple[StepPlan, dict[int, list[Task]]]:
    """Turn a ``torch.distributed.pipelining`` schedule into a step plan and a hint.

    Any of torch's fixed orders can then run readiness-first::

        plan, hint = rr.hint_from_torch(ScheduleInterleavedZeroBubble, stages=4,
                                        microbatches=8, chunks=2)
        schedule = rr.StepSchedule.build(plan, hint)

    Actions map to tasks as ``FORWARD`` -> ``F``, ``FULL_BACKWARD`` -> ``B``,
    ``BACKWARD_INPUT`` -> ``I``, ``BACKWARD_WEIGHT`` -> ``W`` (same text form: torch's
    ``2F3`` is ``Task(2, "F", 3)``). Bubbles (``None``) and communication or memory actions
    (``SEND_F``, ``RECV_F``, ``SEND_B``, ``RECV_B``, ``UNSHARD``, ``RESHARD``,
    ``REDUCE_GRAD``) are dropped. An overlapped forward+backward action (DualPipeV's
    ``OVERLAP_F_B``) becomes its forward, then its backward. When the order has ``I``/``W``
    actions the plan splits the backward, and a full ``B`` of the same order (DualPipeV
    mixes both) becomes its ``I`` immediately followed by its ``W``.

    The plan's sizes and placement are read off the order: P ranks, ``P x V`` virtual
    stages, M microbatches; interleaved placement (virtual stage ``v`` on rank ``v % P``: 1F1B,
    GPipe, interleaved 1F1B, looped BFS, interleaved zero-bubble) or V-shape (ZB-V,
    DualPipeV).

    Args:
        schedule: One of: a torch schedule class (``Schedule1F1B``, ``ScheduleGPipe``,
            ``ScheduleInterleaved1F1B``, ``ScheduleLoopedBFS``,
            ``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``,
            ``ScheduleDualPipeV``, or a subclass that computes ``pipeline_order``); a schedule
            name as ``torch.distributed.pipelining.schedules.get_schedule_class`` knows it
            (``"ZBVZeroBubble"``);
            a built schedule instance (its ``pipeline_order`` is used); or a per-rank action
            mapping ``{rank: [_Action | str | None, ...]}`` such as ``pipeline_order``.
            Multi-stage classes are instantiated on stand-in stages (no process group) and
            their ``pipeline_order`` is used; for ``ScheduleGPipe`` / ``Schedule1F1B``
            (classes and instances) the order their ``_step_microbatches`` loop runs is
            generated (see the module docstring).
        stages: Pipeline ranks P; needed with a class or name, checked against a mapping.
        microbatches: Microbatches M; needed with a class or name, checked against a
            mapping (the order must cover exactly microbatches ``0 .. M-1``).
        chunks: Stages per rank V; with a class, default 1 for single-stage schedules and 2
            for the multi-stage ones; checked against a mapping.
        split_backward: Split every backward into ``I`` and ``W`` (``B`` -> ``I`` then
            ``W``). Default: split exactly when the order has ``I``/``W`` actions; ``False``
            with such an order is an error.
        ordered_weights: Run each stage's ``W`` tasks in microbatch order (needs a split
            backward; see ``StepPlan``).

    Returns:
        ``(plan, hint)``: the ``StepPlan`` and ``{rank: [Task, ...]}``, validated with
        ``validate_hint``.

    Raises:
        HintError: An unsupported schedule or action, missing or inconsistent sizes, sizes
            torch's constructor rejects, or an order that is not a valid hint.
    """
    schedules = _schedules()
    if isinstance(schedule, str):
        # get_schedule_class exists only in torch versions with a name registry of schedules.
        lookup = getattr(schedules, "get_schedule_class", None)
        if lookup is None:
            raise HintError("this torch cannot look schedules up by name; pass the class")
        try:
            schedule = lookup(schedule)
        except Exception as exc:
            raise HintError(f"torch has no pipeline schedule named {schedule!r}: {exc}") from exc
    tasks: dict[int, list[Task]] | None
    if isinstance(schedule, type):
        tasks = _class_order(schedule, stages, microbatches, chunks)
    elif isinstance(schedule, Mapping):
        tasks = _convert(schedule)
    elif isinstance(schedule, schedules._PipelineSchedule):
        tasks = None
        if isinstance(schedule, schedules.PipelineScheduleSingle):
            tasks = _generated_order(type(schedule), schedule._num_stages, schedule._n_microbatches)
        if tasks is None:
            order = _pipeline_order(schedule)
            if not order:
                raise HintError(f"this {type(schedule).__name__} has no pipeline_order")
            tasks = _convert(order)
    else:
        raise HintError(
            "hint_from_torch takes a torch.distributed.pipelining schedule class, its name,"
            f" an instance or a {{rank: [action, ...]}} mapping; got {type(schedule).__name__}"
        )
    return _finish(tasks, stages, microbatches, chunks, split_backward, ordered_weights)


def _finish(
    tasks: dict[int, list[Task]],
    stages: int | None,
    microbatches: int | None,
    chunks: int | None,
    split_backward: bool | None,
    ordered_weights: bool,
) -> tuple[StepPlan, dict[int, list[Task]]]:
    """Infer and check the plan's sizes and placement; split B when asked; validate."""
    p = len(tasks)
    if stages is not None and stages != p:
        raise HintError(f"the order has {p} ranks, but stages={stages}")
    stage_rank: dict[int, int] = {}
    m_seen = 0
    for r, order in tasks.items():
        for t in order:
            other = stage_rank.setdefault(t.stage, r)
            if other != r:
                raise HintError(f"stage {t.stage} has tasks on rank {other} and on rank {r}")
            m_seen = max(m_seen, t.mb + 1)
    if not stage_rank:
        raise HintError("the order has no compute actions")
    nv = max(stage_rank) + 1
    if nv % p or len(stage_rank) != nv:
        missing = sorted(set(range(nv)) - set(stage_rank))
        raise HintError(
            f"the order has {nv} virtual stages on {p} ranks"
            + (f" (stages {missing} never appear)" if missing else "")
            + ": expected P x V stages, every one used"
        )
    v = nv // p
    if chunks is not None and chunks != v:
        raise HintError(f"the order has {v} stage(s) per rank, but chunks={chunks}")
    if microbatches is not None and microbatches != m_seen:
        raise HintError(
            f"the order covers microbatches 0..{m_seen - 1}, but microbatches={microbatches}"
        )
    has_split = any(t.kind in ("I", "W") for order in tasks.values() for t in order)
    if split_backward is False and has_split:
        raise HintError("the order has I/W actions: it needs split_backward=True (or None)")
    split = has_split if split_backward is None else split_backward
    if ordered_weights and not split:
        raise HintError("ordered_weights needs a split backward (split_backward=True)")
    plan = StepPlan(
        topology=Topology(stages=p, chunks=v, placement=_placement(stage_rank, p, v)),
        microbatches=m_seen,
        split_backward=split,
        ordered_weights=ordered_weights,
    )
    hint: dict[int, list[Task]] = {}
    for r in range(p):
        out: list[Task] = []
        for t in tasks[r]:
            if split and t.kind == "B":
                out += [Task(t.stage, "I", t.mb), Task(t.stage, "W", t.mb)]
            else:
                out.append(t)
        hint[r] = out
    validate_hint(plan, hint)
    return plan, hint
