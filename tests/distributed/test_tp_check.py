"""The end-of-step TP sequence check, folded into the decisions (the default) or as an
all-gather: a follower that runs another sequence than its leader's is caught in that very
step, on every TP rank, and the next step runs.

The divergence is injected on the follower (TP rank 1) of a PP 1 x TP 2 stage: in step 1 it
runs the leader's first two decisions swapped (both forwards are ready and admitted, so
every per-decision check passes). Without the check the step would end "well" on both ranks
(the ``unchecked`` case shows it: the test is not vacuous). These cases switch the
followers' deduction off (``deduce_tp=False``): on one stage every decision is deducible,
and the follower would catch the swap at once. The ``deduced`` case shows that: the
follower's own deduction disagrees with the (swapped) decision it reads.
"""

from __future__ import annotations

from typing import Any

import pytest

import rrfp_async as rr
from tests._pool import pooled_spawn

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

M, STEPS, BAD = 4, 3, 1


class _Noop:
    async def execute(self, task: rr.Task, data: Any, ctx: Any, /) -> Any:
        return None


def _job(rank: int, world: int, mode: str) -> dict[str, Any]:
    layout = rr.ProcessLayout.from_world(pp=1, tp=2)
    plan = rr.StepPlan(topology=rr.Topology(stages=1), microbatches=M)
    sched = rr.StepSchedule.build(plan, "gpipe", max_inflight=M)  # the first two: 0F0, 0F1
    out: dict[str, Any] = {"ok": [], "errors": {}, "executed": {}}

    async def main() -> None:
        async with rr.DistributedStage(
            layout,
            sched,
            _Noop(),
            policy="strict",
            step_timeout=30,
            verify_tp=mode != "unchecked",
            fold_tp_check=mode in ("folded", "deduced"),
            deduce_tp=mode == "deduced",
        ) as stage:
            ch = stage.decisions
            assert ch is not None
            out["fold"] = ch.fold_check
            if rank == 1:
                orig = ch.receive
                held: list[rr.Task] = []

                async def swapped(step: int, seq: int) -> rr.Task:
                    if step == BAD and seq == 0:
                        first = await orig(step, 0)
                        held.append(first)
                        return await orig(step, 1)
                    if step == BAD and seq == 1:
                        return held.pop()
                    return await orig(step, seq)

                ch.receive = swapped  # type: ignore[method-assign]
            for k in range(STEPS):
                try:
                    st = await stage.run_step(list(range(M)))
                except rr.RRFPError as e:
                    origin = e.origin if isinstance(e, rr.PeerStepError) else None
                    out["errors"][k] = (type(e).__name__, origin, str(e))
                    continue
                out["ok"].append(k)
                out["executed"][k] = [str(e.task) for e in st.executed]

    rr.run(main())
    return out


@pytest.mark.parametrize("mode", ["folded", "gather", "unchecked", "deduced"])
def test_a_divergent_tp_sequence_is_caught_in_its_step(mode: str) -> None:
    leader, follower = pooled_spawn(_job, 2, mode, timeout=240)
    assert leader["fold"] is follower["fold"] is (mode in ("folded", "deduced"))
    if mode == "deduced":
        for got in (leader, follower):
            assert got["ok"] == [0, 2], got  # caught in step 1 exactly; step 2 runs
        kind, _, text = follower["errors"][BAD]
        assert kind == "DivergenceError", follower
        assert "deduced decision 0 as 0F0" in text and "the TP leader decided 0F1" in text
        assert leader["errors"][BAD][:2] == ("PeerStepError", 1), leader
        return
    if mode == "unchecked":
        # Not vacuous: the swap really made the sequences differ, and nothing noticed.
        assert leader["ok"] == follower["ok"] == [0, 1, 2], (leader, follower)
        assert leader["executed"][BAD][:2] == ["0F0", "0F1"]
        assert follower["executed"][BAD][:2] == ["0F1", "0F0"]
        return
    for got in (leader, follower):
        assert got["ok"] == [0, 2], got  # caught in step 1 exactly; step 2 runs
    kind, _, text = follower["errors"][BAD]
    assert kind == "DivergenceError", follower
    assert "executed different task sequences" in text
    if mode == "folded":
        # The leader ran the sequence it published: it learns of the follower's divergence
        # from the end-of-step agreement, which names the follower (global rank 1).
        assert leader["errors"][BAD][:2] == ("PeerStepError", 1), leader
    else:
        assert leader["errors"][BAD][0] == "DivergenceError", leader
