"""The p2p groups that open ``DistributedStage``s of this process use: one stage per group.

Design note: one stage, one p2p group
-------------------------------------
A stage's channel keeps a receive posted on every inbound edge. Two users of point-to-point
on one process group (two stages, or a stage next to torch pipelining on the default group)
would take each other's messages: gloo aborts the process when a message is larger than
the posted buffer, else a peer hangs. So ``build_groups`` gives each pipeline a p2p group of
its own, and a stage refuses to open on a p2p group that another open stage of this process
uses (``PlanError``).
"""

from __future__ import annotations

import threading
from typing import Any

from .._errors import PlanError

__all__ = ["claim_p2p_group", "release_p2p_group"]

_p2p_lock = threading.Lock()
_p2p_users: dict[int, tuple[Any, str]] = {}
"""id(p2p group) -> (the group, kept alive while in use; the open stage that uses it)."""


def claim_p2p_group(group: Any, me: str) -> int:
    """Record that the open stage ``me`` (its name, for messages) uses ``group`` (None: the
    default group); the key to release it with.

    Raises:
        PlanError: Another open stage of this process uses ``group``.
    """
    key = id(group)  # None (the default group) has one id, like every group
    with _p2p_lock:
        other = _p2p_users.get(key)
        if other is not None:
            which = (
                "the default process group (these StageGroups have no p2p group)"
                if group is None
                else "the p2p group of these StageGroups"
            )
            raise PlanError(
                f"{me}: {which} is already used by another open DistributedStage in this"
                f" process ({other[1]}); two stages on one group take each other's"
                " messages (gloo aborts the process, or a peer hangs). Give each stage"
                " that is open at the same time its own groups: call"
                " rr.build_groups(layout) once per stage, on every rank in the same order"
            )
        _p2p_users[key] = (group, me)
    return key


def release_p2p_group(key: int) -> None:
    """The stage that claimed ``key`` closed: its group is free again."""
    with _p2p_lock:
        _p2p_users.pop(key, None)
