"""Per-rank trace files written with one argument (``TrainConfig(trace_dir=...)``,
``DistributedStage(trace_dir=...)``) and merged into one timeline (gloo, 127.0.0.1)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import rrfp_async as rr
import rrfp_lab as lab
from rrfp_async.cli import main
from rrfp_async.observability import load_trace, merge_trace_files, validate_chrome_trace
from tests._pool import pooled_spawn
from tests.distributed.test_groups import _schedule, _Tagged
from tests.distributed.test_sync_stage import _single


@pytest.fixture(autouse=True)
def _wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trace command's lines name long paths: off a terminal the console is $COLUMNS
    wide, and this wide it wraps none of them (the checks read whole lines)."""
    monkeypatch.setenv("COLUMNS", "1000")


# ---------------------------------------------------------------------- pure (one stage)


@pytest.mark.timeout(30)
def test_a_stage_writes_its_last_step_and_never_fails_a_step_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    plan = rr.StepPlan(topology=rr.Topology(stages=1), microbatches=2)
    sched = rr.StepSchedule.build(plan, "1f1b")
    layout = rr.ProcessLayout(pp=1, rank=0)
    stage = rr.DistributedStage(
        layout,
        sched,
        _single().stage.executor,
        groups=rr.distributed.StageGroups(),
        verify_plan=False,
        trace_dir=tmp_path / "t",
    )
    with stage:
        for step in range(2):
            stage.run_step_sync([0, 1])
            tr = load_trace(tmp_path / "t" / "rank0.json")
            steps = {e["args"]["step"] for e in tr["traceEvents"] if e["ph"] == "X"}
            names = sorted(e["name"] for e in tr["traceEvents"] if e["ph"] == "X")
            assert steps == {step}
            assert names == ["0B0", "0B1", "0F0", "0F1"]  # one step's tasks, not two
        assert tr["otherData"]["rrfp"]["policy"] == "readiness_first"
        # A write that fails is logged; the step goes on.
        import rrfp_async.distributed._stage_trace as mod

        def broken(*a: Any, **k: Any) -> None:
            raise OSError("disk full")

        monkeypatch.setattr(mod, "write_trace", broken)
        with caplog.at_level(logging.WARNING, logger="rrfp_async.distributed._stage_trace"):
            st = stage.run_step_sync([0, 1])
        assert st.step == 2
        assert "could not write its trace of step 2" in caplog.text and "disk full" in caplog.text
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(rr.PlanError, match="cannot create trace_dir"):
        rr.DistributedStage(
            layout,
            sched,
            _single().stage.executor,
            groups=rr.distributed.StageGroups(),
            trace_dir=blocker / "t",
        )


class _FailsOn:
    """``_Tiny``'s tasks, raising in one task of the steps named in ``steps``."""

    def __init__(self, steps: set[int]) -> None:
        self.steps = steps

    async def execute(self, task: rr.Task, data: Any, ctx: rr.TaskContext, /) -> Any:
        if ctx.step in self.steps and str(task) == "0B0":
            raise RuntimeError(f"boom in step {ctx.step}")
        return torch.full((2,), float(task.mb))


@pytest.mark.timeout(30)
def test_a_failed_step_never_replaces_the_last_good_trace(tmp_path: Path) -> None:
    """A failed step goes to failed-rank{r}.json; rank{r}.json keeps the last good step
    (before: a failing step overwrote it, so after a rank died the survivors' files held
    their failed steps, often empty, and no longer merged with the dead rank's)."""
    plan = rr.StepPlan(topology=rr.Topology(stages=1), microbatches=2)
    stage = rr.DistributedStage(
        rr.ProcessLayout(pp=1, rank=0),
        rr.StepSchedule.build(plan, "1f1b"),
        _FailsOn({1}),
        groups=rr.distributed.StageGroups(),
        verify_plan=False,
        trace_dir=tmp_path,
    )

    def steps_in(name: str, unfinished: bool = False) -> tuple[set[int], list[str]]:
        tr = json.loads((tmp_path / name).read_text())
        xs = [
            e
            for e in tr["traceEvents"]
            if e["ph"] == "X" and e["args"].get("unfinished", False) == unfinished
        ]
        return {e["args"]["step"] for e in xs}, sorted(e["name"] for e in xs)

    with stage:
        stage.run_step_sync([0, 1])
        with pytest.raises(RuntimeError, match="boom in step 1"):
            stage.run_step_sync([0, 1])
        assert steps_in("rank0.json") == ({0}, ["0B0", "0B1", "0F0", "0F1"])
        assert steps_in("failed-rank0.json") == ({1}, ["0F0"])  # what ran before it failed
        # The task that raised started and never ended: drawn unfinished, named in the
        # failure row that marks the file failed (issue 41).
        assert steps_in("failed-rank0.json", unfinished=True) == ({1}, ["0B0"])
        (fail,) = json.loads((tmp_path / "failed-rank0.json").read_text())["otherData"]["rrfp"][
            "failures"
        ]
        assert fail[:2] == [0, 1] and fail[3:5] == ["RuntimeError", "boom in step 1"]
        assert list(fail[5]) == ["0B0"]
        stage.run_step_sync([0, 1])
        assert steps_in("rank0.json")[0] == {2}
    # The directory's files are the good steps: what `rrfp-async trace DIR` merges.
    assert [p.name for p in rr.observability.trace_files([tmp_path])] == ["rank0.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["failed-rank0.json", "rank0.json"]


def test_train_config_trace_dir() -> None:
    cfg = lab.TrainConfig(pp=2, steps=3, warmup_steps=1, trace_dir="out/t")
    assert cfg.traced_steps == (3,)  # the last step, warm-up counted
    assert lab.TrainConfig(pp=2, steps=3, trace_dir="x", trace_steps=(0,)).traced_steps == (0,)
    assert lab.TrainConfig(pp=2).traced_steps == ()
    with pytest.raises(rr.PlanError, match="trace_dir must be a directory path"):
        lab.TrainConfig(pp=2, trace_dir=3)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- two processes


def _spans(tr: dict[str, Any]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for e in sorted((e for e in tr["traceEvents"] if e["ph"] == "X"), key=lambda e: e["ts"]):
        out.setdefault(e["pid"], []).append(e["name"])
    return out


def _cross_file_flows(tr: dict[str, Any], ranks: dict[int, Path]) -> int:
    """Flows whose two halves came from two different files."""
    ends: dict[int, dict[str, int]] = {}
    for e in tr["traceEvents"]:
        if e["ph"] in ("s", "f"):
            ends.setdefault(e["id"], {})[e["ph"]] = e["pid"]
    assert all(set(v) == {"s", "f"} for v in ends.values())
    return sum(ranks[v["s"]] != ranks[v["f"]] for v in ends.values())


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_training_writes_per_rank_traces_that_merge(tmp_path: Path) -> None:
    cfg = lab.TrainConfig(
        pp=2,
        microbatches=4,
        steps=2,
        policies=("readiness_first",),
        memory_factor=2.0,
        cost=lab.image_text_cost(per_token=1e-5, jitter=0.3),
        trace_dir=tmp_path / "traces",
        return_params=False,
    )
    results = pooled_spawn(lab.train_worker, 2, cfg, timeout=240)
    d = tmp_path / "traces" / "readiness_first"
    assert sorted(p.name for p in d.iterdir()) == ["rank0.json", "rank1.json"]
    with pytest.raises(rr.errors.TraceError, match="holds rank 0, and 8 of its messages"):
        load_trace(d / "rank0.json")
    out = tmp_path / "merged.json"
    res = CliRunner().invoke(main, ["trace", str(d), "-o", str(out), "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output)
    assert rep["merged"]["alignment"].startswith("one host")
    assert rep["merged"]["dropped"] == [] and rep["merged"]["causality_gap"] == 0.0
    tr = load_trace(out)
    assert validate_chrome_trace(tr) == []
    # Every task of every rank in the last step, in the order it ran there.
    spans = _spans(tr)
    for r in results:
        mine = r[0]
        assert spans[mine.rank] == [str(x.task) for x in mine.stats[-1].executed]
        assert rep["summary"]["ranks"][str(mine.rank)]["tasks"] == 2 * 4
    merged = merge_trace_files([d])
    assert _cross_file_flows(tr, merged.ranks) == 2 * 4  # F 0->1 and B 1->0 of 4 microbatches
    # The same step as the recording each process returned (TrainResult.trace).
    step = {s.step for r in results for s in r[0].trace.spans}  # type: ignore[union-attr]
    assert step == {1} and {s.step for s in merged.data.spans} == step


def _stage_worker(rank: int, world: int, trace_dir: str) -> list[list[str]]:
    layout = rr.ProcessLayout.from_world(pp=2)
    ex = _Tagged(1, delay=0.001)
    stage = rr.DistributedStage(
        layout, _schedule(4, "1f1b"), ex, step_timeout=60, trace_dir=trace_dir
    )

    async def go() -> list[list[str]]:
        out = []
        async with stage:
            for _ in range(3):
                st = await stage.run_step(list(range(4)))
                out.append([str(x.task) for x in st.executed])
        return out

    return rr.run(go())


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_distributed_stage_writes_per_rank_traces_that_merge(tmp_path: Path) -> None:
    executed = pooled_spawn(_stage_worker, 2, str(tmp_path / "t"), timeout=240)
    out = tmp_path / "merged.json"
    data = rr.observability.merge_traces([str(tmp_path / "t" / "rank*.json")], out=out)
    assert {s.step for s in data.spans} == {2}  # each file holds its rank's last step
    tr = load_trace(out)
    spans = _spans(tr)
    for rank in (0, 1):
        assert spans[rank] == executed[rank][-1]
    assert _cross_file_flows(tr, merge_trace_files([tmp_path / "t"]).ranks) == 2 * 4


# ------------------------------------------------------- a rank SIGKILLed mid-step (issue 41)

KILLED_AT = 3  # the step the victim dies in, after steps 0-2 ended well


class _DiesMidStep:
    """A few ms per task; rank 1 SIGKILLs itself as it starts 1F1 of step ``KILLED_AT``
    (1F0 done and sent on, the other microbatches not started)."""

    def __init__(self, victim: bool) -> None:
        self.victim = victim

    async def execute(self, task: rr.Task, data: Any, ctx: rr.TaskContext, /) -> Any:
        await asyncio.sleep(0.003)
        if self.victim and ctx.step == KILLED_AT and str(task) == "1F1":
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.full((4,), float(task.mb))


def _dies_worker(rank: int, world: int, trace_dir: str) -> None:
    layout = rr.ProcessLayout.from_world(pp=world)
    plan = rr.StepPlan(topology=rr.Topology(stages=world), microbatches=4)
    stage = rr.DistributedStage(
        layout,
        rr.StepSchedule.build(plan, "1f1b"),
        _DiesMidStep(rank == 1),
        step_timeout=20,
        trace_dir=trace_dir,
    )

    async def go() -> None:
        async with stage:
            for _ in range(KILLED_AT + 2):
                try:
                    await stage.run_step(list(range(4)))
                except Exception as e:  # the survivors: rank 1 is lost
                    # Whether the failed step's file is there the moment run_step raises
                    # (beside the trace directory: the job's result is lost with rank 1).
                    written = (Path(trace_dir) / f"failed-rank{rank}.json").exists()
                    seen = {"error": type(e).__name__, "written": written}
                    (Path(trace_dir).parent / f"seen{rank}.json").write_text(json.dumps(seen))
                    return

    rr.run(go())


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_rank_killed_mid_step_leaves_the_survivors_failed_step_and_the_trace_reads_it(
    tmp_path: Path,
) -> None:
    """Before: the survivors' failed-rank files held what they ran with nothing to say the
    step failed (no error, no marker), and `rrfp-async trace` on the directory showed the
    last good step; on the failed files it refused (rank 1's half is missing)."""
    d = tmp_path / "t"
    with pytest.raises(rr.errors.SpawnError) as ei:
        pooled_spawn(_dies_worker, 3, str(d), timeout=240, grace=60)
    assert set(ei.value.failures) == {1} and "-9" in ei.value.failures[1], ei.value.failures
    names = sorted(p.name for p in d.iterdir())
    assert names == [
        "failed-rank0.json",
        "failed-rank2.json",
        "rank0.json",
        "rank1.json",
        "rank2.json",
    ], names
    for r in (0, 2):
        seen = json.loads((tmp_path / f"seen{r}.json").read_text())
        assert seen == {"error": "PeerError", "written": True}, seen
        tr = json.loads((d / f"failed-rank{r}.json").read_text())
        meta = tr["otherData"]["rrfp"]
        (fail,) = meta["failures"]  # the marker: [rank, step, time, error, message, running]
        assert fail[:2] == [r, KILLED_AT] and fail[3] == "PeerError", fail
        assert "lost rank 1 (global 1)" in fail[4], fail
        assert meta["pipeline"] == [0, 1, 2]
        assert "(failed: PeerError)" in meta["title"]
        steps = {e["args"]["step"] for e in tr["traceEvents"] if e["ph"] in ("X", "s", "f")}
        assert steps <= {KILLED_AT}, steps
        marks = [e for e in tr["traceEvents"] if e.get("name") == "step failed"]
        assert [e["args"]["step"] for e in marks] == [KILLED_AT]
        # The last good step is kept: rank{r}.json holds step 2.
        good = json.loads((d / f"rank{r}.json").read_text())
        assert {e["args"]["step"] for e in good["traceEvents"] if e["ph"] == "X"} == {2}
    rank0 = json.loads((d / "failed-rank0.json").read_text())["traceEvents"]
    assert "0F0" in {e["name"] for e in rank0 if e["ph"] == "X"}  # what it ran of step 3
    # The command on the directory: the failed step, rank 1 named, ranks 0 and 2 shown.
    res = CliRunner().invoke(main, ["trace", str(d)])
    assert res.exit_code == 3, res.output
    assert "Traceback" not in res.output
    assert f"the failed step {KILLED_AT} (failed-rank*.json)" in res.output
    assert "trace file of rank 1 is missing" in res.output
    assert "merged 2 files (ranks 0, 2)" in res.output
    for r in (0, 2):
        assert f"rank {r}: step {KILLED_AT} FAILED" in res.output
    res = CliRunner().invoke(main, ["trace", str(d), "--json"])
    assert res.exit_code == 3, res.output
    rep = json.loads(res.stdout)
    assert rep["complete"] is False and rep["merged"]["missing"] == [1]
    assert sorted(rep["summary"]["ranks"]) == ["0", "2"]
    assert [(f["rank"], f["step"]) for f in rep["failures"]] == [(0, KILLED_AT), (2, KILLED_AT)]
    # The last good step still merges whole.
    res = CliRunner().invoke(main, ["trace", str(d / "rank*.json")])
    assert res.exit_code == 0 and "merged 3 files (ranks 0, 1, 2)" in res.output, res.output
