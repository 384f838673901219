"""The plan check: ranks that disagree on the plan fail at the first step, on every rank, with
a ``PlanError`` that names both sides; matching plans run, checked once per plan."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import pytest
import torch

import rrfp_async as rr
from rrfp_async._errors import FailureKind, StepDiffersError
from rrfp_async.distributed._digest import PlanDigest, adopt_default_seed, plan_disagreement
from rrfp_async.distributed._plan_check import (
    STEP_DIFFERS,
    failure_kind,
    step_check_error,
    step_check_verdict,
)
from tests._pool import pooled_spawn

# ---------------------------------------------------------------------- pure


def _digest(
    rank: int,
    *,
    world: int = 2,
    microbatches: int = 8,
    hint: str = "1f1b",
    policy: str = "readiness_first",
    tp: int = 1,
) -> PlanDigest:
    plan = rr.StepPlan(topology=rr.Topology(stages=world // tp), microbatches=microbatches)
    layout = rr.ProcessLayout(pp=world // tp, tp=tp, rank=rank)
    d = PlanDigest.of(
        rr.StepSchedule.build(plan, hint),
        policy=policy,
        layout=layout,
        max_message_bytes=1 << 20,
    )
    return PlanDigest.decode(d.encode(), rank=rank)  # what the other ranks see


def test_a_digest_is_a_fixed_row_that_decodes_to_itself() -> None:
    d = _digest(1, policy="a_policy_with_a_name_far_longer_than_32_bytes")
    row = d.encode()
    assert all(isinstance(x, int) and -(1 << 63) <= x < (1 << 63) for x in row)
    assert d.policy == "a_policy_with_a_name_far_long..."  # as the other ranks see it
    assert PlanDigest.decode(row, rank=1) == d
    assert len(_digest(0, world=4, hint="gpipe").encode()) == len(row)
    with pytest.raises(rr.PlanError, match="global rank 3 sent no plan digest"):
        PlanDigest.decode([0, *row[1:]], rank=3)


def test_equal_plans_agree_and_differences_name_both_sides() -> None:
    assert plan_disagreement([_digest(0), _digest(1)]) is None
    why = plan_disagreement([_digest(0), _digest(1, microbatches=6)])
    assert why == "microbatches: rank 0 has microbatches=8; rank 1 has microbatches=6"
    why = plan_disagreement(
        [_digest(r, world=4, hint="gpipe" if r == 2 else "1f1b") for r in range(4)]
    )
    assert why == "hint: ranks 0, 1, 3 have hint='1f1b'; rank 2 has hint='gpipe'"
    # Names longer than the 32 bytes a row carries still differ (by the hash of the full ones).
    long = "p" * 40
    why = plan_disagreement([_digest(0, policy=long), _digest(1, policy=long + "x")])
    assert why is not None and "longer than 32 bytes" in why


def test_hint_orders_are_compared_within_a_replica_only() -> None:
    plan = rr.StepPlan(topology=rr.Topology(stages=2), microbatches=4)
    a = rr.StepSchedule.build(plan, "1f1b")
    b = rr.StepSchedule.build(plan, {0: list(reversed_f(a.hint[0])), 1: list(a.hint[1])})
    b = dataclasses.replace(b, hint_name="1f1b", bounds=a.bounds)

    def d(rank: int, sched: rr.StepSchedule, dp: int) -> PlanDigest:
        layout = rr.ProcessLayout(pp=2, dp=dp, rank=rank)
        d = PlanDigest.of(sched, policy="strict", layout=layout, max_message_bytes=1)
        return PlanDigest.decode(d.encode(), rank=rank)

    # Replicas 0 (ranks 0, 1) and 1 (ranks 2, 3) may order their steps differently.
    assert plan_disagreement([d(0, a, 2), d(1, a, 2), d(2, b, 2), d(3, b, 2)]) is None
    why = plan_disagreement([d(0, a, 2), d(1, b, 2), d(2, b, 2), d(3, b, 2)])
    assert why is not None
    assert why.startswith("in DP replica 0, hint_order: rank 0 has hint order #"), why
    assert "same microbatch sizes" in why


def test_task_stream_seeds_are_compared_within_a_tp_group_only() -> None:
    plan = rr.StepPlan(topology=rr.Topology(stages=2), microbatches=4)
    sched = rr.StepSchedule.build(plan, "1f1b")

    def d(rank: int, seed: int | None) -> PlanDigest:
        layout = rr.ProcessLayout(pp=2, tp=2, rank=rank)  # TP groups: ranks 0, 1 and 2, 3
        got = PlanDigest.of(
            sched, policy="strict", layout=layout, max_message_bytes=1, rng_seed=seed
        )
        return PlanDigest.decode(got.encode(), rank=rank)

    big = (1 << 64) - 5  # torch's seeds take 64 bits: the row keeps them whole
    assert d(0, big).rng_seed == big - (1 << 64)
    # Pipeline ranks may differ (a seed per rank); TP groups agree within themselves.
    assert plan_disagreement([d(0, 7), d(1, 7), d(2, big), d(3, big)]) is None
    why = plan_disagreement([d(0, 7), d(1, 7), d(2, big), d(3, 8)])
    assert why is not None
    assert why.startswith(
        f"in the TP group of pipeline rank 1 (DP replica 0), rng_seed: rank 2 has seed {big};"
        " rank 3 has seed 8"
    ), why
    assert "build their TorchStageExecutor with the same seed=" in why
    why = plan_disagreement([d(0, 7), d(1, None), d(2, 1), d(3, 1)])
    assert why is not None and "rank 1 has no per-task random streams (task_rng=False)" in why


def reversed_f(order: tuple[rr.Task, ...]) -> list[rr.Task]:
    """Rank 0's 1F1B order with its first two forwards swapped (still a valid hint)."""
    out = list(order)
    i, j = out.index(rr.Task(0, "F", 0)), out.index(rr.Task(0, "F", 1))
    out[i], out[j] = out[j], out[i]
    return out


def test_stage_defaults_are_finite_and_bounded() -> None:
    plan = rr.StepPlan(topology=rr.Topology(stages=1), microbatches=2)
    layout = rr.ProcessLayout(pp=1, rank=0)

    def stage(**kw: Any) -> rr.DistributedStage:
        sched = rr.StepSchedule.build(plan, "1f1b")
        return rr.DistributedStage(
            layout, sched, _Tiny(), groups=rr.distributed.StageGroups(), **kw
        )

    s = stage()
    assert s.step_timeout == 30.0 and s.stage.step_timeout == 30.0
    assert s.max_message_bytes == 256 << 20 and s.channel.max_bytes == 256 << 20
    assert stage(step_timeout=None, max_message_bytes=1 << 10).channel.max_bytes == 1 << 10
    with pytest.raises(rr.PlanError, match="max_message_bytes must be an int >= 1, got 0"):
        stage(max_message_bytes=0)
    with pytest.raises(rr.PlanError, match="step_timeout"):
        stage(step_timeout=-1.0)


def test_tp_without_the_plan_check_needs_a_given_seed() -> None:
    # Fails when verify_plan=False leaves TP ranks on their processes' own default seeds.
    plan = rr.StepPlan(topology=rr.Topology(stages=1), microbatches=2)
    layout = rr.ProcessLayout(pp=1, tp=2, rank=0)
    sched = rr.StepSchedule.build(plan, "1f1b")
    lin = torch.nn.Linear(2, 2)
    default = rr.TorchStageExecutor({0: lin})
    with pytest.raises(rr.PlanError, match=r"verify_plan=False\) with TP: .*seed=\.\.\."):
        rr.DistributedStage(
            layout, sched, default, groups=rr.distributed.StageGroups(), verify_plan=False
        )
    # A given seed passes that check (TP then needs a real group: construction goes on to
    # the decision channel, which asks the unset default group for its size).
    given = rr.TorchStageExecutor({0: lin}, seed=3)
    with pytest.raises(ValueError, match="Default process group has not been initialized"):
        rr.DistributedStage(
            layout, sched, given, groups=rr.distributed.StageGroups(), verify_plan=False
        )


def test_a_stage_runs_steps_only_while_open() -> None:
    plan = rr.StepPlan(topology=rr.Topology(stages=1), microbatches=2)
    layout = rr.ProcessLayout(pp=1, rank=0)
    sched = rr.StepSchedule.build(plan, "1f1b")
    stage = rr.DistributedStage(
        layout, sched, _Tiny(), groups=rr.distributed.StageGroups(), verify_plan=False
    )

    async def go() -> None:
        with pytest.raises(rr.errors.ClosedError, match="is not open yet"):
            await stage.run_step([0, 1])
        async with stage:
            stats = await stage.run_step([0, 1])
            assert [str(e.task) for e in stats.executed] == ["0F0", "0B0", "0F1", "0B1"]
        with pytest.raises(rr.errors.ClosedError, match="was closed"):
            await stage.run_step([0, 1])
        with pytest.raises(rr.errors.ClosedError, match="opened once"):
            async with stage:
                pass

    rr.run(go())


# ---------------------------------------------------------------------- multi-process


class _Tiny:
    async def execute(self, task: rr.Task, data: Any, ctx: rr.TaskContext, /) -> Any:
        await asyncio.sleep(0)
        return torch.full((2,), float(task.mb))


CASES: dict[str, dict[str, Any]] = {
    "microbatches": {"microbatches": 6},
    "hint": {"hint": "gpipe"},
    "policy": {"policy": "strict"},
}


async def _case(rank: int, world: int, case: str, odd: int, groups: Any) -> dict[str, Any]:
    """One case: rank ``odd`` deviates from the others as ``CASES[case]`` says."""
    cfg: dict[str, Any] = {"microbatches": 8, "hint": "1f1b", "policy": "readiness_first"}
    if rank == odd and case in CASES:
        cfg.update(CASES[case])
    layout = rr.ProcessLayout.from_world(pp=world)
    plan = rr.StepPlan(topology=rr.Topology(stages=world), microbatches=cfg["microbatches"])
    sched = rr.StepSchedule.build(plan, cfg["hint"])
    mbs = list(range(cfg["microbatches"]))
    out: dict[str, Any] = {}
    stage = rr.DistributedStage(
        layout, sched, _Tiny(), groups=groups, policy=cfg["policy"], step_timeout=30
    )
    try:
        async with stage:
            t0 = time.perf_counter()
            await stage.run_step(mbs)
            out["first_step"] = time.perf_counter() - t0
            if case == "match":
                times = []
                for _ in range(3):  # a new schedule object, same plan: no new check
                    t0 = time.perf_counter()
                    await stage.run_step(mbs, schedule=rr.StepSchedule.build(plan, "1f1b"))
                    times.append(time.perf_counter() - t0)
                out["later_steps"] = times
                out["checks_same_plan"] = stage.plan_checks
                await stage.run_step(mbs, schedule=rr.StepSchedule.build(plan, "gpipe"))
                out["checks_new_hint"] = stage.plan_checks
                costs = []
                for _ in range(5):  # the check itself, with every rank there at once
                    torch.distributed.barrier()
                    await stage.check_plan(step=99)
                    costs.append(stage.plan_check_seconds)
                out["check_costs"] = costs
    except rr.RRFPError as e:
        out["error"] = type(e).__name__
        out["message"] = str(e)
    out["check_seconds"] = stage.plan_check_seconds
    stage.channel.close(10.0)  # every peer sent its CLOSE: the listeners end
    return out


def _worker(rank: int, world: int, odd: int) -> dict[str, dict[str, Any]]:
    import torch.distributed as dist

    groups = rr.build_groups(rr.ProcessLayout.from_world(pp=world))
    res = {}
    for case in ["match", *CASES]:
        res[case] = rr.run(_case(rank, world, case, odd, groups))
        dist.barrier()
    return res


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("world", "odd"), [(2, 1), (4, 2)])
def test_every_rank_names_the_disagreement(world: int, odd: int) -> None:
    results = pooled_spawn(_worker, world, odd, timeout=200)
    rest = [r for r in range(world) if r != odd]
    others = f"rank {rest[0]} has" if len(rest) == 1 else f"ranks {', '.join(map(str, rest))} have"
    expect = {
        "microbatches": f"microbatches: {others} microbatches=8; rank {odd} has microbatches=6",
        "hint": f"hint: {others} hint='1f1b'; rank {odd} has hint='gpipe'",
        "policy": f"policy: {others} policy='readiness_first'; rank {odd} has policy='strict'",
    }
    for rank, res in enumerate(results):
        m = res["match"]
        assert "error" not in m, m
        # One check for the plan, one more when the hint changed; none for a new schedule
        # object of the same plan.
        assert m["checks_same_plan"] == 1 and m["checks_new_hint"] == 2, m
        for case, text in expect.items():
            r = res[case]
            assert r.get("error") == "PlanError", (rank, case, r)
            assert (
                f"rank {rank} (global {rank}) step 0: the ranks disagree on the plan"
                in (r["message"])
            )
            assert r["message"].endswith(text), (case, r["message"])
    cost_ms = sorted(1e3 * t for res in results for t in res["match"]["check_costs"])
    later_ms = sorted(1e3 * t for res in results for t in res["match"]["later_steps"])
    print(
        f"\n{world} ranks: plan check {cost_ms[len(cost_ms) // 2]:.2f} ms (median, ranks in"
        f" lockstep; max {cost_ms[-1]:.2f}); first step incl. check"
        f" {1e3 * results[0]['match']['first_step']:.1f} ms, later steps median"
        f" {later_ms[len(later_ms) // 2]:.1f} ms"
    )


def test_default_seeds_adopt_the_lowest_default_ranks_seed() -> None:
    plan = rr.StepPlan(topology=rr.Topology(stages=2), microbatches=4)
    sched = rr.StepSchedule.build(plan, "1f1b")

    def d(rank: int, seed: int | None, default: bool) -> PlanDigest:
        layout = rr.ProcessLayout(pp=2, tp=2, rank=rank)
        got = PlanDigest.of(
            sched,
            policy="strict",
            layout=layout,
            max_message_bytes=1,
            rng_seed=seed,
            seed_default=default,
        )
        return PlanDigest.decode(got.encode(), rank=rank)

    big = (1 << 64) - 5
    # Rank 0 gave its seed; the defaults (1, 2, 3) take rank 1's, the lowest default.
    rows, job = adopt_default_seed([d(0, 7, False), d(1, big, True), d(2, 3, True), d(3, 4, True)])
    assert job == big
    assert [r.rng_seed & ((1 << 64) - 1) for r in rows] == [7, big, big, big]
    # Given seeds are still compared: rank 0's 7 against rank 1's adopted seed.
    why = plan_disagreement(rows)
    assert why is not None and f"rank 0 has seed 7; rank 1 has seed {big}" in why, why
    rows, job = adopt_default_seed([d(r, 10 + r, True) for r in range(4)])
    assert job == 10 and plan_disagreement(rows) is None
    rows, job = adopt_default_seed([d(r, 5, False) for r in range(4)])
    assert job is None and [r.rng_seed for r in rows] == [5] * 4
    # task_rng=False: nothing to adopt, whatever the flag says.
    assert not d(0, None, True).seed_default


STEP_CASES: dict[str, tuple[int, int]] = {
    "fewer": (3, 4),  # rank 0's plan changes (3 microbatches), rank 1's does not
    "more": (4, 5),  # rank 1's changes
    "both": (3, 3),  # both change alike: a new plan, checked, and it runs
}


def _step_worker(rank: int, world: int, late_rows: float = 0.0) -> dict[str, Any]:
    """Step 0 with 4 microbatches everywhere, then each case's step 1 with
    ``STEP_CASES[case][rank]`` microbatches, then a step with 4 again. ``late_rows``: every
    rank reads the end-of-step agreement's rows (which carry the step check) that much
    later, so a peer's ABORT reaches it long before: the order a loaded machine gives at
    times."""
    if late_rows:
        from rrfp_async.distributed._control_group import ControlGroup

        rows = ControlGroup._agreement_rows

        async def later(self: Any, step: int, posted: Any) -> list[list[int]]:
            await asyncio.sleep(late_rows)
            return await rows(self, step, posted)

        ControlGroup._agreement_rows = later  # type: ignore[method-assign]
    layout = rr.ProcessLayout.from_world(pp=world)
    groups = rr.build_groups(layout)
    plan = rr.StepPlan(topology=rr.Topology(stages=world), microbatches=4)
    out: dict[str, Any] = {}

    async def go() -> None:
        stage = rr.DistributedStage(
            layout, rr.StepSchedule.build(plan, "1f1b"), _Tiny(), groups=groups, step_timeout=60
        )
        async with stage:
            await stage.run_step(list(range(4)))
            for case, counts in STEP_CASES.items():
                t0 = time.perf_counter()
                try:
                    stats = await stage.run_step(list(range(counts[rank])))
                    out[case] = ("ok", len(stats.executed))
                except rr.RRFPError as e:
                    out[case] = (type(e).__name__, str(e))
                out[case + "_seconds"] = time.perf_counter() - t0
                after = await stage.run_step(list(range(4)))  # the stage is usable again
                out[case + "_after"] = len(after.executed)
        stage.channel.close(10.0)

    rr.run(go())
    return out


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("late_rows", [0.0, 1.0], ids=["as_it_comes", "abort_first"])
def test_a_step_with_other_microbatch_counts_fails_at_once_on_every_rank(
    late_rows: float,
) -> None:
    # Fails without the step check: the rank whose plan changed waited alone in the plan
    # check and its peer for its messages, until the 60 s watchdog (StepTimeoutError); and
    # without the plan tag in the headers (the step check at the end of the step only), the
    # rank with more microbatches waits for the watchdog. abort_first: the ABORT of the rank
    # that saw the other plan reaches the other long before the agreement's rows; red before
    # a rank told so waited for the rows: it failed with a PeerStepError.
    r0, r1 = pooled_spawn(_step_worker, 2, late_rows, timeout=200)
    for case, step in (("fewer", 1), ("more", 3)):  # each case's step, then one after it
        a, b = STEP_CASES[case]
        for r in (r0, r1):
            kind, msg = r[case]
            # The step check's own PlanError on every rank (the one told by an ABORT too).
            assert kind == "StepDiffersError", (case, r[case])
            assert f"step {step}: the ranks do not run the same step" in msg, msg
            assert f"rank 0 has step {step}, {a} microbatches, training, plan #" in msg, msg
            assert f"rank 1 has step {step}, {b} microbatches, training, plan #" in msg, msg
            assert r[case + "_seconds"] < 30  # at once, not at the 60 s watchdog
            assert r[case + "_after"] == 2 * 4  # this rank's F and B of 4 microbatches
    for r in (r0, r1):  # both changed alike: the plan check ran and the step ran
        assert r["both"] == ("ok", 2 * 3), r["both"]


def _replica_worker(rank: int, world: int) -> dict[str, Any]:
    """PP 2 x DP 2: step 0 with 4 microbatches everywhere, then step 1 with 4 in replica 0
    and 3 in replica 1 (each pipeline consistent), then step 2 with 4 again."""
    layout = rr.ProcessLayout.from_world(pp=2)
    groups = rr.build_groups(layout)
    plan = rr.StepPlan(topology=rr.Topology(stages=2), microbatches=4)
    out: dict[str, Any] = {}

    async def go() -> None:
        stage = rr.DistributedStage(
            layout, rr.StepSchedule.build(plan, "1f1b"), _Tiny(), groups=groups, step_timeout=60
        )
        async with stage:
            await stage.run_step(list(range(4)))
            try:
                await stage.run_step(list(range(4 - layout.dp_rank)))
                out["step1"] = ("ok", "")
            except rr.RRFPError as e:
                out["step1"] = (type(e).__name__, str(e))
            out["step2"] = len((await stage.run_step(list(range(4)))).executed)
        stage.channel.close(10.0)

    rr.run(go())
    return out


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_replicas_given_other_microbatch_counts_fail_the_step_on_every_rank() -> None:
    # No rank waits here (each pipeline runs its own plan to the end): the end-of-step
    # agreement's rows fail the step on every rank before its gradients could be reduced.
    for r in pooled_spawn(_replica_worker, 4, timeout=200):
        kind, msg = r["step1"]
        assert kind == "StepDiffersError", r["step1"]
        assert "ranks 0, 1 have step 1, 4 microbatches, training" in msg, msg
        assert "ranks 2, 3 have step 1, 3 microbatches, training" in msg, msg
        assert r["step2"] == 2 * 4  # the stage runs the next step


async def test_a_peers_abort_waits_for_the_step_check_only_after_the_step_check_failed() -> None:
    """``step_check_error`` (a rank told by a peer's ABORT): it waits for its own step-check
    rows only when the peer failed on them — the ABORT's ``FailureKind.STEP_DIFFERS`` code of
    this step, never the cause's text; after any other cause, a ``PlanError`` of a task
    included (even one whose text reads like the step check's), it waits for nothing (a rank
    that never starts the step never posts its row)."""
    loop = asyncio.get_running_loop()
    never: asyncio.Future[None] = loop.create_future()  # a row that never comes
    differs_text = f"PlanError: rank 0 (global 0) step 3: {STEP_DIFFERS}: rank 0 has step 3"

    def told(cause: str, kind: FailureKind, step: int = 3) -> rr.PeerStepError:
        return rr.PeerStepError("told", step=step, origin=0, cause=cause, kind=kind)

    for e in (
        told("PlanError: rank 0 (global 0) step 3: a task refused its input", FailureKind.OTHER),
        told(differs_text, FailureKind.OTHER),  # the text alone decides nothing
        told(differs_text, FailureKind.STEP_DIFFERS, step=2),  # another step's
    ):
        assert await asyncio.wait_for(step_check_error(never, e, 3), 1.0) is None
    differ = rr.PlanError(f"rank 1 (global 1) step 3: {STEP_DIFFERS}: rank 0 has ...")
    rows: asyncio.Future[None] = loop.create_future()
    rows.set_exception(differ)
    mine = told("any text", FailureKind.STEP_DIFFERS)
    assert await step_check_error(rows, mine, 3) is differ
    agree: asyncio.Future[None] = loop.create_future()
    agree.set_result(None)
    assert await step_check_error(agree, mine, 3) is None
    never.cancel()


def test_only_the_step_checks_own_error_is_sent_as_step_differs() -> None:
    with pytest.raises(StepDiffersError) as err:
        step_check_verdict("rank 0", 3, [[3, 4, 1, 1, 1], [4, 4, 1, 1, 1]])
    assert isinstance(err.value, rr.PlanError) and STEP_DIFFERS in str(err.value)
    assert failure_kind(err.value) is FailureKind.STEP_DIFFERS
    # (by its type, never its text: any other PlanError is a misuse, issue 41)
    assert failure_kind(rr.PlanError(f"step 3: {STEP_DIFFERS}")) is FailureKind.PLAN
    assert failure_kind(RuntimeError("boom")) is FailureKind.OTHER


def test_a_plan_error_elsewhere_is_a_plan_error_here() -> None:
    # Issue 41: a misuse found on one rank (a batch that does not split, a data iterator
    # that ran dry) fails the step on every rank with a PlanError; the peers' is a
    # PeerStepError too (the stage stays usable), chosen by the ABORT's code.
    from rrfp_async._errors import PeerPlanError, PeerStepError, peer_step_error

    assert peer_step_error(FailureKind.PLAN) is PeerPlanError
    assert peer_step_error(FailureKind.OTHER) is PeerStepError
    assert peer_step_error(FailureKind.STEP_DIFFERS) is PeerStepError
    assert peer_step_error(99) is PeerStepError  # a code this rank does not know
    e = PeerPlanError("told", step=3, origin=0, cause="PlanError: x", kind=FailureKind.PLAN)
    assert isinstance(e, rr.PlanError) and isinstance(e, PeerStepError)
    assert failure_kind(e) is FailureKind.PLAN  # (relayed unchanged: its kind, PLAN)
