"""The TP decision channel: all TP ranks of a stage run the same task sequence.

Design note
-----------
Collectives inside a task (the TP all-reduces of a row-parallel linear) only match if every
TP rank of the stage runs the same task at the same position of its sequence. With
readiness-first dispatch each rank would decide on its own, from its own (slightly
different) view of what has arrived. So one rank, the *leader*, runs the policy; each
decision, ``(step, seq, task)``, goes to the stage's other TP ranks over a small gloo group;
*followers* run exactly that sequence, each task once it is ready locally.

* **Point-to-point, no collective per decision.** The leader ``send``s each decision (an
  ``int64[6]`` row) to every follower from the loop thread, through the group's own
  ``send``: a write to a socket. A gloo *broadcast* instead goes through the process group's
  worker thread, and waking that thread costs the caller several times the write per
  decision where cores are few (little when the thread is busy already: the woken thread
  runs on the caller's core first; BENCHMARKS.md#channel-costs); the follower paid the same
  to post each receive. Each follower has one *listener thread* that keeps a receive posted
  and hands every decision to the loop (``call_soon_threadsafe``); the follower's loop posts
  nothing. One FIFO per leader -> follower pair: decisions arrive in order.
* The group is dedicated to decisions (p2p on tag 0, plus the end-of-step digest
  all-gather): model collectives on another group never interleave with them.
* The leader never waits for a send; its works are waited at ``end_step`` (on a helper
  thread), where a failed send surfaces.
* A follower validates every decision: a wrong step or a sequence gap raises
  ``DivergenceError``; so does a task the follower does not know or already ran (checked by
  the stage loop). Decisions of an earlier (failed) step, queued or arriving late, are
  dropped by the next step's ``receive``.
* At the end of a step every TP rank can cross-check a digest of the sequence it executed
  (``verify_sequence``): with coordination switched off, that is how a divergence is caught.
  It is an all-gather over the group, by default; with ``fold_check`` (what
  ``DistributedStage`` uses when it coordinates and agrees on every step) it rides on the
  decisions instead: see "The folded sequence check" below.
* ``close()``: the leader sends a CLOSE row down every pair, so the followers' listeners
  end; a lost leader (broken connection) fails the follower's next ``receive`` with
  ``PeerError``.

The folded sequence check
-------------------------
Measured at TP 1-8 (``bench overhead --section tp``,
BENCHMARKS.md#tp-coordination-the-curve), the all-gather of the
end-of-step check was most of the per-step cost of coordination: a collective whose
completion reaches the loop through gloo's worker thread, after the step's last task, on
every TP rank. With coordination on, the leader already tells each follower every decision
in order, so the check can ride on that one-way stream: right after the step's *last*
decision, the leader sends one more row, ``[DIGS, step, count, digest]``, the digest of the
sequence it published (``sequence_digest``), without waiting. It reaches the follower
before the follower's last task ends, so the follower's check (its own executed sequence
against the leader's row) costs no wait; the leader checks locally that it executed what it
published. A divergence is still caught in the step where it happens, now on the rank
where it happened (``DivergenceError``), and the step fails on every rank through the
end-of-step agreement (``DistributedStage(agree_steps=True)``, which is why the stage folds
only when it agrees steps). No collective means nothing to keep matched across a failed
step: ``post_failed_sequence`` posts nothing; a failed leader's ABORT row (after the digest,
or instead of it) and a failed follower's agreement tell the others, as for decisions.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import hashlib
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .._bridges import post, run_blocking, track, work_future
from .._errors import ClosedError, DivergenceError, PeerError, PeerStepError
from .._resources import start_thread
from .._tasks import Kind, Task
from ._wire import CONNECTION_BROKE, read_ints, write_ints

__all__ = ["DecisionChannel", "sequence_digest"]

_KINDS: tuple[Kind, ...] = ("F", "B", "I", "W")
_CODE = {k: i for i, k in enumerate(_KINDS)}
_MAGIC = 0x44454349  # "DECI"
_MAGIC_CLOSE = 0x434C4F53  # "CLOS": the leader closed
_MAGIC_ABORT = 0x41424F52  # "ABOR": [magic, step, origin global rank, 0, 0, 0]: step failed
_MAGIC_DIGEST = 0x44494753  # "DIGS": [magic, step, count, digest, 0, 0]: the folded check
_FAILED_COUNT = -1  # a sequence check row [global rank, -1]: the step failed on that rank
_ROW = struct.Struct("=6q")  # [magic, step, seq, stage, kind, mb]


def _wait_all(works: list[Any]) -> None:
    for w in works:
        w.wait()


def sequence_digest(tasks: Sequence[Task]) -> int:
    """A 63-bit digest of a task sequence (equal sequences, equal digests)."""
    h = hashlib.blake2b(" ".join(map(str, tasks)).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


class DecisionChannel:
    """The decision channel of one stage's TP ranks.

    Args:
        group: A gloo process group of exactly the stage's TP ranks, used for nothing else.
        leader: The global rank of the TP leader (the rank whose policy decides).
        rank: This process's global rank.
        tp_rank: This process's rank inside the TP group (for messages).
        stage: The pipeline rank of the stage (for messages).
        fold_check: Fold the end-of-step sequence check into the decisions (see "The
            folded sequence check"): only for steps that are coordinated (``begin_step``,
            ``publish`` / ``receive``), and only where a failed step reaches every rank
            otherwise (``DistributedStage``'s end-of-step agreement). Every TP rank must
            use the same value.

    Attributes:
        waiting: What this rank waits for on the decision group right now (text, for the
            error of a step that timed out), or None.

    Only one channel per group may be in use at a time (a follower's listener takes every
    decision sent on the group): ``close()`` one on every rank before using another.
    """

    def __init__(
        self,
        group: Any,
        *,
        leader: int,
        rank: int,
        tp_rank: int,
        stage: int,
        fold_check: bool = False,
    ) -> None:
        self.group = group
        self.fold_check = fold_check
        self.leader = leader
        self.rank = rank
        self.tp_rank = tp_rank
        self.stage = stage
        self.is_leader = rank == leader
        self.published = 0
        self.waiting: str | None = None
        self._root = dist.get_group_rank(group, leader)
        self._followers = [r for r in range(dist.get_world_size(group)) if r != self._root]
        self._sent: list[Any] = []  # the leader's send works of the current step
        self._rows: collections.deque[tuple[int, ...]] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._failed: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listener: threading.Thread | None = None
        self._closed = False
        self._used = False  # a step began: the followers listen (the leader sends CLOSE)
        self._failed_checks: list[tuple[list[torch.Tensor], Any]] = []
        # The folded check: the step begun, its decision count, the leader's running
        # digest of what it published (text as ``sequence_digest`` hashes it).
        self._step = -1
        self._count = 0
        self._hash: Any = None
        self._published: tuple[int, int] | None = None  # (digest, count) sent with the last

    def _who(self) -> str:
        role = "leader" if self.is_leader else "follower"
        return f"rank {self.rank} (TP {role} {self.tp_rank} of stage {self.stage})"

    # ------------------------------------------------------------------ per step

    def begin_step(self, step: int, decisions: int) -> None:
        """A step with ``decisions`` dispatches starts: a follower's listener starts (first
        step). Decisions of earlier steps still queued are dropped by ``receive``."""
        self._used = True
        self._step, self._count = step, decisions
        if self.is_leader:
            self._hash = hashlib.blake2b(digest_size=8)
            self._published = None
            return
        if self._listener is None:
            self._loop = asyncio.get_running_loop()
            self._listener = threading.Thread(
                target=self._listen, name=f"rrfp-decisions-listen-{self.rank}", daemon=True
            )
            start_thread(self._listener, self._who(), "the TP decision listener")

    def publish(self, step: int, seq: int, task: Task) -> None:
        """Leader: send decision ``seq`` of ``step`` to every follower, without waiting."""
        buf = torch.empty(6, dtype=torch.int64)
        write_ints(_ROW, buf, (_MAGIC, step, seq, task.stage, _CODE[task.kind], task.mb))
        send = self.group.send
        for f in self._followers:
            try:
                self._sent.append(send([buf], f, 0))
            except Exception as e:
                raise PeerError(
                    f"{self._who()} step {step}: sending decision {seq} ({task}) to TP rank {f}"
                    f" failed ({CONNECTION_BROKE}): {e}"
                ) from e
        self.published += 1
        if self.fold_check and step == self._step:
            self._hash.update(f" {task}".encode() if seq else str(task).encode())
            if seq == self._count - 1:  # the last decision: the folded check goes with it
                self._send_digest(step, seq + 1)

    def _send_digest(self, step: int, count: int) -> None:
        digest = int.from_bytes(self._hash.digest(), "little") & ((1 << 63) - 1)
        self._published = (digest, count)
        buf = torch.empty(6, dtype=torch.int64)
        write_ints(_ROW, buf, (_MAGIC_DIGEST, step, count, digest, 0, 0))
        for f in self._followers:
            try:
                self._sent.append(self.group.send([buf], f, 0))
            except Exception as e:
                raise PeerError(
                    f"{self._who()} step {step}: sending the end-of-step digest to TP rank {f}"
                    f" failed ({CONNECTION_BROKE}): {e}"
                ) from e

    def abort(self, step: int, origin: int) -> None:
        """Leader: tell every follower that ``step`` failed (on global rank ``origin``), so
        that a follower waiting for this step's next decision fails it at once instead of
        waiting for its watchdog. Best effort: a follower that is gone is skipped."""
        if not self.is_leader or self._closed:
            return
        buf = torch.empty(6, dtype=torch.int64)
        write_ints(_ROW, buf, (_MAGIC_ABORT, step, origin, 0, 0, 0))
        for f in self._followers:
            with contextlib.suppress(Exception):
                self._sent.append(self.group.send([buf], f, 0))
        self._used = True

    # ------------------------------------------------------------------ follower side

    def _listen(self) -> None:
        """Follower thread: receive rows from the leader until CLOSE or a broken pair."""
        recv = self.group.recv
        buf = torch.empty(6, dtype=torch.int64)
        while True:
            try:
                recv([buf], self._root, 0).wait()
            except Exception as e:
                if not self._closed:
                    self._post(
                        self._fail,
                        PeerError(
                            f"{self._who()} lost the TP leader (global rank {self.leader}):"
                            f" the connection broke while waiting for a decision: {e}"
                        ),
                    )
                return
            row = read_ints(_ROW, buf)
            if row[0] == _MAGIC_CLOSE:
                self._post(self._fail, ClosedError(f"{self._who()}: the TP leader closed"))
                return
            self._post(self._arrived, row)

    def _post(self, fn: Any, *args: Any) -> None:
        post(self._loop, fn, *args)

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _arrived(self, row: tuple[int, ...]) -> None:
        self._rows.append(row)
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        if self._failed is None:
            self._failed = exc
        self._wake()

    def has_decision(self, step: int) -> bool:
        """Follower: whether ``receive`` for ``step`` would return (or raise) without
        waiting: a row of ``step`` (or later) from the leader is queued, or the channel
        failed. The stage loop reports a stall ("waits for the TP leader's decision") only
        when this is false."""
        rows = self._rows
        return (bool(rows) and rows[-1][1] >= step) or self._failed is not None

    async def receive(self, step: int, seq: int) -> Task:
        """Follower: the leader's decision ``seq`` of ``step``.

        Raises:
            DivergenceError: The decision is for another step or has a sequence gap.
            PeerError: The connection to the leader broke.
            ClosedError: The leader closed its channel before sending this decision.
        """
        if self._listener is None:
            raise DivergenceError(f"{self._who()} step {step}: receive before begin_step")
        row = await self._next_row(step, f"decision {seq} of step {step}")
        magic, s, q, stage, kind, mb = row
        if magic == _MAGIC_DIGEST and s == step:
            raise DivergenceError(
                f"{self._who()} step {step}: expected decision seq {seq}, but the TP leader"
                f" ended the step after {q} decisions: the TP ranks' sequences diverged"
            )
        if magic != _MAGIC or not 0 <= kind < len(_KINDS):
            raise DivergenceError(f"{self._who()} step {step}: corrupt decision {list(row)}")
        if s != step or q != seq:
            raise DivergenceError(
                f"{self._who()}: received decision seq {q} of step {s} but expected seq {seq}"
                f" of step {step}: the TP ranks' sequences diverged"
            )
        return Task(stage, _KINDS[kind], mb)

    async def _next_row(self, step: int, what: str) -> tuple[int, ...]:
        """Follower: the leader's next row for ``step`` (rows of earlier steps dropped).

        Raises:
            PeerStepError: The row is the step's ABORT.
            PeerError, ClosedError: The leader is lost or closed.
        """
        rows = self._rows
        while True:
            while rows and rows[0][1] < step:  # a late row of an earlier, failed step
                rows.popleft()
            if rows:
                break
            if self._failed is not None:
                raise self._failed
            self.waiting = f"the TP leader (global rank {self.leader})'s {what}"
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
                self.waiting = None
        row = rows.popleft()
        if row[0] == _MAGIC_ABORT and row[1] == step:
            q = row[2]
            cause = "it failed on the stage's TP leader or was told so (see that rank's output)"
            raise PeerStepError(
                f"{self._who()}: step {step} failed on global rank {q}: {cause}; this rank"
                " fails the step too and runs the next one",
                step=step,
                origin=q,
                cause=cause,
            )
        return row

    async def end_step(self) -> None:
        """Leader: wait until every decision of the step went out (a failed send surfaces
        in this call)."""
        sent, self._sent = self._sent, []
        if not sent:
            return
        self.waiting = "the TP followers to receive this step's decisions"
        try:
            await run_blocking(_wait_all, sent, name="rrfp-decisions-sent")
        except Exception as e:
            raise PeerError(
                f"{self._who()}: sending this step's decisions to the TP followers failed: {e}"
            ) from e
        finally:
            self.waiting = None

    def close(self, timeout: float = 5.0) -> None:
        """Leader: send CLOSE to every follower. Follower: wait (up to ``timeout`` s) until the
        listener has received it and ended. Blocking: call it from a helper thread. One
        channel per decision group may listen at a time; close it before another one
        starts on the same group."""
        if self._closed:
            return
        self._closed = True
        if not self.is_leader:
            if self._listener is not None:  # ends with the leader's CLOSE
                self._listener.join(timeout)
            return
        if not self._used:  # no step began: no follower listens
            return
        buf = torch.tensor([_MAGIC_CLOSE, 0, 0, 0, 0, 0], dtype=torch.int64)
        with contextlib.suppress(Exception):  # followers may be gone already
            works = [self.group.send([buf], f, 0) for f in self._followers]
            deadline = time.monotonic() + timeout
            for w in works:
                w.wait(datetime.timedelta(seconds=max(0.0, deadline - time.monotonic())))

    def post_failed_sequence(self, step: int, origin: int | None = None) -> None:
        """Every TP rank whose ``step`` failed before its sequence check: post the check's
        all-gather anyway, without waiting, with the row ``[origin, -1]`` (no sequence has
        length -1; ``origin``: the global rank where the step failed first, default this
        one): the check's collectives stay matched across the TP ranks, and a rank whose
        step went on fails it there with ``PeerStepError`` naming the origin."""
        if self.fold_check:  # no collective to keep matched (see the folded check)
            return
        who = self.rank if origin is None else origin
        mine = torch.tensor([who, _FAILED_COUNT], dtype=torch.int64)
        size = dist.get_world_size(self.group)
        outs = [torch.zeros(2, dtype=torch.int64) for _ in range(size)]
        with contextlib.suppress(Exception):  # a broken group: the job is failing anyway
            work = dist.all_gather(outs, mine, group=self.group, async_op=True)
            track(work)  # (awaited by no one: the program's exit waits for it)
            self._failed_checks.append((outs, work))
        del self._failed_checks[:-4]  # keep the last few alive until they complete

    async def verify_sequence(self, step: int, executed: Sequence[Task]) -> None:
        """Every TP rank: all-gather a digest of the executed sequence and compare.

        With ``fold_check``: the folded check instead (see "The folded sequence check").

        Raises:
            DivergenceError: Some TP rank executed a different sequence in ``step`` (folded:
                this rank's sequence differs from the leader's).
            PeerStepError: The step failed on another TP rank (folded: on the leader).
        """
        if self.fold_check:
            await self._verify_folded(step, executed)
            return
        mine = torch.tensor([sequence_digest(executed), len(executed)], dtype=torch.int64)
        size = dist.get_world_size(self.group)
        outs = [torch.zeros(2, dtype=torch.int64) for _ in range(size)]
        self.waiting = f"the other TP ranks of stage {self.stage} to cross-check step {step}"
        try:
            await work_future(dist.all_gather(outs, mine, group=self.group, async_op=True))
        finally:
            self.waiting = None
        digests = [tuple(o.tolist()) for o in outs]
        failed = [d[0] for d in digests if d[1] == _FAILED_COUNT]
        if failed:
            cause = "its step failed on that TP rank of the stage (see that rank's output)"
            raise PeerStepError(
                f"{self._who()}: step {step} failed on global rank {failed[0]}: {cause}; this"
                " rank fails the step too and runs the next one",
                step=step,
                origin=failed[0],
                cause=cause,
            )
        if len(set(digests)) != 1:
            differ = [i for i, d in enumerate(digests) if d != digests[0]]
            raise DivergenceError(
                f"{self._who()} step {step}: the TP ranks of stage {self.stage} executed"
                f" different task sequences (TP ranks {differ} differ from TP rank 0); their"
                " collectives did not match, the step's result is invalid"
            )

    async def _verify_folded(self, step: int, executed: Sequence[Task]) -> None:
        mine = (sequence_digest(executed), len(executed))
        if self._step != step:
            raise DivergenceError(
                f"{self._who()} step {step}: the folded sequence check needs a coordinated"
                " step (begin_step, publish / receive); this one was not"
            )
        if self.is_leader:
            if self._published != mine:
                sent = "nothing" if self._published is None else f"{self._published[1]} tasks"
                raise DivergenceError(
                    f"{self._who()} step {step}: the leader executed {len(executed)} tasks"
                    f" other than the {sent} it published: the TP ranks' collectives did"
                    " not match, the step's result is invalid"
                )
            return
        row = await self._next_row(step, f"end-of-step digest of step {step}")
        magic, s, count, digest = row[:4]
        if magic == _MAGIC and s == step:
            raise DivergenceError(
                f"{self._who()} step {step}: this rank ran {len(executed)} tasks, but the TP"
                f" leader sent decision {count} after them: the TP ranks' sequences diverged"
            )
        if magic != _MAGIC_DIGEST or s != step:
            raise DivergenceError(f"{self._who()} step {step}: corrupt digest row {list(row)}")
        if (digest, count) != mine:
            raise DivergenceError(
                f"{self._who()} step {step}: the TP ranks of stage {self.stage} executed"
                f" different task sequences (this rank {len(executed)} tasks, the leader"
                f" {count}; digests differ); their collectives did not match, the step's"
                " result is invalid"
            )
