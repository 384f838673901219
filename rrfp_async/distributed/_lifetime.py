"""Open stages are closed whatever the program does: before torch.distributed destroys their
process groups, and at interpreter exit.

Design note: why a stage must not outlive the interpreter
---------------------------------------------------------
An open stage keeps threads blocked in gloo calls (a receiver per inbound edge: gloo's
point-to-point ``Work`` has no future, so the only wait is a blocking ``wait()`` on a thread
of its own). If the interpreter starts finalizing with such a thread blocked, the peer's
exit (its sockets closing) ends the wait; the thread then asks for the GIL of a finalizing
interpreter, CPython 3.11-3.13 ends it with ``pthread_exit``, and the forced unwind through
torch's C++ frames calls ``std::terminate``: "terminate called without an active exception",
SIGABRT, and torchrun marks a job FAILED whose training finished. torch's own schedules keep
no threads, so their users never call ``close()``, and a drop-in must need none either.

So every stage opened in this process is registered here while it is open, and closed by
whichever comes first:

* the user's own ``close()`` / the end of its ``with`` block (it unregisters);
* the garbage collection of the object that owns it (the drop-ins' schedules hold a
  ``weakref.finalize`` that calls :func:`close_quietly`);
* ``torch.distributed.destroy_process_group`` — wrapped (:func:`_install_destroy_hook`,
  once, at the first open): the stages that use the destroyed group (every stage, for the
  default ``group=None``) close first. That is the point of the program every rank reaches
  together, so the CLOSE handshake with the peers completes at once;
* interpreter exit: an ``atexit`` hook (``atexit`` runs before finalization, while daemon
  threads still run) closes what is still open, newest first. Closing after the groups
  were destroyed still works on gloo (``ProcessGroupGloo.shutdown`` leaves its pairs
  usable), so a program that imported ``destroy_process_group`` by name before rrfp_async
  and so bypasses the wrapper still exits cleanly.

A close that fails here is reported as a ``RuntimeWarning`` (shown by default) with the
stage's name, never raised into the program's exit or its ``destroy_process_group`` call.

The close itself must not need what the interpreter stops before ``atexit`` runs: a loop's
default executor (``concurrent.futures`` refuses new work once ``threading``'s shutdown ran)
is not used; the blocking waits of a close run on threads of their own
(``_bridges.run_blocking``).
"""

from __future__ import annotations

import atexit
import functools
import threading
import warnings
from typing import TYPE_CHECKING, Any, Protocol

import torch.distributed as dist

from . import _pulse as pulse

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["close_quietly", "closed", "open_stages", "opened"]


class Closable(Protocol):
    """What this module needs of a stage: its groups, its name, a blocking close."""

    @property
    def groups(self) -> Any: ...

    def close(self) -> None: ...


_lock = threading.Lock()
_open: dict[int, Closable] = {}  # id -> stage, in opening order (dicts keep it)
_installed = False


def opened(stage: Closable) -> None:
    """Register an open stage (``DistributedStage.__aenter__``); installs the hooks once."""
    with _lock:
        _open[id(stage)] = stage
        _install()


def closed(stage: Closable) -> None:
    """Unregister a stage that closes (its ``__aexit__`` / ``close``)."""
    with _lock:
        _open.pop(id(stage), None)


def open_stages() -> list[Closable]:
    """The stages of this process that are open now, oldest first."""
    with _lock:
        return list(_open.values())


def close_quietly(stage: Closable, why: str) -> None:
    """``stage.close()``; a failure becomes a ``RuntimeWarning`` naming ``why`` (the hook
    that closed it), never an exception into the caller's exit or teardown."""
    try:
        stage.close()
    except Exception as e:  # a failure here must not break the user's program's exit
        closed(stage)
        warnings.warn(
            f"rrfp_async: closing {stage!r} {why} failed: {type(e).__name__}: {e}",
            RuntimeWarning,
            stacklevel=2,
        )


def _install() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    atexit.register(_close_all_at_exit)
    _install_destroy_hook()


def _close_all_at_exit() -> None:
    for stage in reversed(open_stages()):
        close_quietly(stage, "at interpreter exit")


def _uses(stage: Closable, group: Any) -> bool:
    """Whether ``stage`` uses process group ``group`` (None: the default group's
    destruction, which destroys every group)."""
    if group is None or group is dist.GroupMember.WORLD:
        return True
    groups = stage.groups
    mine = [groups.tp, groups.decisions, groups.dp, groups.control, groups.p2p]
    mine += list((groups.payload or {}).values())
    return any(g is group for g in mine)


def _before_destroy(group: Any) -> None:
    for stage in reversed(open_stages()):
        if _uses(stage, group):
            close_quietly(stage, "before torch.distributed.destroy_process_group")
    if group is None:  # the default group: its store goes with it
        pulse.stop()


def _install_destroy_hook() -> None:
    """Wrap ``torch.distributed.destroy_process_group`` so that the stages using the group
    close first (see the design note). Only the public name is wrapped, once; the wrapper
    keeps the original's name, signature and docstring (``__wrapped__``)."""
    original = dist.destroy_process_group
    if getattr(original, "__rrfp_closes_stages__", False):
        return

    @functools.wraps(original)
    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        group = kwargs.get("group", args[0] if args else None)
        _before_destroy(group)
        return original(*args, **kwargs)

    wrapper: Callable[..., Any] = destroy_process_group
    wrapper.__rrfp_closes_stages__ = True  # type: ignore[attr-defined]
    dist.destroy_process_group = wrapper
