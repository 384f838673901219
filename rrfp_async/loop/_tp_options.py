"""How the TP ranks of a stage work together, as one value: ``TPOptions``.

One value for the three entry points, each of which also keeps its older flat keywords
(giving both is refused, the message naming them: ``resolve_tp_options``):

* ``DistributedStage(tp=TPOptions(...))`` (flat: ``coordinate_tp``, ``verify_tp``,
  ``fold_tp_check``, ``deduce_tp``) uses every field;
* ``StageLoop(tp=TPOptions(...))`` (flat: ``coordinate``, ``verify_sequences``,
  ``deduce_tp``) uses ``coordinate``, ``verify`` and ``deduce``; ``fold_check`` has no
  meaning there: the fold rides on the decisions over a channel, which the coordinator
  given to the stage already is (``DistributedStage`` builds it with the fold or not);
* ``LocalPipeline(tp=...)`` and ``rrfp_async.sim.simulate(tp_options=...)`` (flat:
  ``deduce_tp`` / ``tp_deduce``) use ``deduce`` only: their stages are TP leaders of a
  simulated group, which always coordinate, never compare sequences and have no channel
  to fold a check into.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._check import check_bool
from .._errors import PlanError

__all__ = ["UNSET", "TPOptions", "resolve_tp_options", "stage_tp_options"]


@dataclass(frozen=True, kw_only=True)
class TPOptions:
    """How the TP ranks of a stage work together (with TP > 1; without TP they are unused).

    Args:
        coordinate: Followers run the TP leader's decisions (switch off only to measure or
            to demonstrate divergence).
        verify: After each step, check that the TP ranks executed the same sequence
            (invariant 3).
        fold_check: With ``coordinate``, ``verify`` and the stage's ``agree_steps`` (the
            defaults), the check rides on the decisions (the leader sends a digest of its
            sequence with the step's last decision; each follower compares its own) instead
            of an all-gather after the step: a divergence is still caught in its step, and
            the agreement fails the step on every rank (see ``DecisionChannel``'s "folded
            sequence check"). False: the all-gather, on every TP rank.
        deduce: A TP follower starts, without waiting for the leader, a decision it can
            deduce: under a policy that ``chooses_ready_head`` (every built-in one), the
            next hinted task when it is ready with local inputs only (the first stage's
            forwards, the last stage's backwards, ``W`` tasks). The leader's decision is
            still checked when it arrives (``DivergenceError``). False: wait for every
            decision (to measure that path).

    Raises:
        PlanError: A field is not a bool.
    """

    coordinate: bool = True
    verify: bool = True
    fold_check: bool = True
    deduce: bool = True

    def __post_init__(self) -> None:
        for name in ("coordinate", "verify", "fold_check", "deduce"):
            check_bool(f"TPOptions.{name}", getattr(self, name))


class _Unset:
    """A flat TP keyword left out: its default, shown as the default's value."""

    def __init__(self, default: bool) -> None:
        self.default = default

    def __repr__(self) -> str:
        return repr(self.default)


UNSET: Any = _Unset(True)
"""The default of the entry points' flat TP keywords (each defaults to True), told apart
from a True the caller gave."""


def resolve_tp_options(
    tp: TPOptions | None,
    who: str,
    fields: Mapping[str, str],
    keywords: Mapping[str, object],
    *,
    arg: str = "tp",
) -> TPOptions:
    """An entry point's ``TPOptions``: ``tp``, or one made of the flat keywords that were
    given (a keyword left out is ``UNSET``).

    Args:
        tp: The ``TPOptions`` given, or None.
        who: The entry point, for the messages.
        fields: Each flat keyword -> the ``TPOptions`` field it sets.
        keywords: The flat keywords as called (``UNSET`` where left out).
        arg: The name of the entry point's ``TPOptions`` argument, for the messages.

    Raises:
        PlanError: ``tp`` is no ``TPOptions``, both ``tp`` and a flat keyword are given
            (the message names them), or a flat keyword is not a bool.
    """
    given = {k: v for k, v in keywords.items() if not isinstance(v, _Unset)}
    if tp is not None:
        if not isinstance(tp, TPOptions):
            raise PlanError(
                f"{who}: {arg} must be a TPOptions (rr.distributed.TPOptions(coordinate=...,"
                f" verify=..., fold_check=..., deduce=...)), got {type(tp).__name__}"
            )
        if given:
            names = ", ".join(f"{k}=" for k in given)
            field_names = ", ".join(f"{fields[k]}=" for k in given)
            raise PlanError(
                f"{who}: both {arg}= and {names} are given; say each TP option once: either"
                f" {arg}=TPOptions({field_names}...) or the flat keywords, not both"
            )
        return tp
    for k, v in given.items():
        check_bool(k, v)
    return TPOptions(**{fields[k]: v for k, v in given.items()})  # type: ignore[arg-type]


STAGE_LOOP_KEYWORDS = {
    "coordinate": "coordinate",
    "verify_sequences": "verify",
    "deduce_tp": "deduce",
}
"""``StageLoop``'s flat TP keyword -> the ``TPOptions`` field it sets."""


def stage_tp_options(
    tp: TPOptions | None, rank: int, coordinate: bool, verify_sequences: bool, deduce_tp: bool
) -> TPOptions:
    """``StageLoop``'s ``TPOptions``: ``tp``, or one made of its flat keywords
    (``STAGE_LOOP_KEYWORDS``).

    Raises:
        PlanError: As ``resolve_tp_options``.
    """
    return resolve_tp_options(
        tp,
        f"rank {rank}: StageLoop",
        STAGE_LOOP_KEYWORDS,
        {"coordinate": coordinate, "verify_sequences": verify_sequences, "deduce_tp": deduce_tp},
    )
