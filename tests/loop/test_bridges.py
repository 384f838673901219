"""Awaitable bridges: torch futures, blocking calls, torch.distributed Work, CUDA events, and
the compute worker (gloo on 127.0.0.1 for the multi-process checks; CUDA tests skip without
a device)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist

from rrfp_async._bridges import (
    ComputeWorker,
    cuda_event_future,
    run_blocking,
    torch_future,
    work_future,
)
from rrfp_async._errors import ClosedError
from rrfp_async.loop._runner import loop_factory
from tests._pool import pooled_spawn

# ---------------------------------------------------------------------------- torch_future


@pytest.mark.timeout(30)
async def test_torch_future_resolves_from_another_thread() -> None:
    tf: torch.futures.Future[int] = torch.futures.Future()
    af = torch_future(tf)
    assert not af.done()
    threading.Timer(0.05, tf.set_result, args=(7,)).start()
    assert await asyncio.wait_for(af, 10) == 7


async def test_torch_future_already_done_resolves_without_a_hop() -> None:
    tf: torch.futures.Future[str] = torch.futures.Future()
    tf.set_result("x")
    af = torch_future(tf)
    assert af.done() and af.result() == "x"


@pytest.mark.timeout(30)
async def test_torch_future_propagates_exceptions() -> None:
    tf: torch.futures.Future[int] = torch.futures.Future()
    af = torch_future(tf)
    threading.Thread(target=tf.set_exception, args=(cast(Any, ValueError("boom")),)).start()
    with pytest.raises(ValueError, match="boom"):
        await asyncio.wait_for(af, 10)

    done: torch.futures.Future[int] = torch.futures.Future()
    done.set_exception(cast(Any, KeyError("k")))
    with pytest.raises(KeyError):
        await torch_future(done)


@pytest.mark.timeout(30)
async def test_torch_future_cancelled_by_the_awaiter_ignores_completion() -> None:
    tf: torch.futures.Future[int] = torch.futures.Future()
    af = torch_future(tf)
    af.cancel()
    tf.set_result(1)  # must not raise InvalidStateError on the loop
    await asyncio.sleep(0.01)
    assert af.cancelled()


@pytest.mark.timeout(30)
def test_torch_future_completed_after_the_loop_closed_is_dropped() -> None:
    tf: torch.futures.Future[int] = torch.futures.Future()
    loop = asyncio.new_event_loop()

    async def bridge() -> asyncio.Future[int]:
        return torch_future(tf)

    af = loop.run_until_complete(bridge())
    loop.close()
    errors: list[BaseException] = []

    def complete() -> None:
        try:
            tf.set_result(3)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=complete)
    t.start()
    t.join(10)
    assert not t.is_alive() and errors == [] and not af.done()


# ---------------------------------------------------------------------------- run_blocking


@pytest.mark.timeout(30)
async def test_run_blocking_returns_and_raises() -> None:
    main = threading.get_ident()
    assert await run_blocking(threading.get_ident) != main
    assert await run_blocking(pow, 2, 10) == 1024

    def fail() -> None:
        raise ValueError("nope")

    with pytest.raises(ValueError, match="nope"):
        await run_blocking(fail)

    def stop() -> None:
        raise StopIteration

    with pytest.raises(RuntimeError, match="StopIteration"):
        await run_blocking(stop)


@pytest.mark.timeout(30)
async def test_run_blocking_gives_each_outstanding_call_its_own_thread() -> None:
    # The first call can only finish after the second one ran: with one shared thread (or a
    # bounded pool that is full) this deadlocks.
    gates = [threading.Event() for _ in range(8)]

    def waits_for(i: int) -> int:
        if i + 1 < len(gates):
            assert gates[i + 1].wait(10), f"call {i + 1} never ran"
        gates[i].set()
        return i

    futs = [run_blocking(waits_for, i) for i in range(len(gates))]
    assert await asyncio.wait_for(asyncio.gather(*futs), 20) == list(range(len(gates)))
    # Idle threads are reused afterwards, still one per outstanding call.
    for g in gates:
        g.clear()
    futs = [run_blocking(waits_for, i) for i in range(len(gates))]
    assert await asyncio.wait_for(asyncio.gather(*futs), 20) == list(range(len(gates)))


@pytest.mark.timeout(30)
async def test_run_blocking_keeps_the_loop_free() -> None:
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.005)

    task = asyncio.create_task(ticker())
    await run_blocking(time.sleep, 0.2)
    task.cancel()
    assert ticks >= 5


@pytest.mark.timeout(30)
def test_run_blocking_completion_after_the_loop_closed_is_dropped() -> None:
    release = threading.Event()
    finished = threading.Event()
    errors: list[BaseException] = []
    old_hook = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        errors.append(cast(BaseException, args.exc_value))

    def blocked() -> int:
        release.wait(10)
        return 1

    loop = asyncio.new_event_loop()

    async def start() -> asyncio.Future[int]:
        return run_blocking(blocked)

    threading.excepthook = hook
    try:
        af = loop.run_until_complete(start())
        loop.close()
        release.set()
        # A second call on a fresh loop proves the worker thread survived the dropped result.
        with asyncio.Runner() as runner:
            assert runner.run(_call_soon(finished)) == 1
    finally:
        threading.excepthook = old_hook
    assert errors == [] and not af.done()


async def _call_soon(finished: threading.Event) -> int:
    def mark() -> int:
        finished.set()
        return 1

    await asyncio.sleep(0.05)
    return await asyncio.wait_for(run_blocking(mark), 10)


@pytest.mark.timeout(30)
def test_bridges_on_uvloop() -> None:
    async def main() -> tuple[int, int, str]:
        tf: torch.futures.Future[int] = torch.futures.Future()
        af = torch_future(tf)
        threading.Timer(0.02, tf.set_result, args=(5,)).start()
        with ComputeWorker() as worker:
            name = await worker.run(lambda: threading.current_thread().name)
        return await af, await run_blocking(abs, -4), name

    with asyncio.Runner(loop_factory=loop_factory(True)) as runner:
        assert runner.run(main()) == (5, 4, "rrfp-compute_0")
        assert "uvloop" in type(runner.get_loop()).__module__


# ---------------------------------------------------------------------------- work_future (fakes)


class _FutureWork:
    """A Work with a future (like a collective); wait() and is_completed() must not be used."""

    def __init__(self, fut: torch.futures.Future[Any]) -> None:
        self._fut = fut

    def get_future(self) -> torch.futures.Future[Any]:
        return self._fut

    def wait(self) -> bool:
        raise AssertionError("wait() called although the Work has a future")

    def is_completed(self) -> bool:
        raise AssertionError("is_completed() polled")


class _P2PWork:
    """A Work without a future (like gloo p2p): only a blocking wait()."""

    def __init__(self, gate: threading.Event, error: Exception | None = None) -> None:
        self.gate = gate
        self.error = error
        self.waited_on: str | None = None

    def get_future(self) -> torch.futures.Future[Any]:
        raise RuntimeError("Work::getFuture not implemented")

    def wait(self) -> bool:
        self.waited_on = threading.current_thread().name
        assert self.gate.wait(10)
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self) -> bool:
        raise AssertionError("is_completed() polled")


@pytest.mark.timeout(30)
async def test_work_future_bridges_a_work_future() -> None:
    tf: torch.futures.Future[Any] = torch.futures.Future()
    af = work_future(cast(dist.Work, _FutureWork(tf)))
    threading.Timer(0.02, tf.set_result, args=([torch.ones(1)],)).start()
    await asyncio.wait_for(af, 10)
    assert af.result() is None

    bad: torch.futures.Future[Any] = torch.futures.Future()
    bad.set_exception(RuntimeError("collective failed"))
    with pytest.raises(RuntimeError, match="collective failed"):
        await work_future(cast(dist.Work, _FutureWork(bad)))


@pytest.mark.timeout(30)
async def test_work_future_waits_on_a_thread_without_a_future() -> None:
    first, second = threading.Event(), threading.Event()
    w1, w2 = _P2PWork(first), _P2PWork(second)
    f1, f2 = work_future(cast(dist.Work, w1)), work_future(cast(dist.Work, w2))
    second.set()  # the later wait completes first: it must not queue behind the first
    await asyncio.wait_for(f2, 10)
    assert not f1.done()
    first.set()
    await asyncio.wait_for(f1, 10)
    assert w1.waited_on is not None and w1.waited_on.startswith("rrfp-work-wait")

    gate = threading.Event()
    gate.set()
    with pytest.raises(ConnectionError, match="peer gone"):
        await work_future(cast(dist.Work, _P2PWork(gate, ConnectionError("peer gone"))))


# ---------------------------------------------------------------------------- CUDA events


class _FakeEvent:
    def __init__(self, ready_after: float, error: Exception | None = None) -> None:
        self.deadline = time.monotonic() + ready_after
        self.error = error
        self.queries = 0
        self.synced_on: str | None = None

    def query(self) -> bool:
        self.queries += 1
        if self.error is not None:
            raise self.error
        return time.monotonic() >= self.deadline

    def synchronize(self) -> None:
        self.synced_on = threading.current_thread().name
        time.sleep(max(0.0, self.deadline - time.monotonic()))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
async def test_cuda_event_future_without_cuda_raises_clearly() -> None:
    with pytest.raises(RuntimeError, match=r"needs a CUDA device.*is_available\(\) is False"):
        cuda_event_future(cast(torch.cuda.Event, _FakeEvent(0.0)))
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        ComputeWorker(device="cuda")


async def test_cuda_event_future_rejects_an_unknown_mode() -> None:
    with pytest.raises(ValueError, match="mode"):
        cuda_event_future(cast(torch.cuda.Event, _FakeEvent(0.0)), mode="spin")  # type: ignore[arg-type]


@pytest.mark.timeout(30)
async def test_cuda_event_future_poll_backs_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    ev = _FakeEvent(0.05)
    t = time.monotonic()
    await asyncio.wait_for(cuda_event_future(cast(torch.cuda.Event, ev), mode="poll"), 10)
    assert time.monotonic() - t >= 0.05
    # 50 ms with back-off to 1 ms: about 50 + a few queries, not a busy loop.
    assert 2 <= ev.queries <= 120

    ready = _FakeEvent(0.0)
    af = cuda_event_future(cast(torch.cuda.Event, ready), mode="poll")
    assert af.done() and ready.queries == 1

    failing = _FakeEvent(0.0, error=RuntimeError("CUDA error: illegal address"))
    with pytest.raises(RuntimeError, match="illegal address"):
        await cuda_event_future(cast(torch.cuda.Event, failing), mode="poll")


@pytest.mark.timeout(30)
async def test_cuda_event_future_thread_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    ev = _FakeEvent(0.03)
    await asyncio.wait_for(cuda_event_future(cast(torch.cuda.Event, ev)), 10)
    assert ev.synced_on is not None and ev.synced_on.startswith("rrfp-cuda-event")
    assert ev.queries == 0


# ---------------------------------------------------------------------------- ComputeWorker


@pytest.mark.timeout(30)
async def test_compute_worker_runs_in_submission_order_on_one_thread() -> None:
    order: list[int] = []
    threads: set[str] = set()

    def task(i: int, delay: float) -> int:
        threads.add(threading.current_thread().name)
        time.sleep(delay)
        order.append(i)
        return i * i

    async with ComputeWorker(name="stage0") as worker:
        # Later tasks are shorter: with more than one thread they would finish first.
        out = await asyncio.gather(*(worker.run(task, i, 0.02 * (5 - i)) for i in range(5)))
        assert out == [0, 1, 4, 9, 16]
        assert order == [0, 1, 2, 3, 4]
        assert len(threads) == 1 and next(iter(threads)).startswith("stage0")
        added = await worker.run(torch.add, torch.ones(2), torch.ones(2), alpha=2)
        assert torch.equal(added, torch.full((2,), 3.0))
    assert worker.closed


@pytest.mark.timeout(30)
async def test_compute_worker_counts_its_handoffs_and_enqueued_runs_keep_the_order() -> None:
    order: list[int] = []

    def task(i: int) -> int:
        time.sleep(0.01 * (3 - i))
        order.append(i)
        return i

    async with ComputeWorker(name="hops") as worker:
        assert worker.handoffs == 0
        out = await asyncio.gather(*(worker.run_enqueued(task, i) for i in range(3)))
        assert out == [0, 1, 2] and order == [0, 1, 2]
        await worker.run(task, 3)
        # Two hand-offs per call on a CPU (to the compute thread and back), none hidden.
        assert (worker.calls, worker.handoffs) == (4, 8)
        assert worker.last_event is None  # no CUDA: nothing to order on a device
        worker.order_after()  # a no-op without CUDA


@pytest.mark.timeout(30)
async def test_compute_worker_keeps_the_loop_free() -> None:
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.005)

    with ComputeWorker() as worker:
        task = asyncio.create_task(ticker())
        t = time.monotonic()
        await worker.run(time.sleep, 0.2)
        task.cancel()
        assert time.monotonic() - t >= 0.2
    assert ticks >= 5  # about 40 at 5 ms on an idle machine


@pytest.mark.timeout(30)
async def test_compute_worker_errors_close_and_reuse() -> None:
    def fail() -> None:
        raise ZeroDivisionError("in task")

    worker = ComputeWorker()
    with pytest.raises(ZeroDivisionError, match="in task"):
        await worker.run(fail)
    assert await worker.run(lambda: 2) == 2  # the thread survives a failing task
    assert "open" in repr(worker)
    await worker.aclose()
    worker.close()  # idempotent
    await worker.aclose()
    assert worker.closed and "closed" in repr(worker)
    with pytest.raises(ClosedError, match="ComputeWorker 'rrfp-compute_0' is closed"):
        await worker.run(lambda: 1)  # (a bare RuntimeError before issue 41)


@pytest.mark.timeout(30)
async def test_compute_worker_drops_a_cancelled_task_and_close_cancels_the_queue() -> None:
    ran: list[str] = []
    gate = threading.Event()

    def task(name: str) -> str:
        if name == "first":
            gate.wait(10)
        ran.append(name)
        return name

    worker = ComputeWorker()
    first = asyncio.ensure_future(worker.run(task, "first"))
    dropped = asyncio.ensure_future(worker.run(task, "dropped"))
    kept = asyncio.ensure_future(worker.run(task, "kept"))
    await asyncio.sleep(0.05)  # "first" runs and blocks; the other two wait in the queue
    dropped.cancel()  # cancelled before it started: never runs
    await asyncio.sleep(0)
    gate.set()
    assert await first == "first" and await kept == "kept"
    assert ran == ["first", "kept"]
    # close() while a task runs and another waits: the running one finishes, the queued one
    # is cancelled and never runs.
    gate.clear()
    running = asyncio.ensure_future(worker.run(task, "first"))
    queued = asyncio.ensure_future(worker.run(task, "queued"))
    await asyncio.sleep(0.05)
    closing = asyncio.ensure_future(worker.aclose())
    await asyncio.sleep(0.05)
    gate.set()
    await closing
    assert await running == "first"
    with pytest.raises(asyncio.CancelledError):
        await queued
    assert ran == ["first", "kept", "first"]


def test_compute_worker_sync_context_manager() -> None:
    with ComputeWorker(device="cpu") as worker:
        assert worker.device == torch.device("cpu") and worker.stream is None
        out = asyncio.run(worker.run(torch.mm, torch.eye(2), torch.ones(2, 2)))
        assert torch.equal(out, torch.ones(2, 2))
    assert worker.closed


# ---------------------------------------------------------------------------- gloo, 2 processes


async def _dist_main(rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    peer = 1 - rank

    async def send(t: torch.Tensor, tag: int) -> None:
        work = dist.isend(t, peer, tag=tag)
        assert work is not None
        await asyncio.wait_for(work_future(work), 30)

    def post_recv(t: torch.Tensor, tag: int) -> asyncio.Future[None]:
        work = dist.irecv(t, peer, tag=tag)
        assert work is not None
        return work_future(work)

    posted, ack = torch.zeros(1), torch.zeros(1)

    # 1. An irecv posted before its send; the loop keeps running meanwhile. Shown by
    # causality, not by counting ticks in a wall-time window (which fails under load): rank 0
    # sends the data only after a message that rank 1's loop sends from a *new* task while
    # the receive is outstanding, so that task must have run with the receive pending.
    if rank == 1:
        buf = torch.zeros(4)
        recv = post_recv(buf, 1)
        seen: list[tuple[str, bool]] = []
        await send(posted, 9)  # tell rank 0 the receive is posted
        seen.append(("posted", recv.done()))

        async def alive() -> None:
            seen.append(("alive", recv.done()))
            await send(posted, 7)  # rank 0 sends the data only after this

        task = asyncio.create_task(alive())
        await asyncio.wait_for(recv, 30)
        await asyncio.wait_for(task, 30)
        out["early"] = buf.tolist()
        out["seen"] = seen
    else:
        await asyncio.wait_for(post_recv(posted, 9), 30)
        await asyncio.wait_for(post_recv(posted, 7), 30)
        await send(torch.arange(4.0), 1)

    # 2. Two outstanding irecvs (tags 2 and 3): tag 3 is sent first, and tag 2 only after
    # rank 1 acknowledged tag 3. With a single shared wait thread this would deadlock.
    if rank == 1:
        b2, b3 = torch.zeros(2), torch.zeros(3)
        f2, f3 = post_recv(b2, 2), post_recv(b3, 3)
        await send(posted, 9)
        done, _ = await asyncio.wait({f2, f3}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
        out["first"] = "tag3" if done == {f3} else ("tag2" if done == {f2} else "none")
        out["f2_pending_after_f3"] = not f2.done()
        await send(ack, 8)
        await asyncio.wait_for(f2, 30)
        out["out_of_order"] = (b2.tolist(), b3.tolist())
    else:
        await asyncio.wait_for(post_recv(posted, 9), 30)
        await send(torch.full((3,), 3.0), 3)
        await asyncio.wait_for(post_recv(ack, 8), 30)
        await send(torch.full((2,), 2.0), 2)

    # 3. A collective with async_op=True: the future path.
    t = torch.tensor([float(rank + 1)])
    work = dist.all_reduce(t, async_op=True)
    assert work is not None
    work.get_future()  # raises if the collective had no future (then the test is moot)
    await asyncio.wait_for(work_future(work), 30)
    out["all_reduce"] = t.item()
    return out


def _dist_checks(rank: int, world: int) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    results = []
    for use_uvloop in (False, True):
        with asyncio.Runner(loop_factory=loop_factory(use_uvloop)) as runner:
            res = runner.run(_dist_main(rank))
            res["loop"] = type(runner.get_loop()).__module__
        results.append(res)
        dist.barrier()
    return results


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_work_future_with_gloo_p2p_and_collectives() -> None:
    ranks = pooled_spawn(_dist_checks, 2, timeout=90)
    assert len(ranks[1]) == 2
    loops = [r["loop"] for r in ranks[1]]
    assert loops[0].startswith("asyncio") and loops[1].startswith("uvloop")
    for r0, r1 in zip(ranks[0], ranks[1], strict=True):
        assert r1["early"] == [0.0, 1.0, 2.0, 3.0]
        # The loop ran a new task while the receive was pending (rank 0 sent after it).
        assert r1["seen"] == [("posted", False), ("alive", False)]
        assert r1["first"] == "tag3" and r1["f2_pending_after_f3"]
        assert r1["out_of_order"] == ([2.0, 2.0], [3.0, 3.0, 3.0])
        assert r0["all_reduce"] == r1["all_reduce"] == 3.0


# ---------------------------------------------------------------------------- CUDA (GPU machines)


def _need_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


@pytest.mark.gpu
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["thread", "poll"])
async def test_cuda_event_future_on_a_device(mode: str) -> None:
    _need_cuda()
    a = torch.randn(2048, 2048, device="cuda")
    event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
    b = a
    for _ in range(20):
        b = torch.tanh(b @ a)
    event.record()
    await asyncio.wait_for(cuda_event_future(event, mode=mode), 30)  # type: ignore[arg-type]
    assert event.query()  # type: ignore[no-untyped-call]
    assert torch.isfinite(b).all()


@pytest.mark.gpu
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["thread", "poll"])
async def test_compute_worker_side_stream_matmul(mode: str) -> None:
    _need_cuda()
    torch.manual_seed(0)
    x, w = torch.randn(1024, 1024), torch.randn(1024, 1024)
    expected = (x * 2) @ w
    # Inputs produced on the caller's stream right before run(): the side stream must wait.
    xd = x.cuda() * 2
    wd = w.cuda()
    seen: list[torch.cuda.Stream] = []

    def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        seen.append(torch.cuda.current_stream())
        return a @ b

    async with ComputeWorker(device="cuda", event_mode=mode) as worker:  # type: ignore[arg-type]
        assert worker.stream is not None
        assert worker.stream != torch.cuda.current_stream()
        out = await asyncio.wait_for(worker.run(matmul, xd, wd), 30)
        assert seen == [worker.stream]
        # Ready on the device when run() returns: nothing left to do on the side stream.
        assert worker.stream.query()
        torch.testing.assert_close(out.cpu(), expected, rtol=1e-2, atol=1e-2)


# ---------------------------------------------------------------------------- at exit

_EXIT_JOB = """
import asyncio, os, sys, time
from pathlib import Path
import torch
import torch.distributed as dist
from rrfp_async._bridges import in_flight, track, work_future

rank, port, d = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
dist.barrier()
awaited = sys.argv[4] == "awaited"
if sys.argv[4] == "unsettled":  # gloo's thread frees the work after the exit went on
    import rrfp_async._in_flight as inf
    inf._SETTLE_S = 0.0
    sys.setswitchinterval(1.0)  # (the exiting thread keeps the GIL: Python finalizes first)
if rank == 1:
    async def main() -> None:
        work = dist.all_reduce(torch.ones(1), async_op=True)  # rank 0 never joins it
        if not awaited:  # posted for the peers, awaited by no one (a failed step's agreement)
            track(work)
            return
        try:
            await asyncio.wait_for(work_future(work), 0.2)
        except TimeoutError:
            pass
    asyncio.run(main())
    (d / "in_flight").write_text(repr(in_flight()))
    (d / "exiting").write_text(repr(time.monotonic()))
    sys.exit(0)  # the all-reduce fails when rank 0 exits: during this exit
while not (d / "exiting").exists():
    time.sleep(0.01)
time.sleep(0.5 if awaited else 0.05)
os._exit(0)  # its sockets close: rank 1's all-reduce fails with "Connection closed by peer"
"""


@pytest.mark.distributed
@pytest.mark.timeout(360)  # (up to 10 runs of two processes that import torch)
@pytest.mark.parametrize("how", ["awaited", "posted", "unsettled"])
def test_a_collective_that_fails_while_the_program_exits_ends_it_cleanly(
    tmp_path: Path, how: str
) -> None:
    """A collective left posted (a failed step's agreement) completes, with an error, when
    its peer exits a moment after this program began to exit: its callback runs on gloo's
    thread. The exit waits for it (``EXIT_DRAIN_S``), so the process exits 0, never by
    SIGABRT ("terminate called without an active exception": the thread asked a finalizing
    interpreter for the GIL). ``awaited``: bridged by ``work_future``, its wait timed out;
    red without the drain, and with a drain that ends when the callback returns rather than
    when the future lets go of it (each aborted in the first of the 5 runs, 2026-12-07).
    ``posted``: awaited by no one, counted by ``track``; red without it by the count (the
    exit did not wait for it; the abort itself then depends on the peer's timing: the HANG
    runs of the fault campaign, seed 2000005, aborted in 1 of 2). ``unsettled``: posted,
    and the exit goes on at once after the callback (no settle) with the exiting thread
    keeping the GIL: gloo's thread frees the ``Work`` (and its tensors' Python objects)
    while Python finalizes unless ``track`` keeps it; red without the keeping (3 of 10 runs
    aborted, 2026-12-07; the fault campaign's seed 9000496, a ``HANG`` run under load, the
    same in its core: ``~AsyncAllgatherWork`` on gloo's ``runLoop`` asking for the GIL)."""
    import subprocess
    import sys

    from rrfp_async.testing._ports import free_port

    codes = []
    runs = 10 if how == "unsettled" else 5
    for run in range(runs):
        d = tmp_path / str(run)
        d.mkdir()
        port = str(free_port())
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _EXIT_JOB, str(r), port, str(d), how],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            for r in (0, 1)
        ]
        errs = [p.communicate(timeout=60)[1].decode() for p in procs]
        codes.append((procs[0].returncode, procs[1].returncode))
        assert (d / "in_flight").read_text() == "(1, 0)"  # the all-reduce: pending at exit
        assert procs[1].returncode == 0, errs[1][-2000:]
    assert codes == [(0, 0)] * runs


def test_a_tracked_work_is_let_go_only_after_it_was_seen_complete() -> None:
    """``_in_flight.KEPT``: a work is kept while it runs and until a later look has seen it
    complete twice (gloo's thread then let go of it long before), so at exit gloo's thread
    never frees the last reference; what is kept at exit is kept for good."""
    from rrfp_async._in_flight import _Kept

    class Work:
        def __init__(self) -> None:
            self.done = False

        def is_completed(self) -> bool:
            return self.done

    kept = _Kept()
    a, b, c = Work(), Work(), Work()
    kept.add(a)
    kept.add(b)
    assert kept.kept() == 2
    a.done = True
    kept.add(c)  # a: seen complete once, still kept
    assert kept.kept() == 3
    kept.add(Work())  # a: seen the time before: let go
    assert kept.kept() == 3
    b.done = c.done = True
    kept.add(Work())
    kept.add(Work())
    assert kept.kept() == 3  # b and c let go; the three running ones kept
