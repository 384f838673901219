"""The TP decision channel: all TP ranks of a stage run the same task sequence.

Design note
-----------
Collectives inside a task (the TP all-reduces of a row-parallel linear) only match if every
TP rank of the stage runs the same task at the same position of its sequence. With
readiness-first dispatch each rank would decide on its own, from its own (slightly
different) view of what has arrived. So one rank, the *leader*, runs the policy; each
decision, ``(step, seq, task)``, is broadcast over a small gloo group of the stage's TP
ranks; *followers* run exactly that sequence, each task once it is ready locally.

* The group is dedicated to decisions: model collectives on another group can never
  interleave with them, so the order of broadcasts is the same on every rank.
* The leader never waits for its broadcast: it enqueues it (``async_op=True``) and
  computes. Followers keep up to ``depth`` broadcasts posted ahead, so a decision is usually
  there before the follower finishes its previous task: coordination stays off the
  critical path but for one small broadcast.
* A follower validates every decision: a wrong step or a sequence gap raises
  ``DivergenceError``; so does a task the follower does not know or already ran (checked by
  the stage loop).
* At the end of a step every TP rank can cross-check a digest of the sequence it executed
  (``verify_sequence``): with coordination switched off, that is how a divergence is caught.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import hashlib
import struct
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .._bridges import work_future
from .._errors import DivergenceError
from .._tasks import Kind, Task

__all__ = ["DecisionChannel", "sequence_digest"]

_KINDS: tuple[Kind, ...] = ("F", "B", "I", "W")
_CODE = {k: i for i, k in enumerate(_KINDS)}
_MAGIC = 0x44454349  # "DECI"
_ROW = struct.Struct("=6q")  # [magic, step, seq, stage, kind, mb]


def sequence_digest(tasks: Sequence[Task]) -> int:
    """A 63-bit digest of a task sequence (equal sequences, equal digests)."""
    h = hashlib.blake2b(" ".join(map(str, tasks)).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


class DecisionChannel:
    """The decision channel of one stage's TP ranks.

    Args:
        group: A process group of exactly the stage's TP ranks, used for nothing else.
        leader: The global rank of the TP leader (the rank whose policy decides).
        rank: This process's global rank.
        tp_rank: This process's rank inside the TP group (for messages).
        stage: The pipeline rank of the stage (for messages).
        depth: Broadcasts a follower keeps posted ahead.

    Attributes:
        waiting: What this rank waits for on the decision group right now (text, for the
            error of a step that timed out), or None.
    """

    def __init__(
        self,
        group: Any,
        *,
        leader: int,
        rank: int,
        tp_rank: int,
        stage: int,
        depth: int = 4,
    ) -> None:
        self.group = group
        self.leader = leader
        self.rank = rank
        self.tp_rank = tp_rank
        self.stage = stage
        self.is_leader = rank == leader
        self.depth = max(1, depth)
        self._posted: collections.deque[tuple[torch.Tensor, asyncio.Future[None]]] = (
            collections.deque()
        )
        self._sent: collections.deque[tuple[torch.Tensor, Any]] = collections.deque()
        self._to_post = 0
        self.published = 0
        self.waiting: str | None = None
        # The group's own broadcast (no torch.distributed wrapper: tens of µs per decision).
        self._root = dist.get_group_rank(group, leader)

    def _who(self) -> str:
        role = "leader" if self.is_leader else "follower"
        return f"rank {self.rank} (TP {role} {self.tp_rank} of stage {self.stage})"

    # ------------------------------------------------------------------ per step

    def begin_step(self, step: int, decisions: int) -> None:
        """A step with ``decisions`` dispatches starts: followers post their receives."""
        self._to_post = decisions
        if not self.is_leader:
            self._post_ahead()

    def _post_ahead(self) -> None:
        while self._to_post > 0 and len(self._posted) < self.depth:
            buf = torch.empty(6, dtype=torch.int64)
            work = self.group.broadcast(buf, self._root)
            self._posted.append((buf, work_future(work)))
            self._to_post -= 1

    def publish(self, step: int, seq: int, task: Task) -> None:
        """Leader: broadcast decision ``seq`` of ``step`` without waiting for it."""
        buf = torch.empty(6, dtype=torch.int64)
        row = _ROW.pack(_MAGIC, step, seq, task.stage, _CODE[task.kind], task.mb)
        ctypes.memmove(buf.data_ptr(), row, _ROW.size)
        work = self.group.broadcast(buf, self._root)
        self._sent.append((buf, work))
        self.published += 1
        # Reap completed broadcasts (collectives' is_completed works) and surface errors.
        while self._sent and self._sent[0][1].is_completed():
            _, w = self._sent.popleft()
            w.wait()

    async def receive(self, step: int, seq: int) -> Task:
        """Follower: the leader's decision ``seq`` of ``step``.

        Raises:
            DivergenceError: The decision is for another step or has a sequence gap.
        """
        if not self._posted:
            self._post_ahead()
        if not self._posted:
            raise DivergenceError(
                f"{self._who()} step {step}: asked for decision {seq} beyond the step's decisions"
            )
        buf, fut = self._posted.popleft()
        self.waiting = f"the TP leader (global rank {self.leader})'s decision {seq} of step {step}"
        try:
            await fut
        finally:
            self.waiting = None
        self._post_ahead()
        row = _ROW.unpack(ctypes.string_at(buf.data_ptr(), _ROW.size))
        magic, s, q, stage, kind, mb = row
        if magic != _MAGIC or not 0 <= kind < len(_KINDS):
            raise DivergenceError(f"{self._who()} step {step}: corrupt decision {list(row)}")
        if s != step or q != seq:
            raise DivergenceError(
                f"{self._who()}: received decision seq {q} of step {s} but expected seq {seq}"
                f" of step {step}: the TP ranks' sequences diverged"
            )
        return Task(stage, _KINDS[kind], mb)

    async def end_step(self) -> None:
        """Leader: wait until every broadcast of the step went out (errors surface here)."""
        self.waiting = "the TP followers to receive this step's decisions"
        try:
            while self._sent:
                _, w = self._sent.popleft()
                await work_future(w)
        finally:
            self.waiting = None

    async def verify_sequence(self, step: int, executed: Sequence[Task]) -> None:
        """Every TP rank: all-gather a digest of the executed sequence and compare.

        Raises:
            DivergenceError: Some TP rank executed a different sequence in ``step``.
        """
        mine = torch.tensor([sequence_digest(executed), len(executed)], dtype=torch.int64)
        size = dist.get_world_size(self.group)
        outs = [torch.zeros(2, dtype=torch.int64) for _ in range(size)]
        self.waiting = f"the other TP ranks of stage {self.stage} to cross-check step {step}"
        try:
            await work_future(dist.all_gather(outs, mine, group=self.group, async_op=True))
        finally:
            self.waiting = None
        digests = [tuple(o.tolist()) for o in outs]
        if len(set(digests)) != 1:
            differ = [i for i, d in enumerate(digests) if d != digests[0]]
            raise DivergenceError(
                f"{self._who()} step {step}: the TP ranks of stage {self.stage} executed"
                f" different task sequences (TP ranks {differ} differ from TP rank 0); their"
                " collectives did not match, the step's result is invalid"
            )
