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
Each entry point loads on its own: a broken one is a ``RuntimeWarning`` and fails only when
its policy is asked for.
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from importlib.metadata import entry_points
from typing import Protocol, runtime_checkable

from .._errors import PolicyError
from .._tasks import Task

__all__ = [
    "ENTRY_POINT_GROUP",
    "NamedPolicy",
    "Policy",
    "PolicyBase",
    "ReadyHeadPolicy",
    "ReadyView",
    "available_policies",
    "backfill",
    "chooses_ready_head",
    "get_policy",
    "greedy",
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
    while the policy awaits. It is valid during a step only: a view kept past the step and
    read then raises ``PolicyError`` (keep values such as ``list(view.ready)`` instead).
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
        """Activations currently stashed on this rank (a count)."""

    @property
    def max_inflight(self) -> int:
        """The admission bound as a count (with a byte budget, the count the hint itself
        reaches; the budget is ``budget_bytes``)."""

    @property
    def inflight_bytes(self) -> int | None:
        """Activation bytes stashed on this rank, with a byte budget; else None."""

    @property
    def budget_bytes(self) -> int | None:
        """This rank's byte budget; None when memory is counted in activations."""

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


@runtime_checkable
class NamedPolicy(Protocol):
    """Optional: a policy that names itself.

    ``name`` (when non-empty) is what traces, step stats, logs and the plan check call an
    unregistered policy; without it (or with an empty one) the policy is named by its
    qualname (a stage reads it once, when built). :class:`PolicyBase` declares it (empty).
    """

    name: str


@runtime_checkable
class ReadyHeadPolicy(Protocol):
    """Optional: a policy that declares it runs the next hinted task whenever it is ready.

    Set ``chooses_ready_head = True`` only if the policy always returns ``view.next_hinted``
    when that task is ready: a TP leader then publishes such a choice one task ahead, and a
    TP follower starts it without waiting for the leader's row (``deduce_tp``). Without the
    attribute (or with a false one) neither happens. Read when a step starts. The built-in
    policies (``strict``, ``readiness_first``, ``greedy``, ``lateness_aware``,
    ``backfill``) declare it True; :class:`PolicyBase` declares it False. A
    ``functools.partial`` of a policy does not carry it (declare it on the partial if it
    holds).
    """

    chooses_ready_head: bool


def chooses_ready_head(policy: object) -> bool:
    """Whether ``policy`` declares ``chooses_ready_head`` (see :class:`ReadyHeadPolicy`)."""
    return isinstance(policy, ReadyHeadPolicy) and bool(policy.chooses_ready_head)


class PolicyBase:
    """Optional base for stateful policies: lifecycle hooks that do nothing by default.

    Subclass it, override ``__call__`` (a coroutine) and any hook you need. It declares the
    optional attributes with their defaults: ``name`` (:class:`NamedPolicy`, empty: the
    class's qualname names it) and ``chooses_ready_head`` (:class:`ReadyHeadPolicy`, False).
    Set ``chooses_ready_head = True`` only if the policy always returns ``view.next_hinted``
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
    """The RRFP rule: dispatch the highest-ranked ready task within the admission bound,
    with the backwards kept in their hinted order.

    ``view.ready`` holds exactly the tasks whose inputs are present and that the admission
    bound admits, best hint rank first. When the hinted task (the first not yet started) is
    ready it runs; when its input is late, the best-ranked ready *forward* or ``W`` runs
    instead, and the hinted one runs as soon as it is ready and the rank is free. A
    backward (``B``, or ``I`` when split) runs only as the hinted task: one run ahead of
    its turn holds the rank when the hinted task's input arrives, and the hinted task is
    then late by a whole backward — on the backward chain that frees memory and feeds rank
    0, so the whole pipeline waits. The rule that also runs backwards out of order
    (``greedy``) loses to the same hint run strictly on some steps; this one does not
    (BENCHMARKS.md, "Readiness-first against its own hint"). Since only admitted tasks are
    candidates, memory never exceeds the budget and the step cannot deadlock. Registered
    also as ``rf``.
    """
    while True:
        head = view.next_hinted
        if view.is_ready(head):
            return head
        for t in view.ready:
            if t.kind == "F" or t.kind == "W":
                return t
        await view.wait_for_change()


async def greedy(view: ReadyView, /) -> Task:
    """The highest-ranked ready task, whatever its kind (``view.ready[0]``; never waits):
    the RRFP preprint's rule read literally. It also runs a backward ahead of its hinted
    turn, which can delay the hinted one (see ``readiness_first``)."""
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
for _p in (strict, readiness_first, greedy, lateness_aware, backfill):
    _p.chooses_ready_head = True  # type: ignore[attr-defined]

_REGISTRY: dict[str, Policy] = {
    "strict": strict,
    "readiness_first": readiness_first,
    "greedy": greedy,
    "lateness_aware": lateness_aware,
    "backfill": backfill,
}
_ALIASES = {
    "fixed": "strict",
    "rf": "readiness_first",
    "readiness": "readiness_first",
    "late": "lateness_aware",
}
_entry_points_loaded = False
# Entry points that failed to load or register: name -> (the PolicyError to raise when the
# policy is asked for, the original error it chains). They are warned about once, when the
# group is read, and fail only when requested: one broken plug-in hides nothing else.
_BROKEN: dict[str, tuple[str, BaseException]] = {}

# A name the CLI and configuration files can carry: no spaces, no slashes, not a number.
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")


def _unwrap(policy: object) -> object:
    """The callable a ``functools.partial`` (nested or not) finally calls."""
    while isinstance(policy, functools.partial):
        policy = policy.func
    return policy


def policy_name(policy: object) -> str:
    """A readable name for ``policy`` (its registered name, ``name`` attribute or qualname).

    A ``functools.partial`` that is not registered is named after the callable it wraps.
    """
    for k, v in _REGISTRY.items():
        if v is policy:
            return k
    policy = _unwrap(policy)
    name = (policy.name if isinstance(policy, NamedPolicy) else "") or getattr(
        policy, "__qualname__", ""
    )
    return str(name or type(policy).__qualname__)


def _is_coroutine_policy(policy: object) -> bool:
    """Whether calling ``policy`` runs a coroutine function.

    ``inspect.iscoroutinefunction`` sees through bound methods and partials of functions but
    not through an object with ``async def __call__`` (nor a partial of one), so the
    callable a partial wraps is unwrapped first and, when it is no function, its class's
    ``__call__`` is checked.
    """
    if inspect.iscoroutinefunction(policy):
        return True
    target = _unwrap(policy)
    if inspect.isfunction(target) or inspect.ismethod(target) or isinstance(target, type):
        return inspect.iscoroutinefunction(target)
    call = getattr(type(target), "__call__", None)  # noqa: B004 - the class attribute
    return call is not None and inspect.iscoroutinefunction(call)


def _names_note() -> str:
    """The registered names, the aliases and the broken entry points, for error messages."""
    aliases = ", ".join(f"{a!r} -> {k!r}" for a, k in sorted(_ALIASES.items()))
    note = f"registered: {sorted(_REGISTRY)}; aliases: {aliases}"
    if _BROKEN:
        note += f"; entry points that failed to load: {sorted(_BROKEN)}"
    return note


def _check_coroutine(name: str, policy: object, *, list_names: bool = False) -> None:
    if not _is_coroutine_policy(policy):
        hint = f"; or pass a policy name ({_names_note()})" if list_names else ""
        raise PolicyError(
            f"policy {name!r} must be a coroutine function (async def ...(view) -> Task) or an"
            f" object with an async __call__; got {policy!r}{hint}",
            policy=name,
        )


def register_policy(name: str, policy: object, *, replace: bool = False) -> None:
    """Register a policy under ``name``.

    Args:
        name: The name the stage loop, ``simulate`` and the CLI accept: a non-empty,
            identifier-like string (letters, digits, ``_``, ``-``, ``.``; not starting with
            a digit).
        policy: An ``async def`` function ``(view) -> Task``, an object with an async
            ``__call__``, or a ``functools.partial`` of either.
        replace: Allow replacing an existing registration, or taking over a built-in
            alias (``"rf"``, ``"greedy"``...): the alias is then dropped.

    Raises:
        PolicyError: ``name`` is not an identifier-like string; ``policy`` is not a
            coroutine function (checked now, not at first use); or ``name`` is taken (by a
            policy or an alias) and ``replace`` is false.
    """
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise PolicyError(
            "register_policy: name must be a non-empty identifier-like string (letters,"
            f" digits, '_', '-', '.'; not starting with a digit); got {name!r}",
            policy=policy_name(policy),
        )
    _check_coroutine(name, policy)
    if name in _ALIASES:
        if not replace:
            raise PolicyError(
                f"{name!r} is an alias of the policy {_ALIASES[name]!r} and would keep"
                " resolving to it; choose another name, or pass replace=True to take the"
                " name over",
                policy=name,
            )
        del _ALIASES[name]
    if name in _REGISTRY and not replace and _REGISTRY[name] is not policy:
        raise PolicyError(f"a policy named {name!r} is already registered", policy=name)
    _REGISTRY[name] = policy  # type: ignore[assignment]
    _BROKEN.pop(name, None)


def _broken(name: str, message: str, error: BaseException) -> None:
    _BROKEN[name] = (message, error)
    warnings.warn(message, RuntimeWarning, stacklevel=4)


def _load_entry_points() -> None:
    """Register every policy of the entry-point group, each on its own.

    A plug-in that fails to import or to register is warned about and remembered; it fails
    (``PolicyError`` chaining the original error) only when asked for by name. The
    built-ins and every other plug-in keep working.
    """
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    try:
        eps = list(entry_points(group=ENTRY_POINT_GROUP))
    except Exception as e:  # corrupt installed metadata: keep the built-ins
        warnings.warn(
            f"cannot read the policy entry-point group {ENTRY_POINT_GROUP!r}:"
            f" {type(e).__name__}: {e}",
            RuntimeWarning,
            stacklevel=3,
        )
        return
    for ep in eps:
        if ep.name in _REGISTRY:
            continue
        where = f"policy entry point {ep.name!r} ({ep.value})"
        try:
            obj = ep.load()
        except Exception as e:  # a broken plug-in must not break the built-ins
            _broken(ep.name, f"{where} failed to load: {type(e).__name__}: {e}", e)
            continue
        try:
            register_policy(ep.name, obj)
        except PolicyError as e:
            _broken(ep.name, f"{where} cannot be registered: {e}", e)


def available_policies() -> list[str]:
    """Names of every registered policy, entry points included.

    Entry points that fail to load are left out (and warned about once, as a
    ``RuntimeWarning``); asking for one by name raises the reason.
    """
    _load_entry_points()
    return sorted(_REGISTRY)


def get_policy(policy: str | Policy) -> Policy:
    """Resolve a policy name (or check a policy object).

    Args:
        policy: A registered name or alias, or a policy (see ``register_policy``).

    Returns:
        The policy.

    Raises:
        PolicyError: Unknown name, an entry point that failed to load (chaining its error),
            or an object that is not a coroutine function. The message lists the
            registered names.
    """
    if not isinstance(policy, str):
        _check_coroutine(policy_name(policy), policy, list_names=True)
        return policy
    key = _ALIASES.get(policy, policy)
    if key not in _REGISTRY:
        _load_entry_points()
    if key in _REGISTRY:
        return _REGISTRY[key]
    if key in _BROKEN:
        message, error = _BROKEN[key]
        raise PolicyError(message, policy=key) from error
    raise PolicyError(
        f"unknown policy {policy!r}; {_names_note()}; {_process_note()}", policy=policy
    )


def _process_note() -> str:
    """Why a name registered elsewhere is unknown here: each process has its own registry.

    ``rr.spawn`` and torchrun start fresh interpreters (``rr.spawn`` sets ``RANK`` and
    ``WORLD_SIZE`` in each, as torchrun does), which import the worker's module but run
    none of the parent's ``register_policy`` calls."""
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    here = (
        f"this process is rank {rank} of {world} (started by rr.spawn or torchrun) and"
        " does not see the parent's registry: "
        if rank is not None and world is not None
        else ""
    )
    return (
        f"{here}a policy registered in the parent process is not registered in processes"
        " started by rr.spawn or torchrun: register it at import time of the module that"
        " defines the worker (register_policy at module level, or a"
        f" {ENTRY_POINT_GROUP!r} entry point), or pass the policy object itself"
    )
