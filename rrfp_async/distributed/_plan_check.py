"""The rules of the plan check and the step check, as pure functions.

``ControlGroup`` (``_control_group``) runs the checks on the control group; what decides
whether a plan is checked again (``plan_key``), what a rank posts at each step
(``step_row``, in the end-of-step agreement) and the tag its messages carry (``plan_tag``),
when the rows of a step disagree and what the error says (``step_check_verdict``), and
which failure is the step check's own (``is_step_differs``, ``step_check_error``) are here,
testable without processes.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence

from .._errors import FailureKind, PeerStepError, PlanError, StepDiffersError, StepTimeoutError
from ..policies import StepSchedule
from ._digest import _ranks as ranks_have

__all__ = [
    "STEP_DIFFERS",
    "failure_kind",
    "is_step_differs",
    "plan_key",
    "plan_tag",
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


def plan_tag(schedule: StepSchedule) -> int:
    """A 63-bit hash of ``plan_key`` (never 0): the step check's plan field, and the tag
    every message of the step carries (``P2PChannel.at_step``)."""
    key = hashlib.blake2b(repr(plan_key(schedule)).encode(), digest_size=8).digest()
    return (int.from_bytes(key, "little") >> 1) or 1


def step_row(step: int, schedule: StepSchedule, *, changed: bool) -> list[int]:
    """What a rank posts in the step check: ``[step, microbatches, plan key hash (63 bits),
    training, changed]``."""
    p = schedule.plan
    return [step, p.microbatches, plan_tag(schedule), int(not p.forward_only), int(changed)]


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
    """The ``FailureKind`` the ABORT of a step that failed here with ``e`` carries: a
    ``PlanError`` (a misuse, ``PLAN``) is one on every rank (``PeerPlanError``); a watchdog
    that fired in the policy's turn names the policy (``POLICY``), one that fired while the
    rank waited for others says so (``TIMEOUT``)."""
    if isinstance(e, StepDiffersError):
        return FailureKind.STEP_DIFFERS
    if isinstance(e, StepTimeoutError) and e.policy is not None:  # its policy did not return
        return FailureKind.POLICY
    if isinstance(e, StepTimeoutError):  # it waited for others
        return FailureKind.TIMEOUT
    return FailureKind.PLAN if isinstance(e, PlanError) else FailureKind.OTHER


def is_step_differs(e: BaseException, step: int) -> bool:
    """Whether ``e`` failed ``step`` because the ranks do not run the same step: this rank's
    own ``StepDiffersError`` (a message of another plan: see ``Inlet``), or a peer's failure
    of ``step`` for that cause (its ABORT's ``FailureKind.STEP_DIFFERS``, never its text)."""
    if isinstance(e, StepDiffersError):
        return True
    return isinstance(e, PeerStepError) and e.kind == FailureKind.STEP_DIFFERS and e.step == step


async def step_check_error(
    verdict: asyncio.Future[None], e: BaseException, step: int
) -> PlanError | None:
    """The step check's ``PlanError`` naming every rank's side, when ``e`` failed ``step``
    because the ranks do not run the same step (``is_step_differs``); ``verdict`` raises it
    (the end-of-step agreement's rows, which every rank reads alike).

    A rank that received a message of another plan fails the step at once with a
    ``StepDiffersError`` that names only its neighbour and itself, and tells the others (an
    ABORT of kind ``FailureKind.STEP_DIFFERS``); each of them would otherwise fail it with
    that ``PeerStepError``. Every rank still posts the step's agreement, so its rows are on
    their way: wait for them (bounded like every agreement, by ``step_timeout``) so that
    every rank fails alike. Only for that cause: after any other error a rank may never
    post its row (it was lost), so nothing is waited for. None when the cause is another,
    the rows agree, or they could not be read.
    """
    if not is_step_differs(e, step):
        return None
    try:
        await asyncio.shield(verdict)
    except PlanError as error:
        return error
    except Exception:  # the check could not complete: keep the peer's word
        return None
    return None
