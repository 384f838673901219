"""Awaitable bridges: torch / torch.distributed / CUDA completions as asyncio futures.

Design. Every completion that does not originate on the event loop's thread (a torch future's
callback on a gloo worker thread, a blocking ``wait()`` on a helper thread) enters the loop
only through ``loop.call_soon_threadsafe``; if the loop is already closed the completion is
dropped silently, so no exception ever leaks into a foreign thread. Nothing here polls
``Work.is_completed()``: on gloo point-to-point it stays False until ``wait()`` is called.
gloo p2p ``Work`` has no future, so it is awaited by a blocking ``wait()`` on a dedicated
daemon thread, one thread per outstanding wait: with a shared thread, a wait for a message
that arrives late would hold up one that has already arrived (a deadlock risk when the peer
waits on the second one). A thread is reused only once idle (a parked thread costs a queue
hand-off, a new one a thread start), and all are daemon threads, so a dead peer never blocks
interpreter exit. NCCL-side semantics are ``get_future``'s own (stream-ordered, see
:func:`work_future`).
What is still in flight when the program exits is waited for, briefly (``_in_flight``).
CUDA has no host callback: a recorded event is awaited either by ``synchronize()`` on a
helper thread or by polling ``query()`` from the loop with an exponential back-off timer.
``ComputeWorker`` is one worker thread (a "stream": tasks run one at a time, in order), so
compute never blocks the loop that receives messages; with a CUDA device it also owns a side
stream and returns only when the task's kernels have finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import queue
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any, Literal, ParamSpec, Self, TypeVar, TypeVarTuple, cast

import torch
import torch.distributed as dist

from ._errors import ClosedError, InterruptedStepError
from ._in_flight import IN_FLIGHT, in_flight, track
from ._resources import start_thread

__all__ = [
    "ComputeWorker",
    "EventMode",
    "after_fork_in_child",
    "cuda_event_future",
    "in_flight",
    "post",
    "run_blocking",
    "torch_future",
    "track",
    "work_future",
]

T = TypeVar("T")
U = TypeVar("U")
P = ParamSpec("P")
Ts = TypeVarTuple("Ts")

EventMode = Literal["thread", "poll"]
"""How :func:`cuda_event_future` waits: ``synchronize()`` on a thread, or ``query()`` polls."""

_POLL_FIRST_S = 20e-6
_POLL_MAX_S = 1e-3


def post(loop: asyncio.AbstractEventLoop | None, fn: Callable[..., object], *args: Any) -> None:
    """Schedule ``fn(*args)`` on ``loop`` from any thread; drop it when there is no loop or
    it is closed (nobody is left to receive the result)."""
    if loop is None or loop.is_closed():
        return
    with contextlib.suppress(RuntimeError):  # "Event loop is closed" in between
        loop.call_soon_threadsafe(fn, *args)


def _resolve(afut: asyncio.Future[T], value: T) -> None:
    if not afut.done():  # the awaiter may have cancelled it
        afut.set_result(value)


def _reject(afut: asyncio.Future[Any], exc: BaseException) -> None:
    if afut.done():
        return
    if isinstance(exc, StopIteration):  # asyncio futures refuse StopIteration
        wrapped = RuntimeError(f"StopIteration raised: {exc!r}")
        wrapped.__cause__ = exc
        exc = wrapped
    afut.set_exception(exc)


def _copy_outcome(
    src: torch.futures.Future[T], afut: asyncio.Future[U], transform: Callable[[T], U]
) -> None:
    """Copy a done torch future's value (or exception) into ``afut``; runs on the loop."""
    if afut.done():
        return
    try:
        value = transform(src.value())
    except BaseException as e:  # the torch future failed (or the transform did)
        _reject(afut, e)
    else:
        afut.set_result(value)


def _bridge(fut: torch.futures.Future[T], transform: Callable[[T], U]) -> asyncio.Future[U]:
    loop = asyncio.get_running_loop()
    afut: asyncio.Future[U] = loop.create_future()
    if fut.done():  # already complete: no thread hop
        _copy_outcome(fut, afut, transform)
        return afut

    IN_FLIGHT.add(future=True)
    fut.add_done_callback(_Relay(loop, afut, transform))
    return afut


class _Relay:
    """A torch future's completion callback: posts the outcome to the loop. It counts as in
    flight until the future lets go of it: the thread that completed the future (a gloo
    worker) takes the GIL once more, after the call, to drop it; the program's exit must not
    begin in between (see the module's design)."""

    __slots__ = ("_afut", "_loop", "_transform")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, afut: asyncio.Future[Any], transform: Any
    ) -> None:
        self._loop = loop
        self._afut = afut
        self._transform = transform

    def __call__(self, f: torch.futures.Future[Any]) -> None:
        # Runs on whichever thread completes the future (a gloo worker for collectives), or
        # inline in ``add_done_callback`` if it completed in between: only
        # call_soon_threadsafe is safe here.
        post(self._loop, _copy_outcome, f, self._afut, self._transform)

    def __del__(self) -> None:
        IN_FLIGHT.done(future=True)


def _identity(value: T) -> T:
    return value


def _to_none(value: object) -> None:
    return None


def torch_future(fut: torch.futures.Future[T]) -> asyncio.Future[T]:
    """An asyncio future on the running loop that resolves when ``fut`` completes.

    The torch future's completion callback may run on any thread (for gloo collectives, a
    gloo worker thread); it enters the loop only through ``loop.call_soon_threadsafe``, and
    is dropped silently if the loop has been closed by then. A future that is already done
    resolves without a thread hop.

    Args:
        fut: The torch future to await.

    Returns:
        An asyncio future with ``fut``'s value, or its exception.

    Raises:
        RuntimeError: Called without a running event loop.
    """
    return _bridge(fut, _identity)


class _DedicatedThreads:
    """Daemon threads for blocking calls: each call has a thread to itself while it runs.

    A thread that has finished its call parks for a while and is handed the next call, so a
    call costs a queue hand-off instead of a thread start (the difference:
    BENCHMARKS.md#notes-from-the-runtimes-docstrings); a call never waits behind another
    one, because only idle threads are reused. At most ``max_idle`` threads stay parked,
    each for at most ``idle_timeout`` seconds.
    """

    def __init__(self, max_idle: int = 64, idle_timeout: float = 10.0) -> None:
        self._max_idle = max_idle
        self._idle_timeout = idle_timeout
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue[tuple[Callable[[], None], str]]] = []

    def _after_fork(self) -> None:  # a child process inherits no threads
        self._lock = threading.Lock()
        self._idle = []

    def start(self, job: Callable[[], None], name: str) -> None:
        """Run ``job`` (which must not raise) on a thread of its own named ``name``."""
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is not None:
            inbox.put((job, name))
            return
        inbox = queue.SimpleQueue()
        inbox.put((job, name))
        threading.Thread(target=self._serve, args=(inbox,), name=name, daemon=True).start()

    def _serve(self, inbox: queue.SimpleQueue[tuple[Callable[[], None], str]]) -> None:
        me = threading.current_thread()
        while True:
            try:
                job, name = inbox.get(timeout=self._idle_timeout)
            except queue.Empty:
                with self._lock:
                    if any(q is inbox for q in self._idle):
                        self._idle = [q for q in self._idle if q is not inbox]
                        return
                continue  # taken off the idle list just now: a job is on its way
            me.name = name
            job()
            del job
            with self._lock:
                if len(self._idle) >= self._max_idle:
                    return
                self._idle.append(inbox)


def after_fork_in_child(fn: Callable[[], object]) -> None:
    """Run ``fn`` in a child process right after ``fork``, to forget state (threads, locks)
    the child did not inherit alive. A no-op where ``os.register_at_fork`` does not exist
    (it is POSIX only: Windows has no fork)."""
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=fn)


_threads = _DedicatedThreads()
after_fork_in_child(_threads._after_fork)


def run_blocking(fn: Callable[[*Ts], T], *args: *Ts, name: str | None = None) -> asyncio.Future[T]:
    """Run a blocking call on a dedicated daemon thread; an asyncio future of its result.

    The call has a thread to itself for as long as it runs, never a shared one, so a call that
    blocks for a long time (a wait for a message that arrives late) cannot hold up another.
    Threads are reused once idle (a parked thread costs a queue hand-off, a new one a thread
    start); they are daemon threads, so a call that never returns does not block interpreter
    exit. The result, or the exception the call raised, is handed to the running loop with
    ``loop.call_soon_threadsafe`` and dropped if the loop is closed by then. Cancelling the
    returned future does not stop the call.

    Args:
        fn: The blocking callable (wrap keyword arguments with ``functools.partial``).
        *args: Its positional arguments.
        name: The thread's name while it runs the call (default ``rrfp-blocking``).

    Returns:
        An asyncio future on the running loop with ``fn(*args)``'s result or exception.

    Raises:
        RuntimeError: Called without a running event loop.
    """
    loop = asyncio.get_running_loop()
    afut: asyncio.Future[T] = loop.create_future()

    def _target() -> None:
        try:
            value = fn(*args)
        except BaseException as e:  # every failure becomes the future's exception
            post(loop, _reject, afut, e)
        else:
            post(loop, _resolve, afut, value)
        finally:
            IN_FLIGHT.done(future=False)

    IN_FLIGHT.add(future=False)
    try:
        _threads.start(_target, name if name is not None else "rrfp-blocking")
    except BaseException:
        IN_FLIGHT.done(future=False)
        raise
    return afut


def work_future(work: dist.Work) -> asyncio.Future[None]:
    """An asyncio future that resolves when a ``torch.distributed`` operation completes.

    Collectives issued with ``async_op=True`` have a future (``work.get_future()``); it is
    bridged with :func:`torch_future`. gloo point-to-point ``Work`` has none ("Work::getFuture
    not implemented"): then the blocking ``work.wait()`` runs on a dedicated daemon thread,
    one per outstanding wait (see :func:`run_blocking`). ``is_completed()`` is never polled.

    With NCCL, the future path follows ``get_future``'s semantics: it completes once the
    result is ordered on the current CUDA stream, not when the kernel has finished; read
    results on the host only after a stream synchronisation.

    Args:
        work: What ``isend``/``irecv``/``batch_isend_irecv`` or a collective with
            ``async_op=True`` returned.

    Returns:
        An asyncio future on the running loop: ``None``, or the exception ``wait()`` raised
        (or the one the operation's future carries).

    Raises:
        RuntimeError: Called without a running event loop.
    """
    try:
        fut = work.get_future()
    except (RuntimeError, NotImplementedError):  # gloo p2p: "Work::getFuture not implemented"
        return run_blocking(_wait, work, name="rrfp-work-wait")
    return _bridge(cast("torch.futures.Future[object]", fut), _to_none)


def _wait(work: dist.Work) -> None:
    work.wait()


def _require_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"{what} needs a CUDA device, but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda is not None})"
        )


def cuda_event_future(
    event: torch.cuda.Event, *, mode: EventMode = "thread"
) -> asyncio.Future[None]:
    """An asyncio future that resolves when a recorded CUDA event has completed.

    CUDA has no host-callback API in torch, so there are two strategies:

    * ``mode="thread"`` (default): ``event.synchronize()`` on a dedicated daemon thread. Create
      the event with ``torch.cuda.Event(blocking=True)``: otherwise the CUDA runtime
      spin-waits and the helper thread keeps a CPU core busy until the event completes.
    * ``mode="poll"``: ``event.query()`` from the loop, with timers (``loop.call_later``)
      backing off exponentially from ``_POLL_FIRST_S`` to ``_POLL_MAX_S``; never a busy
      loop. The effective resolution is the loop's timer granularity (asyncio's epoll loop
      rounds a timer to its clock's resolution; uvloop runs sub-millisecond timers on the
      next iteration).

    Args:
        event: A CUDA event that has been recorded on a stream.
        mode: ``"thread"`` or ``"poll"``.

    Returns:
        An asyncio future on the running loop: ``None``, or the CUDA error.

    Raises:
        RuntimeError: CUDA is not available, or no loop is running.
        ValueError: Unknown ``mode``.
    """
    if mode not in ("thread", "poll"):
        raise ValueError(f"mode must be 'thread' or 'poll', got {mode!r}")
    _require_cuda("cuda_event_future")
    if mode == "thread":
        return run_blocking(event.synchronize, name="rrfp-cuda-event")
    loop = asyncio.get_running_loop()
    afut: asyncio.Future[None] = loop.create_future()

    def _poll(delay: float) -> None:
        if afut.done():  # cancelled by the awaiter
            return
        try:
            ready = event.query()  # type: ignore[no-untyped-call]
        except BaseException as e:  # a CUDA error surfaces here
            _reject(afut, e)
            return
        if ready:
            afut.set_result(None)
        else:
            loop.call_later(delay, _poll, min(2.0 * delay, _POLL_MAX_S))

    _poll(_POLL_FIRST_S)
    return afut


def _noop() -> None:
    return None


class _Job:
    """A call queued on a ``ComputeWorker`` and the future its result goes to."""

    __slots__ = ("call", "fut", "loop")

    def __init__(
        self, call: Callable[[], Any], fut: asyncio.Future[Any], loop: asyncio.AbstractEventLoop
    ) -> None:
        self.call = call
        self.fut = fut
        self.loop = loop


def _interrupted(e: BaseException, thread: str) -> InterruptedStepError:
    return InterruptedStepError(
        f"{type(e).__name__}{': ' + str(e) if str(e) else ''} was raised on the compute"
        f" thread {thread!r} (by the stage's module or hook): the task failed with it",
        e,
    )


class ComputeWorker:
    """One compute thread (a "stream"): tasks run one at a time, in submission order.

    ``await worker.run(fn, *args)`` runs ``fn`` on the worker thread while the event loop stays
    free (to receive messages, for instance). torch releases the GIL inside its kernels, so
    the loop thread keeps running during CPU compute too.

    With a CUDA ``device``, the worker owns a side stream: ``run`` makes it wait for the
    caller's current stream (so inputs produced there are ready), runs ``fn`` inside
    ``torch.cuda.stream(side_stream)``, records an event and awaits it with
    :func:`cuda_event_future`; the result is ready on the device when ``run`` returns.
    Tensors it allocates belong to the side stream's memory pool: a consumer that keeps using
    one on another stream while freeing it early should call ``tensor.record_stream``.

    Usable as a context manager (``with`` or ``async with``); :meth:`close` is idempotent.

    Args:
        device: ``None`` or a CPU device for plain threads; a CUDA device for a side stream.
        name: Prefix of the worker thread's name.
        event_mode: How CUDA completions are awaited (see :func:`cuda_event_future`).

    Raises:
        RuntimeError: A CUDA device was asked for and CUDA is not available.
    """

    def __init__(
        self,
        device: torch.device | str | None = None,
        *,
        name: str = "rrfp-compute",
        event_mode: EventMode = "thread",
    ) -> None:
        dev = torch.device(device) if device is not None else None
        if event_mode not in ("thread", "poll"):
            raise ValueError(f"event_mode must be 'thread' or 'poll', got {event_mode!r}")
        self._event_mode: EventMode = event_mode
        self._stream: torch.cuda.Stream | None = None
        initializer: Callable[[], object] | None = None
        if dev is not None and dev.type == "cuda":
            _require_cuda("ComputeWorker(device='cuda')")
            index: int | None = dev.index
            dev = torch.device("cuda", torch.cuda.current_device() if index is None else index)
            self._stream = torch.cuda.Stream(device=dev)  # type: ignore[no-untyped-call]
            initializer = functools.partial(torch.cuda.set_device, dev)
        self._device = dev
        self._closed = False
        self._initializer = initializer
        self._name = f"{name}_0"
        # One dedicated thread fed by a queue: a ThreadPoolExecutor + wrap_future costs about
        # twice the hand-off (BENCHMARKS.md, "Thread hand-off").
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._last_event: torch.cuda.Event | None = None  # of the last enqueued call
        self.handoffs = 0
        """Thread hand-offs so far: loop -> worker and back per call, and (``run`` on
        CUDA, ``event_mode="thread"``) loop -> the event's waiting thread and back."""
        self.calls = 0

    @property
    def device(self) -> torch.device | None:
        """The device given at construction (a CUDA one with its index filled in)."""
        return self._device

    @property
    def stream(self) -> torch.cuda.Stream | None:
        """The side stream in CUDA mode, else None."""
        return self._stream

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has been called."""
        return self._closed

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run ``fn(*args, **kwargs)`` on the worker thread and await its result.

        Tasks run one at a time in the order ``run`` was called. Cancelling the await drops a
        task that has not started; one that is running finishes in the background.

        Args:
            fn: The callable.
            *args: Its positional arguments.
            **kwargs: Its keyword arguments.

        Returns:
            What ``fn`` returned (in CUDA mode: once its kernels have completed).

        Raises:
            ClosedError: The worker is closed.
            Exception: Whatever ``fn`` raised.
        """
        if self._closed:
            raise self._closed_error()
        stream = self._stream
        if stream is None:
            return await self._submit(functools.partial(fn, *args, **kwargs))
        out, event = await self._submit(self._on_side_stream(fn, *args, **kwargs))
        if self._event_mode == "thread":
            self.handoffs += 2
        await cuda_event_future(event, mode=self._event_mode)
        return out

    async def run_enqueued(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Like :meth:`run`, but on CUDA return once ``fn`` has *enqueued* its kernels on the
        side stream, without waiting for them: no host sync per call (the GPU keeps the
        next call's kernels queued behind these while the loop decides). Work ordered on
        the side stream (the next call) needs nothing more; work on another stream waits on
        :attr:`last_event` (``order_after``). An error a kernel raises surfaces at the next
        synchronization (:meth:`drain`). Without CUDA, the same as :meth:`run`.

        Args:
            fn: The callable.
            *args: Its positional arguments.
            **kwargs: Its keyword arguments.

        Returns:
            What ``fn`` returned (its tensors ordered on the side stream).

        Raises:
            ClosedError: The worker is closed.
            Exception: Whatever ``fn`` raised.
        """
        if self._closed:
            raise self._closed_error()
        if self._stream is None:
            return await self._submit(functools.partial(fn, *args, **kwargs))
        out, event = await self._submit(self._on_side_stream(fn, *args, **kwargs))
        self._last_event = event
        return out

    def _closed_error(self) -> ClosedError:
        return ClosedError(
            f"ComputeWorker {self._name!r} is closed (its close() was called, or that of"
            " the executor that owns it): it runs nothing more. Close it after its last"
            " task, or build a new one"
        )

    @property
    def last_event(self) -> torch.cuda.Event | None:
        """The event recorded after the last :meth:`run_enqueued` call's kernels (CUDA)."""
        return self._last_event

    def order_after(self, stream: Any = None) -> None:
        """Order ``stream`` (default: the device's current stream on this thread) after
        every call enqueued so far, on the device: the host does not wait."""
        ev = self._last_event
        if ev is not None and self._stream is not None:
            s = stream if stream is not None else torch.cuda.current_stream(self._stream.device)
            s.wait_event(ev)

    def _on_side_stream(
        self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs
    ) -> Callable[[], tuple[T, torch.cuda.Event]]:
        stream = self._stream
        assert stream is not None
        caller_stream = torch.cuda.current_stream(stream.device)

        def _on_side_stream() -> tuple[T, torch.cuda.Event]:
            with torch.cuda.stream(stream):
                stream.wait_stream(caller_stream)
                out = fn(*args, **kwargs)
                event = torch.cuda.Event(  # type: ignore[no-untyped-call]
                    blocking=self._event_mode == "thread"
                )
                event.record(stream)
            return out, event

        return _on_side_stream

    async def drain(self) -> None:
        """Wait until every call submitted so far has ended (with CUDA: its kernels too).

        A no-op call queued behind them, so a call still running when its ``run`` was
        cancelled is waited for (a stage does this before a cancelled step returns, so that
        no gradient of that step lands after the caller's ``zero_grad``). Returns at once
        when the worker is closed or never started.
        """
        if self._closed or self._thread is None:
            return
        await self.run(_noop)  # on CUDA: after every kernel enqueued so far, too

    def _submit(self, call: Callable[[], T]) -> asyncio.Future[T]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    t = threading.Thread(target=self._work, name=self._name, daemon=True)
                    start_thread(t, f"ComputeWorker {self._name!r}", "the compute thread")
                    self._thread = t
        self._jobs.put(_Job(call, fut, loop))
        self.handoffs += 2  # to the worker thread, and the result back to the loop
        self.calls += 1
        return fut

    def _work(self) -> None:
        if self._initializer is not None:
            self._initializer()
        jobs = self._jobs
        while True:
            job = jobs.get()
            if job is None:
                return
            fut, loop = job.fut, job.loop
            if self._closed or fut.cancelled():  # closed before it started, or dropped
                post(loop, fut.cancel)
                continue
            try:
                out = job.call()
            except Exception as e:
                post(loop, _reject, fut, e)
            except BaseException as e:
                # A KeyboardInterrupt from user code would end the event loop it reaches
                # (asyncio lets BaseExceptions through): it fails the task as an Exception.
                post(loop, _reject, fut, _interrupted(e, self._name))
            else:
                post(loop, _resolve, fut, out)

    def close(self) -> None:
        """Stop the worker thread: queued tasks are cancelled, a running one is waited for.

        Idempotent. Blocks while a task runs: from a coroutine, prefer :meth:`aclose`.
        """
        self._closed = True
        self._jobs.put(None)
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join()

    async def aclose(self) -> None:
        """:meth:`close` without blocking the event loop (waits on a helper thread)."""
        self._closed = True
        self._jobs.put(None)
        t = self._thread
        if t is not None:
            await run_blocking(t.join, name="rrfp-compute-close")

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        where = f"stream on {self._device}" if self._stream is not None else "cpu thread"
        return f"ComputeWorker({where}, {state})"
