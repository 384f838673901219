"""``pooled_spawn``: ``rr.spawn`` for the test suite, without a fresh interpreter per job.

Converting a test is one line: ``rr.spawn(fn, world, *args, timeout=...)`` becomes
``pooled_spawn(fn, world, *args, timeout=...)`` (same signature, same results, the same
``SpawnError`` text and ``failures``). Each call is still a real multi-process run: one
process per rank, a new gloo process group on a free 127.0.0.1 port, ``fn(rank, world,
*args)`` run by ``rr.spawn``'s own rank body (``_spawn._worker``) and collected by its own
loop (``_spawn.collect_ranks``).

Design: a fork server per rank slot, not long-lived ranks
----------------------------------------------------------
Most of a spawned job's 2-5 s is starting Python and importing torch, not the test. A
*zygote* per rank slot (slot ``i`` serves rank ``i`` of every job of at least ``i + 1``
ranks) imports torch, the package and the test tooling once, then forks one child per job;
the child applies the caller's environment, working directory and ``sys.path``, unpickles
``fn`` (importing the test module), initialises the default group, runs, reports and exits;
between jobs a zygote imports the installed libraries its last child imported (transformers,
megatron, torch's lazy modules: seconds per job otherwise). A zygote never runs the
project's code beyond importing the package, so every job starts from the same clean slate
by construction, not by a list of resets: no process group, thread, ``os.environ`` change,
structlog/logging configuration, ``torch`` thread count, RNG state or module global of a
previous job survives, and a job that crashes, hangs or is stopped by pytest-timeout costs
only its own children (killed, as ``rr.spawn`` kills its processes). Long-lived ranks in
torch's style (``MultiProcContinuousTest``: one group for the whole class) would save ~50 ms
more per job but would need every leak found and undone by hand -- a ``dist.new_group`` of
``DistributedStage``, an unmatched send left on the default group, a receive thread that
outlives its test -- and a miss there makes the next test wrong, not red. Zygotes are
separate spawned processes, so ranks differ in hash seed as under ``rr.spawn``; a child
reseeds ``random``, numpy and torch from the OS, as a fresh interpreter does.

Each job's children write to the caller's file descriptors 1 and 2 as they are at the
call (passed over the zygote's socket), so pytest captures a rank's output in the test
that ran it. Nothing outlives the session: zygotes die with the pytest process (Linux
``PR_SET_PDEATHSIG``, and they exit on EOF of their pipe), children die with their zygote,
and the session fixture in ``tests/conftest.py`` stops the pool at the end.

Tests that need fresh processes keep them: ``rr.spawn``'s own tests, and tests that start
torchrun, the CLI or a script (they spawn no job here).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import itertools
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import queue
import signal
import sys
import sysconfig
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from multiprocessing.reduction import recv_handle, send_handle
from typing import Any, TypeVar, cast

__all__ = ["pool_pids", "pooled_spawn", "shutdown"]

T = TypeVar("T")

# What a zygote imports before its first fork: what nearly every multi-process test needs.
# It learns the rest from its children (``_installed``): the libraries a job imported.
_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.multiprocessing",
    "rrfp_async",
    "structlog",
    "pytest",
    "hypothesis",
)

_READY_TIMEOUT = 180.0  # a zygote's start (importing torch) under heavy load


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the thread that started it ends (a pytest
    killed with SIGKILL runs no clean-up); elsewhere the pipe's EOF is the only watch."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class _Send:
    """The ``put`` face ``_spawn._worker`` reports through (a queue under ``rr.spawn``)."""

    def __init__(self, conn: Any, kind: str) -> None:
        self._conn, self._kind = conn, kind

    def put(self, item: Any) -> None:
        self._conn.send((self._kind, item))


def _child(payload: bytes, out: Any, fd_out: int, fd_err: int, zygote_conn: Any) -> None:
    """One rank of one job, in a process forked from a zygote."""
    zygote_conn.close()  # only the zygote talks to pytest; its EOF must not wait for us
    _die_with_parent()
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd_out, 1)
    os.dup2(fd_err, 2)
    os.close(fd_out)
    os.close(fd_err)
    meta, body = pickle.loads(payload)
    # The caller's process state as a freshly spawned rank would inherit it, before ``fn``'s
    # module is imported (a module may read the environment when it loads).
    os.environ.clear()
    os.environ.update(meta["env"])
    os.chdir(meta["cwd"])
    sys.path[:] = meta["path"]
    import random

    import torch

    # Fresh seeds from the OS, as a new interpreter draws them (a fork would otherwise
    # repeat its zygote's streams in every job).
    random.seed()
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()
    torch.seed()

    from rrfp_async.distributed import _spawn

    before = set(sys.modules)
    fn, args = pickle.loads(body)
    _spawn._worker(
        meta["rank"],
        meta["world"],
        meta["port"],
        meta["backend"],
        meta["pg_timeout"],
        meta["threads"],
        fn,
        args,
        _Send(out, "result"),
        _Send(out, "progress") if meta["progress"] else None,
    )
    out.send(("modules", _installed([m for m in sys.modules if m not in before])))


def _installed(names: list[str]) -> list[str]:
    """Those of ``names`` (modules) that are installed libraries or the standard library:
    what a zygote may import ahead for the next jobs. Never the project's own modules (a
    test module's import runs its code)."""
    paths = sysconfig.get_paths()
    roots = tuple(
        os.path.join(paths[k], "") for k in ("stdlib", "platstdlib", "purelib", "platlib")
    )
    return [n for n in names if str(getattr(sys.modules.get(n), "__file__", "")).startswith(roots)]


def _preload(names: Iterable[str]) -> None:
    """Import ``names`` in a zygote, so that its children find them imported; a zygote that
    this leaves with a thread stops (a fork copies no other thread, nor what it holds)."""
    import importlib

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a child importing it itself shows them
        for name in names:
            if name not in sys.modules:
                # A module that does not import here is left to the children.
                with contextlib.suppress(Exception):
                    importlib.import_module(name)
    if threading.active_count() > 1:
        print(
            f"rrfp test pool: a zygote (pid {os.getpid()}) has a thread after importing"
            f" {sorted(set(names))[:10]}...; it stops, and the next job starts a new one",
            file=sys.stderr,
        )
        os._exit(3)


def _zygote(conn: Any, parent: int) -> None:
    """A rank slot's fork server: preload, then fork one child per job it is sent, relay
    the child's reports and its exit code, kill it on request. Single-threaded, so that a
    fork copies no lock held by another thread."""
    _die_with_parent()
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)
    _preload(_PRELOAD)
    import torch

    torch.set_num_threads(1)
    # A zygote is started as a daemon (pytest's multiprocessing exit handler stops it),
    # and multiprocessing refuses children to daemons; its children die with it instead
    # (PR_SET_PDEATHSIG) and the pool kills them before it stops the zygote.
    mp.current_process().daemon = False
    fork = mp.get_context("fork")
    conn.send(("ready", os.getpid()))
    child: Any = None
    reports: Any = None
    job = -1
    learned: list[str] = []  # what the last child imported from the installed libraries

    def relay(msg: Any) -> None:
        if msg[0] == "modules":
            learned.extend(msg[1])
        else:
            conn.send(("msg", job, msg))

    def finish() -> None:
        nonlocal child, reports
        # A report written just before the child exited is still in the pipe: relay it
        # before the exit, so the parent never sees a rank die that did report.
        while reports.poll(0.5):
            try:
                relay(reports.recv())
            except EOFError:
                break
        child.join()
        conn.send(("exit", job, child.exitcode))
        reports.close()
        child = reports = None
        # Between jobs: the libraries the test modules use (transformers, megatron, torch's
        # lazy submodules) are imported once here rather than in every job.
        _preload(learned)
        learned.clear()

    while True:
        waiting = [conn] if child is None else [conn, reports, child.sentinel]
        for ready in cast(list[Any], mpc.wait(waiting)):
            if ready is conn:
                try:
                    msg = conn.recv()
                except EOFError:  # the pool's end closed: the pytest process is gone
                    msg = ("stop",)
                if msg[0] == "run":
                    _, job_id, payload = msg
                    fd_out, fd_err = recv_handle(conn), recv_handle(conn)
                    if child is not None:
                        conn.send(("busy", job_id, job))
                        os.close(fd_out)
                        os.close(fd_err)
                        continue
                    job = job_id
                    reports, w = fork.Pipe(duplex=False)
                    child = fork.Process(
                        target=_child,
                        args=(payload, w, fd_out, fd_err, conn),
                        name=f"rrfp-pool-job{job}",
                        daemon=True,
                    )
                    child.start()
                    w.close()
                    os.close(fd_out)
                    os.close(fd_err)
                elif msg[0] == "kill":
                    if child is not None and msg[1] == job:
                        child.kill()
                elif msg[0] == "stop":
                    if child is not None:
                        child.kill()
                        child.join(5)
                    # Nothing to flush or finalise here; an interpreter with torch loaded
                    # takes ~2 s to tear down.
                    os._exit(0)
            elif child is not None and ready is reports:
                try:
                    relay(reports.recv())
                except EOFError:
                    finish()
            elif child is not None and ready is child.sentinel:
                finish()
            if child is None:
                break  # the wait list changed


class _Slot:
    """The pool's end of one zygote: rank ``index`` of every job."""

    def __init__(self, index: int) -> None:
        ctx = mp.get_context("spawn")
        self.index = index
        self.conn, theirs = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(
            target=_zygote,
            args=(theirs, os.getpid()),
            name=f"rrfp-pool-slot{index}",
            daemon=True,
        )
        self.proc.start()
        theirs.close()
        self.pid: int | None = None
        self.dead = False
        # The current job's state, filled by ``_Pool.pump``.
        self.job = -1
        self.exitcode: int | None = None
        self.exited = True

    def ask_stop(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(("stop",))

    def wait_ready(self, deadline: float) -> None:
        while self.pid is None:
            left = deadline - time.monotonic()
            if left <= 0 or not self.conn.poll(left):
                raise RuntimeError(
                    f"the test process pool's slot {self.index} (pid {self.proc.pid}) did not"
                    f" start within {_READY_TIMEOUT} s (importing torch under load?)"
                )
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                self.proc.join(5)
                raise RuntimeError(
                    f"the test process pool's slot {self.index} died while starting (exit"
                    f" code {self.proc.exitcode}); see its traceback on stderr"
                ) from None
            if msg[0] == "ready":
                self.pid = msg[1]

    def stop(self) -> None:
        self.ask_stop()
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()
        self.dead = True


class _Rank:
    """One rank of the current job, with the face ``collect_ranks`` needs of a process."""

    def __init__(self, pool: _Pool, slot: _Slot) -> None:
        self._pool, self._slot = pool, slot

    @property
    def exitcode(self) -> int | None:
        return self._slot.exitcode

    def is_alive(self) -> bool:
        self._pool.pump(0)
        return not self._slot.exited

    def join(self, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (1e9 if timeout is None else timeout)
        while not self._slot.exited and time.monotonic() < deadline:
            self._pool.pump(deadline - time.monotonic())

    def kill(self) -> None:
        if not self._slot.exited:
            try:
                self._slot.conn.send(("kill", self._slot.job))
            except OSError:
                self._pool.lost(self._slot)


class _Inbox:
    """A queue face (``get``, ``get_nowait``, ``close``) over what the zygotes relay."""

    def __init__(self, pool: _Pool) -> None:
        self._pool = pool
        self.items: list[Any] = []

    def get(self, timeout: float | None = None) -> Any:
        deadline = time.monotonic() + (1e9 if timeout is None else timeout)
        while not self.items:
            left = deadline - time.monotonic()
            if left <= 0:
                raise queue.Empty
            self._pool.pump(left)
        return self.items.pop(0)

    def get_nowait(self) -> Any:
        return self.get(0)

    def close(self) -> None:
        pass


class _Pool:
    def __init__(self) -> None:
        self.slots: list[_Slot] = []
        self.jobs = itertools.count()
        self.active: list[_Slot] = []
        self.results = _Inbox(self)
        self.progress = _Inbox(self)

    def ensure(self, n: int) -> list[_Slot]:
        """Slots ``0..n-1``, each alive, idle and ready (dead ones replaced)."""
        for i, s in enumerate(self.slots):
            if s.dead or not s.proc.is_alive():
                s.stop()
                self.slots[i] = _Slot(i)
        while len(self.slots) < n:
            self.slots.append(_Slot(len(self.slots)))
        deadline = time.monotonic() + _READY_TIMEOUT
        for s in self.slots[:n]:
            s.wait_ready(deadline)
        return self.slots[:n]

    def lost(self, slot: _Slot) -> None:
        """A zygote that stopped answering: its child dies with it (PR_SET_PDEATHSIG)."""
        if not slot.dead:
            slot.proc.kill()
            slot.proc.join(5)
            slot.conn.close()
            slot.dead = True
        if not slot.exited:
            slot.exited = True
            slot.exitcode = slot.proc.exitcode

    def pump(self, timeout: float) -> None:
        """Take what the current job's zygotes sent, waiting up to ``timeout`` for
        something."""
        conns = {s.conn: s for s in self.active if not s.dead}
        if not conns:
            time.sleep(max(0.0, min(timeout, 0.05)))
            return
        for conn in cast(list[Any], mpc.wait(list(conns), max(0.0, timeout))):
            slot = conns[conn]
            try:
                while conn.poll():
                    msg = conn.recv()
                    if msg[1] != slot.job:
                        continue  # a killed job's late report
                    if msg[0] == "msg":
                        kind, item = msg[2]
                        (self.results if kind == "result" else self.progress).items.append(item)
                    elif msg[0] == "exit":
                        slot.exitcode, slot.exited = msg[2], True
                    elif msg[0] == "busy":  # the pool's bookkeeping is wrong: start afresh
                        self.lost(slot)
                        break
            except (EOFError, OSError):
                self.lost(slot)

    def run(
        self,
        fn: Callable[..., Any],
        world_size: int,
        args: tuple[Any, ...],
        *,
        backend: str,
        timeout: float,
        pg_timeout: float,
        threads: int,
        on_progress: Callable[[Any], None] | None,
        grace: float,
    ) -> list[Any]:
        from rrfp_async.distributed._spawn import collect_ranks, free_port

        slots = self.ensure(world_size)
        job = next(self.jobs)
        port = free_port()
        body = pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL)
        common = {
            "world": world_size,
            "port": port,
            "backend": backend,
            "pg_timeout": pg_timeout,
            "threads": threads,
            "progress": on_progress is not None,
            "env": dict(os.environ),
            "cwd": os.getcwd(),
            "path": list(sys.path),
        }
        self.results.items.clear()
        self.progress.items.clear()
        self.active = slots
        for s in slots:
            s.job, s.exitcode, s.exited = job, None, False
        try:
            for s in slots:
                payload = pickle.dumps(({**common, "rank": s.index}, body))
                try:
                    s.conn.send(("run", job, payload))
                    send_handle(s.conn, 1, s.pid)
                    send_handle(s.conn, 2, s.pid)
                except OSError:
                    self.lost(s)
            ranks = [_Rank(self, s) for s in slots]
            progress = self.progress if on_progress is not None else None
            return collect_ranks(
                ranks, self.results, progress, on_progress, timeout=timeout, grace=grace
            )
        finally:
            # ``collect_ranks`` stopped every rank it could; a zygote whose child is still
            # not gone after that does not serve another job.
            for s in slots:
                if not s.exited:
                    self.lost(s)
            self.active = []

    def close(self) -> None:
        for s in self.slots:
            s.ask_stop()
        for s in self.slots:
            s.stop()
        self.slots = []


_pool: _Pool | None = None


def _get_pool() -> _Pool:
    global _pool
    if _pool is None:
        _pool = _Pool()
        atexit.register(shutdown)
    return _pool


def pooled_spawn(
    fn: Callable[..., T],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 120.0,
    pg_timeout: float = 60.0,
    threads: int = 1,
    on_progress: Callable[[Any], None] | None = None,
    grace: float = 3.0,
) -> list[T]:
    """``rr.spawn``, run on the test suite's process pool (see the module's design note).

    Args:
        fn: A picklable (module-level) function, run as ``fn(rank, world_size, *args)``.
        world_size: Number of processes.
        *args: Extra picklable arguments.
        backend: ``"gloo"`` (CPU) or ``"nccl"``.
        timeout: Seconds for the job once the pool is up (a cold pool's start is not
            counted); then every rank is killed.
        pg_timeout: The process group's timeout, seconds.
        threads: ``torch.set_num_threads`` per rank.
        on_progress: Called in this process with each ``report_progress`` message.
        grace: After a first failure, seconds to wait for the other ranks' reports.

    Returns:
        ``fn``'s return values in rank order.

    Raises:
        PlanError: ``world_size`` is not an integer >= 1.
        SpawnError: as ``rr.spawn`` raises it (same messages, same ``failures``).
    """
    from rrfp_async._check import check_int
    from rrfp_async.distributed._spawn import _check_picklable

    world_size = check_int("spawn: world_size (the number of processes)", world_size, minimum=1)
    _check_picklable(fn, args)
    return _get_pool().run(
        fn,
        world_size,
        args,
        backend=backend,
        timeout=timeout,
        pg_timeout=pg_timeout,
        threads=threads,
        on_progress=on_progress,
        grace=grace,
    )


def pool_pids() -> list[int]:
    """The pids of the pool's live zygotes (for tests of the pool itself)."""
    return [s.pid for s in (_pool.slots if _pool else []) if s.pid is not None and not s.dead]


def shutdown() -> None:
    """Stop every zygote (and any child still running); the next job starts a new pool."""
    global _pool
    if _pool is not None:
        _pool.close()
        _pool = None
