"""Enough file descriptors for ``build_groups``, checked on every rank before any group.

Design note: count first, agree over the store, then create
-----------------------------------------------------------
A gloo group holds descriptors on each member (``rrfp_async._resources.gloo_group_fds``).
When one cannot be had inside ``new_group``, gloo raises ``RuntimeError`` from its C++, or,
when the listening thread's ``accept`` is the one that fails, calls ``std::terminate``: the
process ends with SIGABRT and no message, and the other ranks wait inside ``new_group`` for
it until the store's timeout. Neither can be caught where it happens, so each rank counts
what its groups need against its headroom first, and the ranks agree on the outcome over
the default group's store (which is already connected: no new descriptor): a rank that is
short posts why (the first such rank's text, under one key), every rank counts itself in,
the last one in marks the check done. The short rank raises ``ResourceError`` at once; the
others wait for the mark and raise ``ResourceError`` naming that rank and its reason, so no
rank enters ``new_group`` to wait for one that never comes. The cost: three store round trips
per ``build_groups``.
"""

from __future__ import annotations

import itertools
from typing import Any

from .._errors import ResourceError
from .._resources import fd_shortfall, fd_usage, gloo_group_fds
from ._pulse import default_store

__all__ = ["agree_on_fds", "group_fds"]

_calls = itertools.count()  # build_groups is collective: every rank counts the same calls


def group_fds(layout: Any, *, tp_group: Any = None, payload_edges: int = 0) -> int:
    """The descriptors the groups ``build_groups`` makes hold on this rank (an estimate:
    every group counted as gloo; an NCCL group's bootstrap sockets are of the same order);
    ``payload_edges``: this rank's 2-rank payload groups."""
    need = gloo_group_fds(layout.world_size)  # the control group
    if layout.tp > 1:
        need += gloo_group_fds(layout.tp) * (1 if tp_group is not None else 2)
    if layout.dp > 1:
        need += gloo_group_fds(layout.dp)
    if layout.pp > 1:
        need += gloo_group_fds(layout.pp)
    return need + gloo_group_fds(2) * payload_edges


def agree_on_fds(layout: Any, need: int) -> None:
    """Refuse, on every rank, to build groups that some rank has no descriptors for.

    Raises:
        ResourceError: This rank or another is short of file descriptors (the message names
            the rank, the count it needs, its limit and what it has open, and the fix).
    """
    who = f"rank {layout.rank}: build_groups"
    reason = fd_shortfall(need, "its process groups")
    store = default_store() if layout.world_size > 1 else None
    if store is None:
        if reason is not None:
            raise _error(who, layout.rank, reason, here=True)
        return
    key = f"rrfp/fds/{next(_calls)}"
    if reason is not None and store.add(f"{key}/short", 1) == 1:
        store.set(f"{key}/first", f"{layout.rank}\n{reason}")
    if store.add(f"{key}/in", 1) == layout.world_size:
        store.set(f"{key}/done", "1")
    if reason is not None:
        raise _error(who, layout.rank, reason, here=True)
    store.wait([f"{key}/done"])  # (the store's timeout, as new_group's rendezvous)
    if store.add(f"{key}/short", 0) == 0:
        return
    origin, why = bytes(store.get(f"{key}/first")).decode().split("\n", 1)
    raise _error(who, int(origin), why, here=False)


def _error(who: str, origin: int, reason: str, *, here: bool) -> ResourceError:
    in_use, limit = fd_usage()
    if here:
        return ResourceError(
            f"{who}: global rank {origin} (this rank) is short of file descriptors: {reason};"
            " every rank of the job refuses to build its groups for it",
            resource="file descriptors",
            rank=origin,
            limit=limit,
            in_use=in_use,
        )
    return ResourceError(
        f"{who}: global rank {origin} is short of file descriptors, so no rank builds its"
        f" groups (gloo would abort that rank and leave this one waiting): on rank {origin},"
        f" {reason}",
        resource="file descriptors",
        rank=origin,
    )
