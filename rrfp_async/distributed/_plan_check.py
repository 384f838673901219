"""The rules of the plan check and the step check, as pure functions.

``ControlGroup`` (``_control_group``) runs the checks on the control group; what decides
whether a plan is checked again (``plan_key``), what a rank posts at each step
(``step_row``), when the rows of a step disagree and what the error says
(``step_check_verdict``), and which peer failure is the step check's own
(``step_check_error``) are here, testable without processes.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence

from .._errors import FailureKind, PeerStepError, PlanError, StepDiffersError
from ..policies import StepSchedule
from ._digest import _ranks as ranks_have

__all__ = [
    "STEP_DIFFERS",
    "failure_kind",
    "plan_key",
    "rows_all_changed_alike",
    "step_check_error",
    "step_check_verdict",
    "step_row",
]

#: What the step check's ``PlanError`` says after "step N:" (``step_check_error`` reads it
#: in a peer's ABORT).
STEP_DIFFERS = "the ranks do not run the same step"


def plan_key(schedule: StepSchedule) -> tuple[object, ...]:
    """What decides whether a step's plan must be checked again: the plan's fields and the
    hint's name (a schedule regenerated from a step's sizes keeps it)."""
    p = schedule.plan
    return (
        p.topology,
        p.microbatches,
        p.split_backward,
        p.ordered_weights,
        p.forward_only,
        schedule.hint_name,
    )


def step_row(step: int, schedule: StepSchedule, *, changed: bool) -> list[int]:
    """What a rank posts in the step check: ``[step, microbatches, plan key hash (63 bits),
    training, changed]``."""
    p = schedule.plan
    key = hashlib.blake2b(repr(plan_key(schedule)).encode(), digest_size=8).digest()
    key63 = int.from_bytes(key, "little") >> 1
    return [step, p.microbatches, key63, int(not p.forward_only), int(changed)]


def rows_all_changed_alike(rows: Sequence[Sequence[int]]) -> bool:
    """Whether every rank's plan changed at this step, to the same plan: only then does every
    rank post the plan check, which names the differing fields."""
    return all(r[4] for r in rows) and len({r[0] for r in rows}) == 1


def step_check_verdict(
    who: str, step: int, rows: Sequence[Sequence[int]], *, differ: bool = False
) -> None:
    """Raise a ``PlanError`` naming every rank's row when the rows differ (or when
    ``differ``: the caller knows they do) in step, microbatches, plan or train.

    Args:
        who: This rank, for the message (``"rank 0 (global 0)"``).
        step: The step number.
        rows: One row (``step_row``) per rank of the control group, in rank order.
        differ: Raise even when the first four fields agree.

    Raises:
        PlanError: The ranks do not run the same step (``STEP_DIFFERS``).
    """
    if not differ and all(list(r[:4]) == list(rows[0][:4]) for r in rows):
        return
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank, r in enumerate(rows):
        groups.setdefault(tuple(r[:4]), []).append(rank)
    parts = [
        f"{ranks_have(ranks)} step {r[0]}, {r[1]} microbatches,"
        f" {'training' if r[3] else 'forward-only'}, plan #{r[2] & 0xFFFFFFFF:08x}"
        for r, ranks in sorted(groups.items(), key=lambda kv: kv[1][0])
    ]
    raise StepDiffersError(
        f"{who} step {step}: {STEP_DIFFERS}: "
        + "; ".join(parts)
        + ". Every rank must give each step the same number of microbatches (and the same"
        " schedule, train= and step number); a rank's data loader that ran out early or"
        " yields other batch counts is the usual cause"
    )


def failure_kind(e: BaseException) -> FailureKind:
    """The ``FailureKind`` the ABORT of a step that failed here with ``e`` carries."""
    return FailureKind.STEP_DIFFERS if isinstance(e, StepDiffersError) else FailureKind.OTHER


async def step_check_error(
    watcher: asyncio.Future[None], e: PeerStepError, step: int
) -> PlanError | None:
    """This rank's own step-check ``PlanError`` when a peer failed ``step`` with one (``e``).

    The rank that reads the step check's differing rows first fails the step and tells the
    others (an ABORT); one whose watcher had not read them yet would otherwise fail it with
    that ``PeerStepError``, not the ``PlanError`` its peers raise. The origin read the rows,
    so every rank posted the all-gather and its rows are on their way to this rank: wait for them
    (bounded like every step check, by ``step_timeout``) so that every rank fails alike.
    Only for that cause: after any other error of the origin (a ``PlanError`` of a task
    included) a rank that has not started the step yet may never post its row, so nothing is
    waited for. None when the cause is another or the rows agree on this rank.
    """
    if e.kind != FailureKind.STEP_DIFFERS or e.step != step:
        return None
    try:
        await asyncio.shield(watcher)
    except PlanError as verdict:
        return verdict
    except Exception:  # the check could not complete: keep the peer's word
        return None
    return None
