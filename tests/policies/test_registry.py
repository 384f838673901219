"""Policy registration, entry points and lifecycle hooks."""

from __future__ import annotations

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
    with pytest.raises(rr.PolicyError, match="already registered"):
        register_policy("test_last_ready", rr.strict)


def test_register_refuses_non_coroutines_naming_them() -> None:
    def not_async(view: Any) -> Any:
        return None

    with pytest.raises(rr.PolicyError, match="policy 'bad' must be a coroutine function"):
        register_policy("bad", not_async)
    with pytest.raises(rr.PolicyError, match="must be a coroutine"):
        register_policy("bad", 42)


def test_unknown_policy() -> None:
    with pytest.raises(rr.PolicyError, match="unknown policy 'nope'"):
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
