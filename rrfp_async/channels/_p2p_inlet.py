"""The p2p channel's loop side: where what its threads learned reaches the stage.

Everything in this module runs on the loop thread (the channel's threads hand their calls
over through a ``LoopPort``): a message for the sink, the error the channel broke with, the
count of the messages of each recent step. A message that arrives before the stage ``bind``s
its sink waits in the ``Inlet`` and is replayed, in order, when it does.

Design note: the plan tag
-------------------------
The stage tells the channel the tag of each step's plan when it starts the step
(``P2PChannel.at_step``); every data header carries the sender's tag of its step. A rank
whose plan differs from a neighbour's (another microbatch count, hint, ``train=``) could wait
for a message that never comes; here the first message of a step whose tag differs from
this rank's fails that step at once (``AbortSink.step_aborted`` with a ``StepDiffersError``
naming both tags), and its messages are not handed on (they may feed tasks this rank's plan
does not have). A message of a step this rank has not started is compared when it starts
it. Tag 0 on either side: nothing is compared. The stage names every rank's side later (its
end-of-step agreement); this only makes the failure immediate.
"""

from __future__ import annotations

from typing import Any

from .._errors import StepDiffersError
from .._tasks import Task
from ._base import AbortSink, Sink

__all__ = ["Inlet"]

_KEPT_STEPS = 3
"""Arrivals are kept for the steps within this many of the latest one."""


class Inlet:
    """The loop side of a ``P2PChannel``: owns the sink, the messages that came before it
    was bound, the arrivals per step and the error the channel broke with (the first)."""

    def __init__(self, who: str = "this rank") -> None:
        self.sink: Sink | None = None
        self.failed: BaseException | None = None
        self._who = who
        self._pending: list[tuple[int, Task, Any, int]] = []
        self._arrivals: dict[int, dict[int, int]] = {}  # step -> {src: messages}
        self._step = -1  # the latest step ``at_step`` started
        self._plans: dict[int, int] = {}  # step -> this rank's plan tag (recent steps)
        self._early: dict[int, dict[int, int]] = {}  # steps not started -> {src: tag}
        self._differ: set[int] = set()  # steps whose tags differ (recent)

    # ------------------------------------------------------------------ the plan tag

    def at_step(self, step: int, plan: int) -> None:
        """This rank starts ``step`` under the plan tag ``plan`` (0: none; see the design
        note): messages of it that came earlier are compared now."""
        self._step = max(self._step, step)
        self._plans[step] = plan
        for old in [s for s in self._plans if s < step - _KEPT_STEPS]:
            del self._plans[old]
        self._differ = {s for s in self._differ if s >= step - _KEPT_STEPS}
        early = self._early.pop(step, {})
        for old in [s for s in self._early if s < step]:
            del self._early[old]
        if plan:
            for src, theirs in early.items():
                if theirs != plan:
                    self._plans_differ(step, src, theirs, plan)
                    break

    def plan_of(self, step: int) -> int:
        """This rank's plan tag of ``step`` (0: not started or none); any thread."""
        return self._plans.get(step, 0)

    def plan_seen(self, step: int, src: int, plan: int) -> bool:
        """A message of ``step`` from ``src`` carries the tag ``plan``: compare it with this
        rank's (see the design note). False when the step's tags differ (its messages are
        dropped)."""
        if step in self._differ:
            return False
        if not plan:
            return True
        mine = self._plans.get(step)
        if mine is None:
            if step > self._step:
                self._early.setdefault(step, {}).setdefault(src, plan)
            return True
        if mine and plan != mine:
            self._plans_differ(step, src, plan, mine)
            return False
        return True

    def _plans_differ(self, step: int, src: int, theirs: int, mine: int) -> None:
        self._differ.add(step)
        sink = self.sink
        if sink is not None and isinstance(sink, AbortSink):
            sink.step_aborted(
                step,
                StepDiffersError(
                    f"{self._who} step {step}: the ranks do not run the same step: pipeline"
                    f" rank {src} sent a message of plan #{theirs & 0xFFFFFFFF:08x}, this rank"
                    f" runs plan #{mine & 0xFFFFFFFF:08x}"
                ),
            )

    def bind(self, sink: Sink) -> None:
        """Route messages to ``sink``; those that came earlier are replayed now."""
        self.sink = sink
        pending, self._pending = self._pending, []
        for step, task, payload, src in pending:
            self._hand(sink, step, task, payload, src)

    def deliver(self, step: int, task: Task, payload: Any, src: int, plan: int = 0) -> None:
        """A message from ``src``, the input of ``task`` of ``step``, sent under the plan tag
        ``plan``: count it, hand it to the sink (or keep it until one is bound), unless the
        step's tags differ."""
        if not self.plan_seen(step, src, plan):
            return
        got = self._arrivals.get(step)
        if got is None:
            got = self._arrivals[step] = {}
            for old in [s for s in self._arrivals if s < step - _KEPT_STEPS]:
                del self._arrivals[old]
        got[src] = got.get(src, 0) + 1
        sink = self.sink
        if sink is None:
            self._pending.append((step, task, payload, src))
            return
        self._hand(sink, step, task, payload, src)

    @staticmethod
    def _hand(sink: Sink, step: int, task: Task, payload: Any, src: int) -> None:
        try:
            sink.deliver(step, task, payload, src)
        except Exception as e:  # raised inside a loop callback: route it to the stage
            sink.fail(e)

    def fail(self, exc: BaseException) -> None:
        """The channel broke with ``exc`` (the first error is kept): the stage fails."""
        if self.failed is None:
            self.failed = exc
        if self.sink is not None:
            self.sink.fail(exc)

    def arrivals(self, step: int) -> dict[int, int]:
        """Messages received for ``step``, per source pipeline rank (recent steps only)."""
        return dict(self._arrivals.get(step, {}))
