"""Policy registration, entry points and lifecycle hooks."""

from __future__ import annotations

import functools
from collections.abc import Callable
from importlib.metadata import EntryPoint
from typing import Any

import pytest

import rrfp_async as rr
from rrfp_async.policies import _policy, available_policies, get_policy, register_policy


async def last_ready(view: rr.ReadyView) -> rr.Task:
    return view.ready[-1]


def test_register_and_use_by_name() -> None:
    register_policy("test_last_ready", last_ready, replace=True)
    assert "test_last_ready" in available_policies()
    res = rr.simulate(stages=3, microbatches=6, policy="test_last_ready", hint="gpipe")
    assert res.policy == "test_last_ready"
    with pytest.raises(rr.errors.PolicyError, match="already registered"):
        register_policy("test_last_ready", rr.policies.strict)


def test_register_refuses_non_coroutines_naming_them() -> None:
    def not_async(view: Any) -> Any:
        return None

    with pytest.raises(rr.errors.PolicyError, match="policy 'bad' must be a coroutine function"):
        register_policy("bad", not_async)
    with pytest.raises(rr.errors.PolicyError, match="must be a coroutine"):
        register_policy("bad", 42)


def test_unknown_policy() -> None:
    with pytest.raises(rr.errors.PolicyError, match="unknown policy 'nope'"):
        get_policy("nope")


def test_entry_point_plugins_are_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    ep = EntryPoint(
        name="ep_last",
        value="tests.policies.test_registry:last_ready",
        group=_policy.ENTRY_POINT_GROUP,
    )
    monkeypatch.setattr(_policy, "entry_points", lambda group: [ep] if group == ep.group else [])
    monkeypatch.setattr(_policy, "_entry_points_loaded", False)
    assert get_policy("ep_last") is last_ready
    _policy._REGISTRY.pop("ep_last", None)


def test_stateful_policy_hooks() -> None:
    class Counting(rr.PolicyBase):
        name = "counting"

        def __init__(self) -> None:
            self.steps: list[tuple[int, int]] = []
            self.ended = 0

        async def __call__(self, view: rr.ReadyView, /) -> rr.Task:
            return view.ready[0]

        def on_step_start(self, rank: int, step: int) -> None:
            self.steps.append((rank, step))

        def on_task_end(self, task: rr.Task, duration: float) -> None:
            self.ended += 1

    pol = Counting()
    res = rr.simulate(stages=2, microbatches=3, policy=pol)
    assert sorted(pol.steps) == [(0, 0), (1, 0)]
    assert pol.ended == 12
    assert res.policy == "counting"


def test_view_exposes_state() -> None:
    seen: list[dict[str, Any]] = []

    async def spy(view: rr.ReadyView) -> rr.Task:
        seen.append(
            {
                "rank": view.rank,
                "step": view.step,
                "ready": list(view.ready),
                "blocked": list(view.blocked),
                "next": view.next_hinted,
                "inflight": view.inflight,
                "bound": view.max_inflight,
                "remaining": view.remaining,
                "rank_of_next": view.hint_rank(view.next_hinted),
                "observed": dict(view.durations),
                "deadline": view.hinted_deadline,
            }
        )
        return view.ready[0]

    rr.simulate(stages=2, microbatches=2, policy=spy)
    first = next(s for s in seen if s["rank"] == 0)
    assert first["ready"] == [rr.Task(0, "F", 0), rr.Task(0, "F", 1)]
    assert first["next"] == rr.Task(0, "F", 0) and first["rank_of_next"] == 0
    assert first["inflight"] == 0 and first["bound"] == 2 and first["remaining"] == 4
    assert first["deadline"] == pytest.approx(0.0, abs=1e-6)
    last = [s for s in seen if s["rank"] == 0][-1]
    assert len(last["observed"]) == 3


# --- Issue 8: every bad plug-in input is a typed error -----------------------------------


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> Callable[[list[EntryPoint]], None]:
    """A registry of the built-ins only; the returned function installs fake entry points."""
    builtins = {
        n: _policy._REGISTRY[n] for n in ("backfill", "lateness_aware", "readiness_first", "strict")
    }
    monkeypatch.setattr(_policy, "_REGISTRY", builtins)
    monkeypatch.setattr(_policy, "_ALIASES", dict(_policy._ALIASES))
    monkeypatch.setattr(_policy, "_BROKEN", {}, raising=False)
    monkeypatch.setattr(_policy, "_entry_points_loaded", False)
    monkeypatch.setattr(_policy, "entry_points", lambda group: [])

    def install(eps: list[EntryPoint]) -> None:
        monkeypatch.setattr(
            _policy, "entry_points", lambda group: eps if group == _policy.ENTRY_POINT_GROUP else []
        )

    return install


def _ep(name: str, value: str) -> EntryPoint:
    return EntryPoint(name=name, value=value, group=_policy.ENTRY_POINT_GROUP)


def sync_policy(view: Any) -> Any:
    return view.ready[0]


@pytest.mark.parametrize("name", [123, None, "", "  ", "two words", "1st", "a/b"])
def test_register_refuses_bad_names(registry: object, name: Any) -> None:
    with pytest.raises(
        rr.errors.PolicyError, match="register_policy: name must be a non-empty"
    ) as ei:
        register_policy(name, last_ready)
    assert repr(name) in str(ei.value)
    assert name not in _policy._REGISTRY


def test_register_accepts_identifier_like_names(registry: object) -> None:
    for name in ("mine", "_mine2", "my-policy", "org.mine"):
        register_policy(name, last_ready)
        assert get_policy(name) is last_ready


def test_register_refuses_an_alias_name(registry: object) -> None:
    with pytest.raises(
        rr.errors.PolicyError,
        match=r"'rf' is an alias of the policy 'readiness_first'.*replace=True",
    ):
        register_policy("rf", last_ready)
    assert get_policy("rf") is rr.policies.readiness_first
    # replace=True makes the registration win, consistently: lookup, listing and name.
    register_policy("rf", last_ready, replace=True)
    assert get_policy("rf") is last_ready
    assert get_policy("readiness_first") is rr.policies.readiness_first
    assert "rf" in available_policies()
    assert _policy.policy_name(last_ready) == "rf"


async def _pick(view: rr.ReadyView, index: int) -> rr.Task:
    return view.ready[index]


class AsyncCallable:
    def __init__(self, index: int = 0) -> None:
        self.index = index

    async def __call__(self, view: rr.ReadyView, /, index: int | None = None) -> rr.Task:
        return view.ready[self.index if index is None else index]


@pytest.mark.parametrize(
    "policy",
    [
        functools.partial(_pick, index=-1),
        functools.partial(functools.partial(_pick), index=0),
        AsyncCallable(),
        functools.partial(AsyncCallable(), index=-1),
    ],
    ids=["partial", "nested-partial", "async-call", "partial-of-async-call"],
)
def test_partials_and_async_call_objects_are_accepted(registry: object, policy: Any) -> None:
    register_policy("wrapped", policy)
    assert get_policy("wrapped") is policy
    assert get_policy(policy) is policy
    res = rr.simulate(stages=2, microbatches=3, policy="wrapped", hint="gpipe")
    assert res.policy == "wrapped"


def test_partial_of_a_sync_function_is_refused(registry: object) -> None:
    with pytest.raises(rr.errors.PolicyError, match="policy 'p' must be a coroutine function"):
        register_policy("p", functools.partial(sync_policy))


def test_a_broken_entry_point_hides_nothing_else(
    registry: Callable[[list[EntryPoint]], None],
) -> None:
    registry(
        [
            _ep("ep_broken", "no_such_module_rrfp:policy"),
            _ep("ep_sync", "tests.policies.test_registry:sync_policy"),
            _ep("ep_last", "tests.policies.test_registry:last_ready"),
        ]
    )
    with pytest.warns(RuntimeWarning) as rec:
        names = available_policies()
    messages = [str(w.message) for w in rec]
    assert any(
        "entry point 'ep_broken' (no_such_module_rrfp:policy)" in m and "ModuleNotFoundError" in m
        for m in messages
    ), messages
    assert any("'ep_sync'" in m and "must be a coroutine function" in m for m in messages)
    assert "ep_last" in names and "strict" in names
    assert "ep_broken" not in names and "ep_sync" not in names
    assert get_policy("ep_last") is last_ready
    assert get_policy("strict") is rr.policies.strict
    assert get_policy("rf") is rr.policies.readiness_first
    with pytest.raises(
        rr.errors.PolicyError,
        match=r"policy entry point 'ep_broken' \(no_such_module_rrfp:policy\) failed to load:"
        r" ModuleNotFoundError",
    ) as ei:
        get_policy("ep_broken")
    assert isinstance(ei.value.__cause__, ModuleNotFoundError)
    assert ei.value.policy == "ep_broken"
    with pytest.raises(rr.errors.PolicyError, match=r"'ep_sync'.*must be a coroutine function"):
        get_policy("ep_sync")


def test_a_broken_entry_point_does_not_break_builtins_first(
    registry: Callable[[list[EntryPoint]], None],
) -> None:
    # get_policy of a built-in never loads entry points; an unknown name does, and then
    # still reports an unknown name (not the broken plug-in).
    registry([_ep("ep_broken", "no_such_module_rrfp:policy")])
    assert get_policy("strict") is rr.policies.strict
    with (
        pytest.warns(RuntimeWarning, match="ep_broken"),
        pytest.raises(rr.errors.PolicyError, match="unknown policy 'nope'") as ei,
    ):
        get_policy("nope")
    assert "failed to load: ['ep_broken']" in str(ei.value)


def test_cli_simulate_survives_a_broken_entry_point(
    registry: Callable[[list[EntryPoint]], None],
) -> None:
    from click.testing import CliRunner

    from rrfp_async.cli._main import main

    registry([_ep("ep_broken", "no_such_module_rrfp:policy")])
    with pytest.warns(RuntimeWarning, match="ep_broken"):
        res = CliRunner().invoke(
            main, ["simulate", "-p", "2", "-m", "4", "--json", "--policy", "strict"]
        )
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize(
    ("policy", "what"),
    [
        ("nope", r"unknown policy 'nope'"),
        (42, r"policy 'int' must be a coroutine function.*got 42"),
        (sync_policy, r"policy 'sync_policy' must be a coroutine function"),
        (None, r"policy 'NoneType' must be a coroutine function"),
    ],
)
def test_get_policy_errors_list_the_available_names(
    registry: object, policy: Any, what: str
) -> None:
    register_policy("mine", last_ready)
    with pytest.raises(rr.errors.PolicyError, match=what) as ei:
        get_policy(policy)
    msg = str(ei.value)
    assert "registered: ['backfill', 'lateness_aware', 'mine', 'readiness_first', 'strict']" in msg
    assert "'rf' -> 'readiness_first'" in msg


def test_view_durations_are_the_tasks_that_ended_in_the_order_they_ended() -> None:
    # ReadyView.durations is a view of the step's state, not a dict filled per task: it
    # must still read as one (order, membership, values, KeyError) at every decision.
    seen: list[tuple[int, list[tuple[rr.Task, float]], list[rr.Task]]] = []

    async def spy(view: rr.ReadyView) -> rr.Task:
        d = view.durations
        items = list(d.items())
        assert len(d) == len(items) and list(d) == [t for t, _ in items]
        for t in view.ready:  # ready, so not ended: no duration yet
            assert t not in d
            with pytest.raises(KeyError):
                d[t]
        assert rr.Task(99, "F", 0) not in d  # no task of this rank at all
        seen.append((view.rank, items, list(view.ready)))
        return view.ready[0]

    res = rr.simulate(stages=3, microbatches=4, policy=spy, workload="multimodal", jitter=0.3)
    for rank, items, _ in seen:
        ended = {e.task: e for e in res.executed[rank]}
        # Exactly the tasks that ended before the decision, in the order they ended, each
        # with end - start of its record (bit for bit).
        order = [t for t, _ in items]
        assert order == [e.task for e in res.executed[rank]][: len(order)]
        assert all(v == ended[t].end - ended[t].start for t, v in items)
    last = [items for rank, items, _ in seen if rank == 0][-1]
    assert len(last) == len(res.executed[0]) - 1
