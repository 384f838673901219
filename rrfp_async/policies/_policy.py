"""Policies: coroutines that choose the next task of a pipeline rank from its ready view.

A policy is anything with ``async def __call__(view) -> Task``; a plain ``async def``
function qualifies. A rank's stage loop (one per pipeline rank, running every virtual stage
the rank holds) calls it whenever the rank's compute is free and at least one task is ready
and admitted. The policy may return at once (readiness-first) or
await something first (the strict baseline awaits the next hinted task). It must return
one of ``view.ready``; anything else is a ``PolicyError`` naming the policy, rank, step
and task.

Plug-ins are registered by name with ``register_policy`` or through the entry-point group
``rrfp_async.policies`` (the entry point names a coroutine function or a policy object).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from importlib.metadata import entry_points
from typing import Protocol, runtime_checkable

from .._errors import PolicyError
from .._tasks import Task

__all__ = [
    "ENTRY_POINT_GROUP",
    "Policy",
    "PolicyBase",
    "ReadyView",
    "available_policies",
    "backfill",
    "get_policy",
    "lateness_aware",
    "policy_name",
    "readiness_first",
    "register_policy",
    "strict",
]

ENTRY_POINT_GROUP = "rrfp_async.policies"


class ReadyView(Protocol):
    """What a policy sees of its pipeline rank (the rank's stage loop) when asked to decide.

    The view is live: it reflects the rank's state at the moment it is read, and changes
    while the policy awaits.
    """

    @property
    def rank(self) -> int:
        """The pipeline rank the policy decides for."""

    @property
    def step(self) -> int:
        """The step number."""

    @property
    def ready(self) -> Sequence[Task]:
        """Tasks that may start now (inputs present and admitted), best hint rank first."""

    @property
    def blocked(self) -> Sequence[Task]:
        """Tasks whose inputs are present but that the admission bound holds back."""

    @property
    def next_hinted(self) -> Task:
        """The first task of the hint not yet started (what a fixed order would run next)."""

    @property
    def hint(self) -> Sequence[Task]:
        """This rank's hint order for the step."""

    def hint_rank(self, task: Task) -> int:
        """Position of ``task`` in the hint (lower is more urgent)."""

    def is_ready(self, task: Task) -> bool:
        """Whether ``task`` may start now."""

    @property
    def inflight(self) -> int:
        """Activations currently stashed on this rank."""

    @property
    def max_inflight(self) -> int:
        """The admission bound."""

    @property
    def remaining(self) -> int:
        """Tasks of this rank not yet started in this step."""

    @property
    def durations(self) -> Mapping[Task, float]:
        """Observed durations of the tasks that finished so far in this step."""

    def now(self) -> float:
        """The stage loop's clock (virtual time in a simulation), seconds."""

    @property
    def idle_since(self) -> float:
        """Clock when the rank's last task ended (or the step started)."""

    @property
    def hinted_deadline(self) -> float | None:
        """When the hinted task should start by the plan, past which it is *late*: the
        later of (a) the end of the hint's prefix (every task before it, all done) plus the
        idle gap the plan foresees before it and (b) its planned start after the step's
        start. The plan is every rank running its hint strictly on the declared durations.
        None when the schedule has no declared durations."""

    async def wait_until_ready(self, task: Task, timeout: float | None = None) -> bool:
        """Wait until ``task`` may start; return True then, or False after ``timeout``
        seconds (raises ``DeadlockError`` if it can never start)."""

    def declared_duration(self, task: Task) -> float | None:
        """The declared (planned) duration of ``task``, or None without declared durations."""

    async def wait_for_change(self, timeout: float | None = None) -> bool:
        """Wait for the next change of the ready set; False if ``timeout`` passed first."""


@runtime_checkable
class Policy(Protocol):
    """A dispatch policy: one coroutine method that picks the next task."""

    async def __call__(self, view: ReadyView, /) -> Task:
        """Return the task to run next; it must be one of ``view.ready``."""


class PolicyBase:
    """Optional base for stateful policies: lifecycle hooks that do nothing by default.

    Subclass it, override ``__call__`` (a coroutine) and any hook you need. Set
    ``chooses_ready_head = True`` only if the policy always returns ``view.next_hinted``
    when that task is ready: a TP leader then publishes such a choice one task ahead.
    """

    name: str = ""
    chooses_ready_head: bool = False

    async def __call__(self, view: ReadyView, /) -> Task:
        """Return the task to run next; it must be one of ``view.ready``."""
        raise NotImplementedError

    def on_step_start(self, rank: int, step: int) -> None:
        """Called when a rank's stage loop starts a step, before its first decision."""

    def on_task_end(self, task: Task, duration: float) -> None:
        """Called when a task of the rank finished, with its measured duration."""


async def strict(view: ReadyView, /) -> Task:
    """The fixed-order baseline: wait for the next hinted task, then run it.

    This is what Megatron-LM, DeepSpeed and torch.distributed.pipelining do: the order is a
    commitment; a later task that is already runnable waits behind a blocked earlier one.
    """
    head = view.next_hinted
    if not view.is_ready(head):
        await view.wait_until_ready(head)
    return head


async def readiness_first(view: ReadyView, /) -> Task:
    """The RRFP rule: dispatch the highest-ranked ready task within the admission bound.

    ``view.ready`` holds exactly the tasks whose inputs are present and that the admission
    bound admits, best hint rank first, so the rule is ``view.ready[0]``; it never waits.
    The hint only ranks tasks: when the hinted task is ready it runs (it ranks first); when
    its input is late, the best-ranked ready task runs instead, and the hinted one runs as
    soon as it is ready and the rank is free. Since only admitted tasks are candidates,
    memory never exceeds the fixed order's (at the default bound) and the step cannot
    deadlock. Unlike ``lateness_aware`` it also fills the hint's *planned* bubbles, which
    can help (ZB-H1's deferred weight gradients, a later microbatch whose input is early)
    or, rarely, hurt (the task run out of order delays the hinted one when it arrives).
    Registered also as ``greedy``.
    """
    return view.ready[0]


async def lateness_aware(view: ReadyView, /) -> Task:
    """Run the hinted task; once it is *late*, run the highest-ranked ready task instead.

    The hinted task (the first not yet started) is *late* when the rank has idled past
    ``view.hinted_deadline``: the plan (every rank running the hint strictly on the declared
    durations) foresees it starting earlier. A late task is skipped, not waited for; a
    planned bubble is kept, so with zero variance (realized = declared durations) this
    policy runs exactly the hint's order. Without declared durations every not-ready hinted
    task counts as late (then it is ``readiness_first``).
    """
    head = view.next_hinted
    if view.is_ready(head):
        return head
    deadline = view.hinted_deadline
    if deadline is not None:
        wait = deadline - view.now()
        if wait > 0 and await view.wait_until_ready(head, timeout=wait):
            return head
    return view.ready[0]


async def backfill(view: ReadyView, /) -> Task:
    """Readiness-first that fills the hint's planned bubbles without delaying the hint.

    Runs the hinted task if it is ready. While the rank is inside a bubble the plan
    foresees, it runs the highest-ranked ready task whose declared duration ends before the
    hinted task's planned start (conservative backfilling, as in HPC batch schedulers);
    once the hinted task is late it runs the highest-ranked ready task (``lateness_aware``
    plus backfilling). Without declared durations it behaves like ``readiness_first``.
    """
    while True:
        head = view.next_hinted
        if view.is_ready(head):
            return head
        deadline = view.hinted_deadline
        if deadline is None:
            return view.ready[0]
        now = view.now()
        if now >= deadline:
            return view.ready[0]
        for t in view.ready:
            d = view.declared_duration(t)
            if d is not None and now + d <= deadline:
                return t
        await view.wait_for_change(timeout=deadline - now)


# Each of these runs the next hinted task whenever it is ready, whatever else is: a TP leader
# may then publish that choice ahead (see the stage loop's TP look-ahead).
for _p in (strict, readiness_first, lateness_aware, backfill):
    _p.chooses_ready_head = True  # type: ignore[attr-defined]

_REGISTRY: dict[str, Policy] = {
    "strict": strict,
    "readiness_first": readiness_first,
    "lateness_aware": lateness_aware,
    "backfill": backfill,
}
_ALIASES = {
    "fixed": "strict",
    "rf": "readiness_first",
    "readiness": "readiness_first",
    "greedy": "readiness_first",
    "late": "lateness_aware",
}
_entry_points_loaded = False


def policy_name(policy: object) -> str:
    """A readable name for ``policy`` (its registered name, ``name`` attribute or qualname)."""
    for k, v in _REGISTRY.items():
        if v is policy:
            return k
    name = getattr(policy, "name", "") or getattr(policy, "__qualname__", "")
    return str(name or type(policy).__qualname__)


def _check_coroutine(name: str, policy: object) -> None:
    fn = policy if inspect.isfunction(policy) or inspect.ismethod(policy) else None
    if fn is None:
        call = getattr(type(policy), "__call__", None)  # noqa: B004 - the class attribute
        fn = call
    if fn is None or not inspect.iscoroutinefunction(fn):
        raise PolicyError(
            f"policy {name!r} must be a coroutine function (async def ...(view) -> Task) or an"
            f" object with an async __call__; got {policy!r}",
            policy=name,
        )


def register_policy(name: str, policy: object, *, replace: bool = False) -> None:
    """Register a policy under ``name``.

    Args:
        name: The name the stage loop, ``simulate`` and the CLI accept.
        policy: An ``async def`` function ``(view) -> Task`` or an object with an async
            ``__call__``.
        replace: Allow replacing an existing registration.

    Raises:
        PolicyError: ``policy`` is not a coroutine function (checked now, not at first use),
            or ``name`` is taken and ``replace`` is false.
    """
    _check_coroutine(name, policy)
    if name in _REGISTRY and not replace and _REGISTRY[name] is not policy:
        raise PolicyError(f"a policy named {name!r} is already registered", policy=name)
    _REGISTRY[name] = policy  # type: ignore[assignment]


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _REGISTRY:
            continue
        try:
            obj = ep.load()
        except Exception as e:  # a broken plug-in must not break the built-ins
            raise PolicyError(
                f"cannot load policy entry point {ep.name!r} ({ep.value}): {e}", policy=ep.name
            ) from e
        register_policy(ep.name, obj)


def available_policies() -> list[str]:
    """Names of every registered policy, entry points included."""
    _load_entry_points()
    return sorted(_REGISTRY)


def get_policy(policy: str | Policy) -> Policy:
    """Resolve a policy name (or check a policy object).

    Raises:
        PolicyError: Unknown name, or an object that is not a coroutine function.
    """
    if not isinstance(policy, str):
        _check_coroutine(policy_name(policy), policy)
        return policy
    key = _ALIASES.get(policy, policy)
    if key not in _REGISTRY:
        _load_entry_points()
    if key not in _REGISTRY:
        raise PolicyError(
            f"unknown policy {policy!r}; registered: {sorted(_REGISTRY)}", policy=policy
        )
    return _REGISTRY[key]
