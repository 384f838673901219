"""The parts of ``DistributedStage``, each built alone with its collaborators passed in: no
processes, no torch.distributed (fake collectives, channels and decision channels).

``ControlGroup`` (the plan check, the step check, the end-of-step agreement),
``FailureReporter`` (telling a failed step, naming what it waited for), ``StageTrace``,
``BlockingFace``, ``TiedGradients`` and ``TPOptions``."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

import rrfp_async as rr
from rrfp_async._errors import FailureKind, StateNote, StepDiffersError
from rrfp_async.distributed import TPOptions
from rrfp_async.distributed._control_group import ControlGroup
from rrfp_async.distributed._digest import PlanDigest
from rrfp_async.distributed._plan_check import STEP_DIFFERS, step_row
from rrfp_async.distributed._stage_trace import StageTrace
from rrfp_async.distributed._step_failure import FailureReporter, failure_cause
from rrfp_async.distributed._sync_face import BlockingFace
from rrfp_async.distributed._tp_keywords import UNSET, tp_options

pytestmark = pytest.mark.timeout(30)


def _sched(stages: int = 2, mbs: int = 2) -> rr.StepSchedule:
    plan = rr.StepPlan(topology=rr.Topology(stages=stages), microbatches=mbs)
    return rr.StepSchedule.build(plan, "1f1b")


class _Done:
    """A completed ``Work``: its future has a result."""

    def get_future(self) -> torch.futures.Future[None]:
        fut: torch.futures.Future[None] = torch.futures.Future()
        fut.set_result(None)
        return fut


class FakeCollectives:
    """Two ranks; this one is ``me``. ``others(row)`` gives the other rank's row of an
    all-gather (a plan check's digest, or the end-of-step agreement's 7 fields)."""

    def __init__(self, me: int, others: Callable[[list[int]], list[int]]) -> None:
        self.me = me
        self.others = others
        self.gathers: list[list[int]] = []

    def size(self) -> int:
        return 2

    def row(self, values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.int64)

    def all_gather(self, outs: list[torch.Tensor], row: torch.Tensor) -> Any:
        mine = row.tolist()
        self.gathers.append(mine)
        outs[self.me].copy_(row)
        outs[1 - self.me].copy_(torch.tensor(self.others(mine), dtype=torch.int64))
        return _Done()

    @property
    def agreements(self) -> list[list[int]]:
        """The agreements posted: ``[step, microbatches, plan, train, changed, failed,
        global rank]``."""
        return [g for g in self.gathers if len(g) == 7]


def _as_rank0(row: list[int], **fields: int) -> list[int]:
    """Global rank 0's agreement row: this rank's, with ``fields`` replaced (a plan
    check's digest: the same as this rank's)."""
    if len(row) != 7:
        return row
    names = ["step", "microbatches", "plan", "train", "changed", "failed", "rank"]
    out = [*row[:6], 0]
    for k, v in fields.items():
        out[names.index(k)] = v
    return out


def _digest(seed: int, *, default: bool, rank: int = 0) -> PlanDigest:
    return PlanDigest.of(
        _sched(),
        policy="readiness_first",
        layout=rr.ProcessLayout(pp=2, rank=rank),
        max_message_bytes=1 << 20,
        rng_seed=seed,
        seed_default=default,
    )


def _control(
    comm: FakeCollectives, *, seed: int = 22, silent: Any = None
) -> tuple[ControlGroup, list[int], list[tuple[int, BaseException]]]:
    adopted: list[int] = []
    aborted: list[tuple[int, BaseException]] = []
    control = ControlGroup(
        comm,
        who="rank 1 (global 1)",
        rank=1,
        world_size=2,
        timeout=5.0,
        verify_plan=True,
        agree_steps=True,
        digest_of=lambda s: _digest(seed, default=True, rank=1),
        adopt_seed=adopted.append,
        silent=silent,
    )
    return control, adopted, aborted


async def test_the_control_group_checks_a_new_plan_and_adopts_the_jobs_seed() -> None:
    theirs = _digest(11, default=True).encode()
    comm = FakeCollectives(1, lambda row: theirs if len(row) == len(theirs) else _as_rank0(row))
    control, adopted, _ = _control(comm)
    sched = _sched()
    assert control.plan_changed(sched)
    await control.begin_step(0, sched)  # a stage's first step: the plan check runs before it
    assert control.plan_checks == 1 and not control.plan_changed(sched)
    assert adopted == [11]  # the lowest rank's default seed is the job's
    assert [len(g) for g in comm.gathers] == [len(theirs)]  # no collective beside the step
    await control.end_step(0)
    row = step_row(0, sched, changed=True)
    assert comm.agreements == [[*row, 0, 1]]  # one collective: the step check's row, not failed
    assert control.plan_checks == 1  # checked before it ran: not again
    control.finish_step()
    await control.begin_step(1, sched)
    await control.end_step(1)
    assert len(comm.gathers) == 3  # one collective a step
    control.finish_step()


async def test_the_agreement_names_each_ranks_step_when_the_steps_differ() -> None:
    sched = _sched()
    comm = FakeCollectives(1, lambda row: _as_rank0(row, microbatches=3, changed=0))
    control, _, _ = _control(comm)
    await control.begin_step(0, sched)  # (the plan check: every digest alike)
    with pytest.raises(StepDiffersError, match=STEP_DIFFERS) as err:
        await control.end_step(0)
    assert "rank 0 has step 0, 3 microbatches" in str(err.value)
    assert "rank 1 has step 0, 2 microbatches" in str(err.value)
    control.fail_step(can_agree=True)  # posted already: once per step
    assert len(comm.agreements) == 1
    assert await control.failed_step_error(0, err.value) is None  # it is the verdict itself
    control.finish_step()


async def test_a_new_plan_on_every_rank_is_checked_after_its_agreement() -> None:
    comm = FakeCollectives(1, _as_rank0)
    control, _, _ = _control(comm)
    await control.begin_step(0, _sched())
    await control.end_step(0)
    control.finish_step()
    new = _sched(mbs=3)
    assert control.plan_changed(new)
    await control.begin_step(1, new)  # not checked before it runs: a rank cannot know
    assert control.plan_checks == 1 and len(comm.gathers) == 2
    await control.end_step(1)  # every row changed alike: the plan check follows
    assert control.plan_checks == 2 and not control.plan_changed(new)
    control.finish_step()
    # Only this rank's plan changed: the rows differ, and no plan check is posted.
    comm.others = lambda row: _as_rank0(
        row, microbatches=3, plan=step_row(0, new, changed=False)[2], changed=0
    )
    await control.begin_step(2, _sched(mbs=4))
    with pytest.raises(StepDiffersError, match="rank 1 has step 2, 4 microbatches"):
        await control.end_step(2)
    assert control.plan_checks == 2
    control.finish_step()


async def test_a_rank_told_of_another_plan_raises_every_ranks_rows() -> None:
    """The rank that received a message of another plan fails the step with a
    ``StepDiffersError`` that names its neighbour only; every rank (it, and those told by its
    ABORT) then reads the agreement's rows for the error that names every rank's side."""
    sched = _sched()
    comm = FakeCollectives(1, lambda row: _as_rank0(row))
    control, _, _ = _control(comm)
    await control.begin_step(0, sched)
    await control.end_step(0)
    control.finish_step()
    comm.others = lambda row: _as_rank0(row, microbatches=3, failed=1)
    own = StepDiffersError("rank 1 (global 1) step 1: ...: pipeline rank 0 sent a message")
    told = rr.PeerStepError("told", step=1, origin=0, cause="x", kind=FailureKind.STEP_DIFFERS)
    other = rr.PeerStepError("told", step=1, origin=0, cause="x", kind=FailureKind.OTHER)
    for e in (own, told):
        await control.begin_step(1, sched)
        control.fail_step(can_agree=True)
        assert comm.agreements[-1][5:] == [1, 1]  # posted as failed, once
        verdict = await control.failed_step_error(1, e)
        assert isinstance(verdict, StepDiffersError)
        assert "rank 0 has step 1, 3 microbatches" in str(verdict)
        control.finish_step()
    await control.begin_step(1, sched)
    control.fail_step(can_agree=True)
    assert await control.failed_step_error(1, other) is None  # another cause: no wait
    control.finish_step()


async def test_the_agreement_fails_a_step_that_failed_on_another_rank() -> None:
    comm = FakeCollectives(1, _as_rank0)
    control, _, _ = _control(comm)
    await control.begin_step(0, _sched())
    comm.others = lambda row: _as_rank0(row, failed=1)  # global rank 0's step failed
    with pytest.raises(rr.PeerStepError, match="step 0 failed on global rank 0") as err:
        await control.end_step(0)
    assert err.value.origin == 0
    control.fail_step(can_agree=True)  # posted already: not again
    assert len(comm.agreements) == 1
    control.finish_step()


class FakeChannel:
    def __init__(self) -> None:
        self.aborts: list[tuple[int, str, int | None]] = []
        self.kinds: list[int] = []
        self.blamed: list[tuple[int, list[int]]] = []
        self.got: dict[int, int] = {}

    def abort(self, step: int, cause: str, *, origin: int | None = None, kind: int = 0) -> bool:
        self.aborts.append((step, cause, origin))
        self.kinds.append(kind)
        return True

    def arrivals(self, step: int) -> dict[int, int]:
        return dict(self.got)

    def blame(self, step: int, ranks: Iterable[int]) -> None:
        self.blamed.append((step, list(ranks)))

    def blame_global(self, step: int, ranks: Iterable[int], how: str) -> None:
        self.rooted = (step, list(ranks), how)

    def peer_failures(self) -> dict[int, str]:
        return {}

    def policy_stuck(self, step: int) -> None:
        self.stuck = step

    async def stuck_policy(self, step: int, wait: float) -> tuple[int, str] | None:
        return None


class FakeDecisions:
    waiting: str | None = None

    def __init__(self) -> None:
        self.aborts: list[tuple[int, int]] = []

    def abort(self, step: int, origin: int) -> None:
        self.aborts.append((step, origin))


def _reporter(
    channel: FakeChannel,
    decisions: FakeDecisions | None = None,
    *,
    silent: list[int] | None = None,
    notes: dict[int, str] | None = None,
) -> tuple[FailureReporter, list[str]]:
    dumps: list[str] = []

    async def ask_silent() -> list[int] | None:
        return silent

    async def ask_notes(steps: list[int | str]) -> dict[int, str] | None:
        return notes

    reporter = FailureReporter(
        channel,
        decisions,
        who="rank 1 (global 3)",
        rank=3,
        pp_rank=1,
        peers={0: 2, 1: 3},
        step_timeout=7.0,
        schedule=_sched,
        dump=dumps.append,
        silent=ask_silent,
        notes=ask_notes,
    )
    return reporter, dumps


def test_the_failure_reporter_tells_a_failed_step_once() -> None:
    channel, decisions = FakeChannel(), FakeDecisions()
    reporter, _ = _reporter(channel, decisions)
    e = RuntimeError("boom\nsecond line")
    e.add_note("in task 1F0")
    reporter.tell(4, e)
    reporter.tell_once(4, e)  # the stage told it already
    assert channel.aborts == [(4, "RuntimeError: boom [in task 1F0]", None)]
    assert channel.kinds == [FailureKind.OTHER]
    assert decisions.aborts == [(4, 3)]  # the TP leader tells its followers, naming itself
    assert reporter.told(4)


def test_a_peers_failure_is_passed_on_and_a_lost_peer_is_not_aborted() -> None:
    channel = FakeChannel()
    reporter, _ = _reporter(channel)
    peer = rr.PeerStepError("step 2 failed", step=2, origin=0, cause="ValueError: x")
    reporter.tell(2, peer)
    assert channel.aborts == [(2, "ValueError: x", 0)]
    assert channel.kinds == [FailureKind.OTHER]  # the peer's kind, passed on
    reporter.tell(3, rr.errors.PeerError("rank 1 lost rank 0 (global 2)"))
    assert len(channel.aborts) == 1  # the CLOSE tells a lost peer, not an ABORT


def test_a_timeout_names_the_ranks_whose_messages_did_not_come() -> None:
    channel = FakeChannel()
    channel.got = {0: 1}  # one of rank 0's two forwards arrived
    reporter, dumps = _reporter(channel)
    e = rr.StepTimeoutError("watchdog")
    reporter.tell(5, e)
    text = str(e)
    assert text.startswith("rank 1 (global 3) step 5: timed out after 7.0 s waiting for rank 0")
    assert "global 2; 1 of its 2 messages of the step missing" in text
    assert channel.blamed == [(5, [0])]
    assert dumps == ["step 5 timed out"]


def test_a_timeout_opens_with_a_silent_rank_further_away_and_the_close_names_it() -> None:
    """Rank 0 (global 2) is waited for; global rank 7 stopped beating: the root, named first
    and recorded for this rank's CLOSE (red before: the message named only rank 0)."""
    channel = FakeChannel()
    reporter, _ = _reporter(channel, silent=[7, 3])  # (itself, 3, is never named)
    e = rr.StepTimeoutError("watchdog")
    reporter.tell(5, e)
    asyncio.run(reporter.name_root(5, e))
    first = str(e).splitlines()[0]
    assert first.startswith("rank 1 (global 3) step 5: timed out after 7.0 s: global rank 7")
    assert "stopped responding" in first and "this rank waited for rank 0 (global 2;" in first
    assert channel.rooted == (5, [7], "timed_out")


def test_a_timeout_abort_is_resolved_to_the_rank_that_failed_by_itself() -> None:
    """A peer's ABORT of kind TIMEOUT (it waited too) is not the root: the board's note of
    the rank that failed by itself is (red before: the peer's timeout was named)."""
    channel = FakeChannel()
    reporter, _ = _reporter(channel, notes={2: "StepTimeoutError: rank 0 step 5: the policy"})
    e = rr.PeerStepError(
        "step 5 failed on rank 9",
        step=5,
        origin=9,
        cause="StepTimeoutError: waited",
        kind=FailureKind.TIMEOUT,
    )
    asyncio.run(reporter.name_root(5, e))
    first = str(e).splitlines()[0]
    assert first.startswith("rank 1 (global 3) step 5: rank 0 (global 2) failed by itself"), first
    assert "global rank 9 timed out waiting and told this rank" in first
    assert channel.rooted == (5, [2], "failed")


def test_the_stage_trace_writes_one_file_per_step(tmp_path: Path) -> None:
    trace = StageTrace(
        tmp_path / "t",
        emulated_gpu_time=None,
        executor=object(),
        rank=3,
        peers={0: 2, 1: 3},
        who="rank 1 (global 3)",
    )
    assert trace.observer(None) is not None and not trace.emulated
    trace.begin_step()
    trace.write(0, _sched(), policy="readiness_first")
    trace.write(1, _sched(), policy="readiness_first", failure=ValueError("x"), at=2.0)
    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == [
        "failed-rank3.json",
        "rank3.json",
    ]
    meta = json.loads((tmp_path / "t" / "failed-rank3.json").read_text())["otherData"]["rrfp"]
    assert meta["failures"] == [[3, 1, 0.0, "ValueError", "x", {}]]  # (t0: the failure)
    assert (
        meta["pipeline"] == [2, 3]
        and meta["title"] == "rank 1 (global 3), step 1 (failed: ValueError)"
    )
    off = StageTrace(None, emulated_gpu_time=True, executor=object(), rank=0, peers={}, who="")
    assert off.observer(None) is None and off.emulated and off.trace_dir is None
    off.write(0, _sched(), policy="x")  # nothing to write
    with pytest.raises(rr.PlanError, match="emulated_gpu_time must be a bool"):
        StageTrace(None, emulated_gpu_time=1, executor=object(), rank=0, peers={}, who="")  # type: ignore[arg-type]


def test_the_blocking_face_runs_coroutines_on_a_thread_of_its_own() -> None:
    seen: list[str] = []

    async def aenter() -> None:
        seen.append(threading.current_thread().name)

    async def add(a: int, *, b: int) -> int:
        await asyncio.sleep(0)
        return a + b

    async def aexit(*exc: object) -> None:
        seen.append("closed")

    face = BlockingFace.open(aenter)
    assert seen and seen[0] != threading.current_thread().name
    assert face.call(add, 2, b=3) == 5
    face.close(aexit, None, None, None)
    assert seen[-1] == "closed"

    async def refuse() -> None:
        raise rr.errors.ClosedError("no")

    with pytest.raises(rr.errors.ClosedError, match="no"):
        BlockingFace.open(refuse)  # its thread is stopped, the error raised as it is


def test_tp_options_are_validated_and_said_once() -> None:
    assert TPOptions() == TPOptions(coordinate=True, verify=True, fold_check=True, deduce=True)
    with pytest.raises(rr.PlanError, match=r"TPOptions.deduce must be True or False"):
        TPOptions(deduce="no")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        TPOptions(True)  # type: ignore[misc]  # keyword-only
    assert tp_options(None, "s", coordinate_tp=UNSET, deduce_tp=False) == TPOptions(deduce=False)
    with pytest.raises(rr.PlanError, match=r"both tp= and deduce_tp= are given"):
        tp_options(TPOptions(), "s", coordinate_tp=UNSET, deduce_tp=False)
    with pytest.raises(rr.PlanError, match=r"verify_tp must be True or False"):
        tp_options(None, "s", verify_tp=1)
    with pytest.raises(rr.PlanError, match=r"tp must be a TPOptions"):
        tp_options({"deduce": False}, "s")  # type: ignore[arg-type]


class _Plain:
    async def execute(self, task: Any, data: Any, ctx: Any) -> Any:
        return data


def test_the_stage_refuses_tp_options_said_twice() -> None:
    sched = _sched(stages=1)
    ex = _Plain()
    with pytest.raises(rr.PlanError, match=r"both tp= and verify_tp=, deduce_tp= are given"):
        rr.DistributedStage(
            rr.ProcessLayout(pp=1, rank=0),
            sched,
            ex,
            groups=rr.distributed.StageGroups(),
            tp=TPOptions(),
            verify_tp=True,
            deduce_tp=False,
        )


def test_the_cause_sent_to_peers_leaves_out_the_state_dump_by_its_type() -> None:
    """A peer is told the error and its notes, not this rank's state dump: the dump is a
    ``StateNote``, recognised by its type; a user's note that merely reads like one stays."""
    e = RuntimeError("boom")
    e.add_note("in task 1F0")
    e.add_note(StateNote("state of rank 1 when the step failed:\nready: 1B0"))
    e.add_note("state of rank 3 (a user's own note)")
    assert failure_cause(e) == (
        "RuntimeError: boom [in task 1F0; state of rank 3 (a user's own note)]"
    )


async def test_a_collectives_timeout_says_whether_the_heartbeats_could_be_read() -> None:
    """No rank silent: "no rank's heartbeat stopped"; no answer from the board (no pulse,
    or its store did not answer): it says the heartbeats could not be read."""

    async def nobody_silent() -> list[int] | None:
        return []

    def control(silent: Any) -> ControlGroup:
        return _control(FakeCollectives(1, _as_rank0), silent=silent)[0]

    read = await control(nobody_silent)._timed_out(3, "in the end-of-step agreement")
    assert read.endswith("a rank is hung, stopped or lost (no rank's heartbeat stopped)")
    unread = await control(None)._timed_out(3, "in the end-of-step agreement")
    assert unread.endswith("(the job's heartbeats could not be read)")
