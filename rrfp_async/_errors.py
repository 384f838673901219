"""Every error rrfp_async raises, in one place.

The hierarchy::

    RRFPError                       base of everything raised on purpose
    ├── HintError (ValueError)      a hint (schedule order) is invalid for the step plan;
    │                               raised before the step starts
    ├── PlanError (ValueError)      a topology, step plan, workload or config is invalid
    │   └── StepDiffersError        the ranks do not run the same step (the step check);
    │                               peers are told with FailureKind.STEP_DIFFERS
    ├── PolicyError                 a policy plug-in misbehaved (raised, returned a task
    │                               that is not ready or not admitted, is no coroutine)
    ├── DeadlockError               a step cannot finish: nothing ready, nothing running,
    │                               nothing in flight (carries the rank x task grid)
    ├── ChannelError                a message could not be moved
    │   ├── ProtocolError           a corrupt or unexpected header / message
    │   └── PeerError               a peer died or closed the connection
    │       └── PeerStepError       a step failed, was cancelled or refused on another
    │           │                   rank: this rank failed it too (the stage stays usable)
    │           └── PeerPlanError   (also a PlanError) it failed there with a PlanError, a
    │                               misuse to fix: every rank raises a PlanError for it
    ├── DivergenceError             TP ranks of a stage would run different task sequences
    ├── ObserverError               an observer (tracing, logging) raised during a step; the
    │                               step fails with it only when nothing else failed first
    ├── InterruptedStepError        user code on the compute thread raised a BaseException
    │                               that is no Exception (KeyboardInterrupt, SystemExit):
    │                               the step failed with this (everywhere) and the stage
    │                               stays usable; the sync face re-raises the original
    ├── StepTimeoutError            the watchdog fired: a step ran past its time limit
    │   └── loop.VirtualTimeLimit   a simulated step ran past its virtual or wall limit
    ├── loop.VirtualClockStall      (also a RuntimeError) nothing can ever wake the
    │                               virtual loop (simulate turns it into DeadlockError)
    ├── ClosedError                 the pipeline or stage was closed (after a failure it
    │                               could not recover from, or by the user)
    ├── TraceError (ValueError)     a trace file is not a trace (wrong structure or values)
    ├── ExtraMissingError           a feature needs an optional dependency (an extra) that
    │   (ImportError)               is not installed: the message names the pip command
    ├── ResourceError (OSError)     a rank ran out of an OS resource (file descriptors, a
    │                               thread, a port) opening a stage or its groups: names the
    │                               rank, the limit, the count in use and the fix, on that
    │                               rank and on its peers
    └── SpawnError                  a spawned worker process failed or ran out of time

Every message says which rank, which step and which task, and what was waited for.
What kind of failure a peer reported travels as a code, ``FailureKind``, never as text to
parse.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = [
    "ChannelError",
    "ClosedError",
    "DeadlockError",
    "DivergenceError",
    "ExtraMissingError",
    "FailureKind",
    "HintError",
    "InterruptedStepError",
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
    "StateNote",
    "StepDiffersError",
    "StepTimeoutError",
    "TraceError",
    "exception_notes",
    "peer_step_error",
]


class StateNote(str):
    """A rank's state dump, added to a failed step's error as a note (``add_note`` takes a
    ``str``; this subclass marks it): what a peer is told of the failure leaves it out by its
    type (``isinstance(note, StateNote)``), never by reading its text."""

    __slots__ = ()


def exception_notes(exc: BaseException) -> tuple[object, ...]:
    """The notes on ``exc`` (``add_note``), oldest first. Python creates ``__notes__`` with
    the first note: an exception without notes has no such attribute."""
    return tuple(getattr(exc, "__notes__", ()))


class RRFPError(Exception):
    """Base class of every error rrfp_async raises on purpose.

    Catch this to handle any runtime failure of a step; the subclasses say what went wrong.
    """


class HintError(RRFPError, ValueError):
    """A hint (a per-rank task order) is invalid for the step plan.

    Raised before a step starts: a task missing or repeated, a task placed on the wrong
    rank, an order that runs a task before a dependency on the same rank, an order whose
    ranks wait for each other in a cycle, or an order that needs more in-flight activations
    than the admission bound allows. The message names the rank and the task.
    """


class PlanError(RRFPError, ValueError):
    """A topology, step plan, workload, cost model or configuration value is invalid."""


class StepDiffersError(PlanError):
    """The step check's ``PlanError``: the ranks do not run the same step (another step
    number, microbatch count, plan or ``train=``); the message names every rank's side. A
    rank that fails a step with it tells the others with ``FailureKind.STEP_DIFFERS`` in the
    ABORT's header, which is how they tell it from any other cause."""


class PolicyError(RRFPError):
    """A policy plug-in misbehaved.

    Raised when a policy is not a coroutine function, raises, or returns a task that is
    not in the ready view (not ready, not admitted, not of this rank, already run). The
    message names the policy, the rank, the step and the task.

    Attributes:
        policy: The policy's name.
        rank: The pipeline rank whose stage loop called the policy (None at registration).
        step: The step number (None at registration).
        task: The task the policy returned, when it returned one.
    """

    def __init__(
        self,
        message: str,
        *,
        policy: str,
        rank: int | None = None,
        step: int | None = None,
        task: object | None = None,
    ) -> None:
        super().__init__(message)
        self.policy = policy
        self.rank = rank
        self.step = step
        self.task = task


class DeadlockError(RRFPError):
    """A step cannot finish: no task is ready, none is running and no message is in flight.

    The message carries a grid, one row per rank, that shows the remaining tasks in hint
    order and, for each blocked one, what it waits for (a message from which rank, a
    local task, or the admission bound).

    Attributes:
        step: The step that deadlocked.
        grid: The rank x task grid as text (also part of the message).
    """

    def __init__(self, message: str, *, step: int, grid: str) -> None:
        super().__init__(f"{message}\n{grid}")
        self.step = step
        self.grid = grid


class ChannelError(RRFPError):
    """A message could not be moved between stages."""


class ProtocolError(ChannelError):
    """A corrupt or unexpected message: bad header, unknown task, duplicate, wrong step.

    The message names the edge (source and destination rank) and the sequence number.
    """


class PeerError(ChannelError):
    """A peer process died, closed the connection, or stopped answering."""


class FailureKind(IntEnum):
    """What kind of failure a step's ABORT reports: a code in the ABORT's header, relayed hop
    by hop unchanged, so a rank decides what to do by the code, never by parsing the cause
    text (``PeerStepError.kind``). A rank that gets a code it does not know treats it as
    ``OTHER``.

    Attributes:
        OTHER: Any failure (an error, a cancellation, a timeout): the step failed there.
        STEP_DIFFERS: The step check found that ranks disagree on the step (a ``PlanError``
            on the origin): a rank that is still behind may wait for the others rather than
            fail at once.
        PLAN: The step failed on the origin with any other ``PlanError``: a misuse found
            there (a batch that does not split into the step's microbatches, a data
            iterator that ran dry, ...), which every other rank raises as a
            ``PeerPlanError``, a ``PlanError`` too.
        POLICY: The origin's step watchdog fired while its policy had not returned a
            decision (a ``StepTimeoutError`` whose ``policy`` is set): the policy is the
            cause. Unlike the others, this ABORT goes out even when the origin already
            failed the step for a peer's ABORT (its peers timed out at the same moment,
            waiting for it), and each rank passes it on once, so that every rank that
            waited names the stuck policy.
        TIMEOUT: The origin's step watchdog fired while it waited for other ranks (not in
            its policy's turn): the origin is a waiter, seldom the root. A rank that fails
            the step for this ABORT looks for the root as a rank that timed out itself
            does (a stuck policy's ABORT, the job's board, the silent ranks: see
            ``distributed._pulse``) before it raises.
    """

    OTHER = 0
    STEP_DIFFERS = 1
    PLAN = 2
    POLICY = 3
    TIMEOUT = 4


class PeerStepError(PeerError):
    """A step failed, was cancelled or was refused on another rank, so it failed here too.

    The rank where it failed told every rank of the pipeline (a small ABORT message on the
    p2p edges, forwarded hop by hop); each fails that step at once with this error, drops
    the step's late messages by its number, and runs the next step normally. Unlike other
    ``PeerError``s it does not break the channel: catch it, discard what the step left
    behind (``optimizer.zero_grad()``) and go on with the next step on every rank.

    Attributes:
        step: The failed step.
        origin: The global rank where it failed first.
        cause: Why it failed there (``"RuntimeError: boom"``, ``"cancelled"``): text for a
            message, never parsed.
        kind: What kind of failure it was (a ``FailureKind`` code, ``OTHER`` by default): the
            value to test, carried in the ABORT's header.
    """

    def __init__(
        self, message: str, *, step: int, origin: int, cause: str, kind: int = FailureKind.OTHER
    ) -> None:
        super().__init__(message)
        self.step = step
        self.origin = origin
        self.cause = cause
        self.kind = kind


class PeerPlanError(PeerStepError, PlanError):
    """A step failed on another rank with a ``PlanError`` (its ABORT's ``FailureKind.PLAN``):
    a misuse found there, such as a batch that does not split into ``n_microbatches`` on the
    rank that holds it or a data iterator that ran dry, so that the step fails with a
    ``PlanError`` on every rank, the origin's own and this one elsewhere. The message carries
    the origin's (what it found and the fix). A ``PeerStepError`` like any other: the stage
    stays usable, and every rank runs the next step together.
    """


def peer_step_error(kind: int) -> type[PeerStepError]:
    """The class of the error a rank raises for a step that failed on another rank with a
    failure of ``kind`` (the code its ABORT carries): ``PeerPlanError`` for
    ``FailureKind.PLAN``, else ``PeerStepError``."""
    return PeerPlanError if kind == FailureKind.PLAN else PeerStepError


class DivergenceError(RRFPError):
    """The TP ranks of a stage would execute different task sequences.

    Raised by a follower that receives a decision with a sequence gap or a task it does
    not know, and by the optional post-step cross-check. Collectives inside a task would
    not match, so nothing is computed silently.
    """


class ObserverError(RRFPError):
    """An observer of a stage (``StageObserver``: tracing, logging, dumps) raised.

    The stage catches it where the observer was called (also inside a message delivery,
    where it would otherwise be lost in the event loop's exception handler), stops calling
    that observer for the rest of the step and fails the step with this error, whose
    ``__cause__`` is the observer's own exception. When the step had already failed for
    another reason, that error stays the root cause and this one is attached to it as a
    note: an observer never hides or replaces the real error.

    Attributes:
        rank: The pipeline rank whose observer raised.
        step: The step number.
        method: The observer method that raised (``"message"``, ``"failed"``, ...).
    """

    def __init__(self, message: str, *, rank: int, step: int | None, method: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.step = step
        self.method = method


class InterruptedStepError(RRFPError):
    """A stage module (or anything run on a stage's compute thread) raised a
    ``BaseException`` that is not an ``Exception``, such as ``KeyboardInterrupt``.

    Raised on the event loop it would have killed (a ``BaseException`` ends an asyncio loop,
    and with it the synchronous face's portal), it is an ordinary step failure: the step
    fails on every rank, the stage stays usable for the next step, and
    ``DistributedStage.run_step_sync`` re-raises the original exception to its caller.

    Attributes:
        original: The exception that was raised.
    """

    def __init__(self, message: str, original: BaseException) -> None:
        super().__init__(message)
        self.original = original


class NonFiniteError(RRFPError, ArithmeticError):
    """A task's loss, activation or gradient is NaN or infinite, with
    ``TorchStageExecutor(nonfinite="raise")``: the step fails on every rank. The message
    names the rank, step, task, microbatch and value."""


class StepTimeoutError(RRFPError):
    """A step exceeded its watchdog time limit; the message points to the state dump.

    Attributes:
        policy: The name of the policy whose turn it was when the watchdog fired (it had
            not returned a decision: the policy is the cause, and the message opens with
            it), or None when the step waited for anything else.
        collective: What timed out when it was a collective of the job's control group
            rather than the step's tasks ("the end-of-step agreement", "the plan check",
            "the tied gradients' all-reduce"), or None.
    """

    def __init__(
        self, *args: object, policy: str | None = None, collective: str | None = None
    ) -> None:
        super().__init__(*args)
        self.policy = policy
        self.collective = collective


class ClosedError(RRFPError):
    """The pipeline or stage is closed: no further step can run on it."""


class TraceError(RRFPError, ValueError):
    """A trace file does not have the structure or values of a trace."""


class ExtraMissingError(RRFPError, ImportError):
    """A feature needs an optional dependency that is not installed (``render_png`` needs
    matplotlib, the ``plot`` extra). The message says what to install; the command line
    reports it in one line and keeps the rest of its output."""


class ResourceError(RRFPError, OSError):
    """A rank ran out of an operating-system resource: file descriptors (each gloo process
    group holds a listening socket, an epoll descriptor, a pipe and a socket per peer), a
    thread (the stage's channel, loop and compute threads), or a port.

    Raised instead of the abort (SIGABRT from gloo's C++) or the bare ``RuntimeError("can't
    start new thread")`` that the shortage would give: ``build_groups`` checks the
    descriptors its groups need before it creates any and tells every rank (over the
    default group's store) which rank is short, so that the peers raise this error too,
    naming that rank, instead of waiting in ``new_group``. The message names the resource,
    the limit where it is known, the count in use and the fix (``ulimit -n``, fewer stages
    or groups per process).

    Attributes:
        resource: What ran out (``"file descriptors"``, ``"threads"``, ``"ports"``).
        rank: The global rank that ran out of it (None where unknown).
        limit: The limit where known (the soft ``RLIMIT_NOFILE`` for descriptors).
        in_use: How many were in use where known.
    """

    def __init__(
        self,
        message: str,
        *,
        resource: str,
        rank: int | None = None,
        limit: int | None = None,
        in_use: int | None = None,
    ) -> None:
        super().__init__(message)
        self.resource = resource
        self.rank = rank
        self.limit = limit
        self.in_use = in_use

    def __str__(self) -> str:  # (OSError's would print the args tuple's errno form)
        return str(self.args[0]) if self.args else ""

    def __reduce__(self) -> tuple[object, ...]:  # keyword-only attributes survive pickling
        return (_resource_error, (str(self), self.resource, self.rank, self.limit, self.in_use))


def _resource_error(
    message: str, resource: str, rank: int | None, limit: int | None, in_use: int | None
) -> ResourceError:
    return ResourceError(message, resource=resource, rank=rank, limit=limit, in_use=in_use)


class SpawnError(RRFPError):
    """A worker process started by ``rrfp_async.spawn`` failed, died or timed out.

    The message names the failing rank(s) and carries their tracebacks.

    Attributes:
        failures: ``{rank: traceback text or reason}``.
    """

    def __init__(self, message: str, failures: dict[int, str]) -> None:
        super().__init__(message)
        self.failures = failures
