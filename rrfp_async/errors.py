"""Every error rrfp_async raises on purpose, in one namespace.

``RRFPError`` is the base of all of them; the hierarchy, with what each means, is drawn at
the top of ``rrfp_async/_errors.py`` beside the classes. The top level re-exports the ones a
training loop catches (``RRFPError``, ``PlanError``, ``StepTimeoutError``,
``PeerStepError``, ``DeadlockError``); the rest are here. Every message says which rank,
which step and which task, and what was waited for. ``FailureKind`` is the code a failed
step's ABORT carries (``PeerStepError.kind``).
"""

from ._errors import (
    ChannelError,
    ClosedError,
    DeadlockError,
    DivergenceError,
    ExtraMissingError,
    FailureKind,
    HintError,
    InterruptedStepError,
    NonFiniteError,
    ObserverError,
    PeerError,
    PeerPlanError,
    PeerStepError,
    PlanError,
    PolicyError,
    ProtocolError,
    ResourceError,
    RRFPError,
    SpawnError,
    StepDiffersError,
    StepTimeoutError,
    TraceError,
)

__all__ = [
    "ChannelError",
    "ClosedError",
    "DeadlockError",
    "DivergenceError",
    "ExtraMissingError",
    "FailureKind",
    "HintError",
    "InterruptedStepError",
    "NonFiniteError",
    "ObserverError",
    "PeerError",
    "PeerPlanError",
    "PeerStepError",
    "PlanError",
    "PolicyError",
    "ProtocolError",
    "RRFPError",
    "ResourceError",
    "SpawnError",
    "StepDiffersError",
    "StepTimeoutError",
    "TraceError",
]
