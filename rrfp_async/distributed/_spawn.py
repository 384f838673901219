"""Start a local torch.distributed job: one process per rank, gloo on 127.0.0.1.

For tests, benchmarks and the demo. Every rank runs ``fn(rank, world_size, *args)`` with the
default process group initialised (``env://`` on a free loopback port chosen here); results
come back to the caller in rank order. A failure on any rank, or the outer timeout, stops
every process and raises ``SpawnError`` naming the ranks; nothing is left running.
"""

from __future__ import annotations

import datetime
import io
import os
import queue
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any, Protocol, TypeVar

from .._check import check_int
from .._errors import SpawnError
from ..testing import free_port

__all__ = ["free_port", "report_progress", "spawn"]

_progress: Any = None  # the progress queue inside a spawned worker


def report_progress(message: Any) -> None:
    """Inside a worker started by ``spawn``: send ``message`` (picklable) to the parent's
    ``on_progress`` callback. Does nothing elsewhere."""
    if _progress is not None:
        _progress.put(message)


T = TypeVar("T")


def _loads(data: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


def _name(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _check_picklable(fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """Refuse, in the parent, what the spawned processes could not receive: an unpicklable
    function or argument, or a function of a ``__main__`` that a child cannot import (an
    interactive session, ``python -c``, a notebook)."""
    try:
        ForkingPickler.dumps(fn)  # what starting a spawned process does with it
    except Exception as e:
        raise SpawnError(
            f"spawn needs a picklable, module-level function; {_name(fn)} cannot be pickled"
            f" ({type(e).__name__}: {e}): define it at the top level of a module (not a"
            " lambda, a local function or a bound method of an unpicklable object)",
            {},
        ) from None
    main = sys.modules.get("__main__")
    if getattr(fn, "__module__", None) == "__main__" and not getattr(main, "__file__", None):
        raise SpawnError(
            f"spawn cannot start {_name(fn)}: it is defined in an interactive __main__"
            " (a REPL, python -c, a notebook) that the spawned processes cannot import;"
            " define it in a module file",
            {},
        )
    for i, a in enumerate(args):
        try:
            ForkingPickler.dumps(a)
        except Exception as e:
            raise SpawnError(
                f"spawn: argument {i} of {_name(fn)} (a {type(a).__name__}) cannot be pickled"
                f" for the spawned processes: {type(e).__name__}: {e}",
                {},
            ) from None


def _worker(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    pg_timeout: float,
    threads: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
    progress: Any = None,
) -> None:
    global _progress
    _progress = progress
    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        out = fn(rank, world_size, *args)
    except BaseException as e:  # report every failure at once, including KeyboardInterrupt
        results.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return  # the parent stops the other ranks
    buf = io.BytesIO()
    try:
        torch.save(out, buf)  # tensors travel as bytes: no shared memory outliving this process
    except Exception as e:
        results.put(
            (
                rank,
                False,
                f"the result of {_name(fn)} (a {type(out).__name__}) cannot be sent back to the"
                f" parent: pickling it failed: {type(e).__name__}: {e}. Return tensors, plain"
                " values and containers of them, or objects of importable module-level classes",
            )
        )
        return
    results.put((rank, True, buf.getvalue()))
    # A rank that finished must not tear the group down under ranks still communicating.
    try:
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        pass


def spawn(
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
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes; return the results.

    Args:
        fn: A picklable (module-level) function.
        world_size: Number of processes.
        *args: Extra picklable arguments.
        backend: ``"gloo"`` (CPU) or ``"nccl"``.
        timeout: Seconds for the whole job, start-up included; then every process is killed.
        pg_timeout: The process group's timeout, seconds (bounds a collective that hangs).
        threads: ``torch.set_num_threads`` per process.
        on_progress: Called in this process with each message a worker sends through
            ``report_progress``.
        grace: After a first failure, seconds to wait for the other ranks' reports.

    Returns:
        ``fn``'s return values in rank order.

    Raises:
        PlanError: ``world_size`` is not an integer >= 1.
        SpawnError: ``fn`` or an argument cannot reach the spawned processes (not
            picklable, or defined in an interactive ``__main__``), a result cannot come back
            (not picklable), or a rank raised, died or did not finish within ``timeout``.
    """
    import torch.multiprocessing as mp

    world_size = check_int("spawn: world_size (the number of processes)", world_size, minimum=1)
    _check_picklable(fn, args)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    progress = ctx.Queue() if on_progress is not None else None
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, backend, pg_timeout, threads, fn, args, results, progress),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    return collect_ranks(procs, results, progress, on_progress, timeout=timeout, grace=grace)


def _drain(progress: Any, on_progress: Callable[[Any], None]) -> None:
    while True:
        try:
            on_progress(progress.get_nowait())
        except queue.Empty:
            return


class RankProcess(Protocol):
    """What ``collect_ranks`` needs of the process running one rank (``multiprocessing.Process``
    has it; the test suite's process pool gives the same face to its forked ranks)."""

    @property
    def exitcode(self) -> int | None: ...

    def is_alive(self) -> bool: ...

    def join(self, timeout: float | None = None) -> None: ...

    def kill(self) -> None: ...


def collect_ranks(
    procs: Sequence[RankProcess],
    results: Any,
    progress: Any,
    on_progress: Callable[[Any], None] | None,
    *,
    timeout: float,
    grace: float,
) -> list[Any]:
    """Wait for the ranks started by ``spawn`` (``_worker`` in each of ``procs``, reporting
    ``(rank, ok, value)`` on ``results``), stop every process, and return the results in
    rank order or raise ``SpawnError`` naming every failed rank.

    ``results`` and ``progress`` need ``get(timeout=)``/``get_nowait()`` and ``close()``
    (a ``multiprocessing`` queue has them); ``progress`` may be None. Shared with the test
    suite's process pool (``tests/_pool.py``), so that a pooled run reports exactly what
    ``spawn`` reports.
    """
    world_size = len(procs)
    out: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    interrupted = True  # until the loop ends normally: then ranks get time to exit cleanly

    def failed(rank: int, why: str) -> None:
        nonlocal deadline
        failures[rank] = why
        # One failure: give the other ranks a moment to report theirs (a peer that notices
        # it is gone fails too, with its own state), then stop everyone.
        deadline = min(deadline, time.monotonic() + grace)

    def take(rank: int, ok: bool, value: Any) -> None:
        if ok:
            out[rank] = _loads(value)
        else:
            failed(rank, value)

    try:
        while len(out) + len(failures) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [r for r in range(world_size) if r not in out and r not in failures]
                for r in missing:
                    failures[r] = (
                        "stopped after another rank failed"
                        if failures
                        else f"did not finish within {timeout} s"
                    )
                break
            if progress is not None and on_progress is not None:
                _drain(progress, on_progress)
            try:
                rank, ok, value = results.get(timeout=min(left, 0.2))
            except queue.Empty:
                for r, p in enumerate(procs):
                    if not p.is_alive() and r not in out and r not in failures:
                        # Give a just-finished rank's result a moment to arrive.
                        try:
                            take(*results.get(timeout=1.0))
                        except queue.Empty:
                            failed(
                                r,
                                f"process died with exit code {p.exitcode} (killed, or"
                                " it failed before running fn: see its traceback on"
                                " stderr; a script that calls spawn needs an"
                                " `if __name__ == '__main__':` guard)",
                            )
                        break
                continue
            take(rank, ok, value)
        interrupted = False
    finally:
        # Finished ranks leave the group together (barrier, destroy); after a failure, or
        # when this wait itself was interrupted (Ctrl-C, a test's timeout), stop at once.
        for p in procs:
            if p.is_alive():
                p.join(timeout=0.5 if failures or interrupted else 10.0)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        if progress is not None and on_progress is not None and not interrupted:
            # What a rank reported just before its result: the loop ends on the results.
            _drain(progress, on_progress)
        results.close()
        if progress is not None:
            progress.close()
    if failures:
        first = next(iter(failures))  # the first reported: usually the root cause
        others = "".join(
            f"\n--- rank {r}: {msg.splitlines()[0] if msg else ''}"
            for r, msg in failures.items()
            if r != first
        )
        raise SpawnError(
            f"{len(failures)} of {world_size} rank(s) failed; rank {first}: {failures[first]}"
            f"{others}",
            failures,
        )
    return [out[r] for r in range(world_size)]
