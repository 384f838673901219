"""Running out of an operating-system resource is an error, not an abort.

A rank at its file-descriptor limit used to die with SIGABRT and no message: gloo's C++
creates a process group's sockets, epoll descriptor and pipe in ``new_group`` and, when one
of them fails on its own loop thread, calls ``std::terminate``. Python cannot catch that, so
the descriptors are counted *before* the groups are made (``fd_shortfall``): the estimate of
what a gloo group of ``n`` ranks holds (measured, torch 2.13: 4 + (n - 1) descriptors) against
the headroom (the soft ``RLIMIT_NOFILE`` less the descriptors open). A thread that cannot be
started (``RuntimeError: can't start new thread``) becomes the same typed error
(``start_thread``). Each message names the resource, the limit, the count in use and the fix.
"""

from __future__ import annotations

import errno
import os
import resource
import threading

from ._errors import ResourceError

__all__ = [
    "FD_SLACK",
    "fd_hint",
    "fd_shortfall",
    "fd_usage",
    "gloo_group_fds",
    "is_fd_shortage",
    "is_thread_shortage",
    "no_fds_error",
    "no_thread_error",
    "start_thread",
]

FD_SLACK = 8
"""Descriptors kept free beyond the groups' estimate: a connection being set up holds one
more for a while, and the stage's trace and log files need some."""


def fd_usage() -> tuple[int, int | None]:
    """(descriptors open in this process, its soft ``RLIMIT_NOFILE`` or None when
    unlimited)."""
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:  # (no procfs: count nothing, check nothing)
        in_use = 0
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return in_use, None if soft == resource.RLIM_INFINITY else int(soft)


def gloo_group_fds(members: int) -> int:
    """Descriptors a gloo process group of ``members`` ranks holds on each member: a listening
    socket, an epoll descriptor, a pipe (two) and one socket per peer."""
    return 4 + max(members - 1, 0)


def fd_hint() -> str:
    """The fix, in words."""
    return (
        "raise the limit (`ulimit -n 65536` in the shell that starts the job, or"
        " resource.setrlimit(resource.RLIMIT_NOFILE, ...) before init_process_group), or run"
        " fewer stages (fewer build_groups calls) per process"
    )


def fd_shortfall(need: int, what: str) -> str | None:
    """Why this process cannot open ``need`` more descriptors for ``what``, or None when it
    can (with ``FD_SLACK`` to spare)."""
    in_use, limit = fd_usage()
    if limit is None or limit - in_use >= need + FD_SLACK:
        return None
    return (
        f"{what} take about {need} file descriptors (+{FD_SLACK} to spare), but this process"
        f" has {in_use} open of its limit of {limit} (soft RLIMIT_NOFILE): {limit - in_use}"
        f" left; {fd_hint()}"
    )


def no_fds_error(who: str, what: str, *, rank: int | None = None) -> ResourceError:
    """The error for a descriptor that could not be had just now (``EMFILE``/``ENFILE``)."""
    in_use, limit = fd_usage()
    lim = "unlimited" if limit is None else str(limit)
    return ResourceError(
        f"{who}: out of file descriptors for {what}: {in_use} open of the limit {lim} (soft"
        f" RLIMIT_NOFILE); {fd_hint()}",
        resource="file descriptors",
        rank=rank,
        limit=limit,
        in_use=in_use,
    )


def _thread_limit() -> int | None:
    try:
        with open("/proc/sys/kernel/threads-max") as f:
            kernel = int(f.read())
    except (OSError, ValueError):
        kernel = None
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    user = None if soft == resource.RLIM_INFINITY else int(soft)
    known = [v for v in (kernel, user) if v is not None]
    return min(known) if known else None


def start_thread(thread: threading.Thread, who: str, what: str) -> None:
    """``thread.start()``; a thread that cannot be started raises ``ResourceError`` naming
    ``what`` it was for, the threads this process runs and the limit, instead of
    ``RuntimeError: can't start new thread``.

    Raises:
        ResourceError: The thread could not be started (its ``__cause__``: the original).
    """
    try:
        thread.start()
    except RuntimeError as e:
        if not is_thread_shortage(e):
            raise
        raise no_thread_error(who, f"the thread {thread.name!r} ({what})", e) from e


def is_thread_shortage(e: BaseException) -> bool:
    """Whether ``e`` is Python's "can't start new thread"."""
    return isinstance(e, RuntimeError) and "start new thread" in str(e)


def is_fd_shortage(e: BaseException) -> bool:
    """Whether ``e`` is ``EMFILE`` / ``ENFILE`` (too many open files)."""
    return isinstance(e, OSError) and e.errno in (errno.EMFILE, errno.ENFILE)


def no_thread_error(who: str, what: str, e: BaseException) -> ResourceError:
    """The error for a thread that could not be started for ``what``."""
    running = threading.active_count()
    limit = _thread_limit()
    lim = "" if limit is None else f" (the limit: {limit}, RLIMIT_NPROC / threads-max)"
    return ResourceError(
        f"{who}: cannot start {what}: {e}; this process runs {running} Python threads{lim};"
        " free threads or memory (each thread reserves its stack: `ulimit -s`, `ulimit -u`),"
        " or run fewer stages per process",
        resource="threads",
        limit=limit,
        in_use=running,
    )
