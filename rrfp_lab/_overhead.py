"""Overheads of the runtime in isolation, each against its raw baseline (``bench overhead``).

Five sections, one module each, each a function returning rows (plain dicts; nothing is
printed here); this module gathers them for the command:

* :func:`decision_latency` (``_overhead_decision``) -- the policy call plus the stage's
  bookkeeping per dispatch, no compute: a real ``StageLoop`` (one rank, in-process channel)
  whose executor returns at once, on a hint whose admitted ready set holds ``k`` tasks at
  every decision; per decision = step wall time / tasks run. uvloop and asyncio, several
  policies.
* :func:`message_cost` (``_overhead_message``) -- one message through
  ``channels.P2PChannel`` (header + payload, sender / listener threads, delivery to a sink
  on the loop) against a raw blocking gloo ``send``/``recv`` of the same tensor: ping-pong
  between 2 processes, one-way = round trip / 2.
* :func:`tp_coordination` (``_overhead_tp``) -- one TP decision through
  ``channels.DecisionChannel`` (leader publishes, followers receive) against a raw blocking
  ``dist.broadcast`` of the same ``int64[6]`` on the same group, TP = 1, 2, 4 and 8
  processes; plus the coordination per step inside real ``DistributedStage``s (no
  coordination, decisions only, the all-gather check, the default folded check, side by
  side), its share of step time for tasks of 1, 5 and 20 ms, and :func:`tp_model`, the
  cost as a function of TP degree fitted to those figures.
* :func:`split_backward_cost` (``_overhead_split``) -- ``I`` + ``W`` against ``B`` on a
  middle stage of the example model through ``TorchStageExecutor`` tasks: real CPU compute,
  no emulated time.
* :func:`task_overhead` (``_overhead_task``) -- the host's time per task and the thread
  hand-offs per task of a one-stage ``DistributedStage`` against torch ``Schedule1F1B`` on
  the same module (idle per task = (step - compute alone) / tasks).

Timing design (the statistics live in ``_overhead_common``): every figure is a median
over batches (a batch times many back-to-back operations, so timer and scheduling noise is
amortised); a raw baseline runs in batches interleaved with the variant it is compared to,
so a noisy neighbour moves both. Each multi-process part is one ``spawn`` job (gloo on
127.0.0.1, one torch thread per process) with its own timeout, whose worker is a top-level
function of its section's module.
"""

from __future__ import annotations

from ._overhead_decision import DECISION_TARGET_US, decision_latency, decision_schedule
from ._overhead_message import MESSAGE_TARGET_RATIO, message_cost
from ._overhead_split import (
    SPLIT_TARGET_RATIO,
    split_backward_cost,
    split_backward_cost_isolated,
)
from ._overhead_task import task_overhead, task_overhead_isolated
from ._overhead_tp import (
    TP_MODEL_TOLERANCE,
    TP_SHARE_TARGET,
    TP_STEP_SHARE_TARGET,
    TP_TARGET_RATIO,
    tp_coordination,
    tp_model,
)

__all__ = [
    "DECISION_TARGET_US",
    "MESSAGE_TARGET_RATIO",
    "SPLIT_TARGET_RATIO",
    "TP_MODEL_TOLERANCE",
    "TP_SHARE_TARGET",
    "TP_STEP_SHARE_TARGET",
    "TP_TARGET_RATIO",
    "decision_latency",
    "decision_schedule",
    "message_cost",
    "split_backward_cost",
    "split_backward_cost_isolated",
    "task_overhead",
    "task_overhead_isolated",
    "tp_coordination",
    "tp_model",
]
