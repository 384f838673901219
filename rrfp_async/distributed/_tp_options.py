"""How the TP ranks of a stage work together, as one value: ``TPOptions``.

``DistributedStage(tp=TPOptions(...))`` says it in one argument; the stage's older flat
keywords (``coordinate_tp``, ``verify_tp``, ``fold_tp_check``, ``deduce_tp``) still work,
and giving both is refused (``tp_options``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._check import check_bool
from .._errors import PlanError

__all__ = ["KEYWORD_FIELDS", "UNSET", "TPOptions", "tp_options"]


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
"""The default of ``DistributedStage``'s flat TP keywords (each defaults to True), told
apart from a True the caller gave."""

KEYWORD_FIELDS = {
    "coordinate_tp": "coordinate",
    "verify_tp": "verify",
    "fold_tp_check": "fold_check",
    "deduce_tp": "deduce",
}
"""``DistributedStage``'s flat TP keyword -> the ``TPOptions`` field it sets."""


def tp_options(tp: TPOptions | None, who: str, **keywords: object) -> TPOptions:
    """The stage's ``TPOptions``: ``tp``, or one made of the flat keywords that were given
    (``KEYWORD_FIELDS``; a keyword left out is ``UNSET``).

    Raises:
        PlanError: ``tp`` is no ``TPOptions``, both ``tp`` and a flat keyword are given
            (the message names them), or a flat keyword is not a bool.
    """
    given = {k: v for k, v in keywords.items() if not isinstance(v, _Unset)}
    if tp is not None:
        if not isinstance(tp, TPOptions):
            raise PlanError(
                f"{who}: tp must be a TPOptions (rr.distributed.TPOptions(coordinate=...,"
                f" verify=..., fold_check=..., deduce=...)), got {type(tp).__name__}"
            )
        if given:
            names = ", ".join(f"{k}=" for k in given)
            fields = ", ".join(f"{KEYWORD_FIELDS[k]}=" for k in given)
            raise PlanError(
                f"{who}: both tp= and {names} are given; say each TP option once: either"
                f" tp=TPOptions({fields}...) or the flat keywords, not both"
            )
        return tp
    for k, v in given.items():
        check_bool(k, v)
    return TPOptions(**{KEYWORD_FIELDS[k]: v for k, v in given.items()})  # type: ignore[arg-type]
