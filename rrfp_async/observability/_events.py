"""Names of the step-traced log events (one per state transition of a stage).

Besides the fields listed with each name, every event ``LogObserver`` writes carries
``rank`` (global), ``stage`` (pipeline rank), ``step`` and ``clock`` (the stage's loop clock
in seconds, virtual under the simulator), all of the stage the transition happened on.
"""

from __future__ import annotations

__all__ = [
    "DECISION",
    "MESSAGE",
    "STAGE_DUMP",
    "STALL",
    "STEP_END",
    "STEP_FAILED",
    "STEP_START",
    "TASK_END",
    "TASK_READY",
    "TASK_START",
    "TP_DECISION_RECEIVED",
    "TP_DECISION_SENT",
]

STEP_START = "step_start"
"""A stage started a step. Fields: hint, policy, tasks, max_inflight."""
STEP_END = "step_end"
"""A stage finished a step. Fields: elapsed, busy, idle, peak_inflight, deviations."""
STEP_FAILED = "step_failed"
"""A stage's step raised. Fields: error."""
MESSAGE = "message_arrived"
"""An input arrived. Fields: task (the consumer), src (rank)."""
TASK_READY = "task_ready"
"""A task's inputs are all present. Fields: task."""
DECISION = "decision"
"""A task was chosen. Fields: task, hinted (what the hint wanted), ready (with hint ranks),
policy, idle (seconds the stage had been idle), deviation (bool)."""
TP_DECISION_SENT = "tp_decision_sent"
"""The TP leader broadcast a decision. Fields: task, seq."""
TP_DECISION_RECEIVED = "tp_decision_received"
"""A TP follower received a decision. Fields: task, seq."""
TASK_START = "task_start"
"""A task started. Fields: task."""
TASK_END = "task_end"
"""A task finished. Fields: task, duration."""
STALL = "stall"
"""The stage is idle and waits. Fields: reason (which message from which rank, the admission
bound, the TP leader)."""
STAGE_DUMP = "stage_dump"
"""A failed or hung step's state. Fields: error, dump (ready set, waits, in-flight, recent
events)."""
