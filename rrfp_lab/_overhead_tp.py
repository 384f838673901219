"""``bench overhead``, TP coordination: one TP decision through ``channels.DecisionChannel``
(leader publishes, followers receive) against a raw blocking ``dist.broadcast`` of the same
``int64[6]`` on the same group, TP = 2 and 4 processes; plus the coordination measured
inside a real ``DistributedStage`` (coordinated vs uncoordinated step time), and the share of
step time for tasks of ``compute_ms``. One ``spawn`` job per TP size (gloo on 127.0.0.1,
one torch thread per process).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from typing import Any

from rrfp_async.loop import ComputeWorker

from ._overhead_common import Row, median_of, transport_figures

__all__ = [
    "TP_MODEL_TOLERANCE",
    "TP_SHARE_TARGET",
    "TP_STEP_SHARE_TARGET",
    "TP_TARGET_RATIO",
    "tp_coordination",
    "tp_model",
]

TP_TARGET_RATIO = 1.25
"""Target: TP coordination per decision at most this times a raw blocking broadcast."""
TP_SHARE_TARGET = 0.01
"""Target: TP coordination under this share of step time (tasks of 5 ms or more)."""
TP_STEP_SHARE_TARGET = 0.02
"""Target: per-step TP coordination at TP 8 with 5 ms tasks under this share of step time."""
TP_MODEL_TOLERANCE = 0.25
"""Target: the model's leave-one-out prediction within this of the measurement (TP 2/4/8)."""


class _SleepExecutor:
    """Each task sleeps ``seconds`` on a compute thread, the way ``TorchStageExecutor`` emulates
    GPU time (0: returns at once, no thread).

    Not ``asyncio.sleep`` on the loop: the loop's timers have millisecond resolution (epoll;
    libuv), so a 5 ms wait ends up to 1 ms late whenever anything else wakes the loop in
    between, and TP coordination, which wakes it (a decision arriving, a send), would be
    charged that rounding: a timeline of a TP = 2 stage gave 5.48 / 5.34 ms per 5 ms wait
    coordinated against 5.23 / 5.24 ms uncoordinated that way, and 5.32 / 5.32 against
    5.32 / 5.33 ms with the wait on a compute thread.
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.worker = ComputeWorker(name="rrfp-bench-tp") if seconds > 0 else None

    async def execute(self, task: Any, data: Any, ctx: Any, /) -> Any:
        if self.worker is not None:
            await self.worker.run(time.sleep, self.seconds)
        return None

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


_VARIANTS = ("off", "dec", "gather", "wait", "on")
"""Stages run side by side, steps alternating: ``off`` no TP coordination at all
(``coordinate_tp=False, verify_tp=False``), ``dec`` decisions only (``verify_tp=False``),
``gather`` decisions and the end-of-step sequence check as an all-gather
(``fold_tp_check=False``), ``wait`` decisions and the folded check, every decision waited
for (``deduce_tp=False``), ``on`` the default (the followers deduce what they can). ``dec``
and ``gather`` wait for every decision too: with ``wait`` they price the decision path, the
one a task with an input message takes. On this benchmark's single stage every input is
local, so ``on`` deduces every decision (see ``StageLoop``'s "Deduced TP decisions")."""


class _TimedSleepExecutor(_SleepExecutor):
    """``_SleepExecutor`` that notes, per step, when its first task started and its last
    task ended (``perf_counter``)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(seconds)
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}

    async def execute(self, task: Any, data: Any, ctx: Any, /) -> Any:
        self.first.setdefault(ctx.step, time.perf_counter())
        out = await super().execute(task, data, ctx)
        self.last[ctx.step] = time.perf_counter()
        return out


def _tp_rank(
    rank: int,
    world: int,
    n: int,
    batches: int,
    computes: Sequence[float],
    microbatches: int,
    steps: int,
) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from rrfp_async import StepPlan, Task, Topology
    from rrfp_async.channels import DecisionChannel
    from rrfp_async.distributed import DistributedStage, ProcessLayout, build_groups
    from rrfp_async.loop import loop_factory
    from rrfp_async.policies import StepSchedule

    layout = ProcessLayout.from_world(pp=1, tp=world)
    groups = build_groups(layout)
    # The decisions-only stage runs beside the default one: a decision group of its own
    # (a follower's listener takes every decision sent on its group).
    groups_of = {"off": groups, "on": groups, "dec": build_groups(layout)}
    groups_of["gather"] = build_groups(layout)
    groups_of["wait"] = build_groups(layout)
    group = groups.decisions
    leader = layout.tp_ranks()[0]
    buf = torch.zeros(6, dtype=torch.int64)  # the size of a decision

    def raw_batch() -> float:
        dist.barrier(group=group)
        t = time.perf_counter()
        for _ in range(n):
            dist.broadcast(buf, src=leader, group=group)
        return time.perf_counter() - t

    plan = StepPlan(topology=Topology(stages=1), microbatches=microbatches)
    sched = StepSchedule.build(plan, "1f1b")
    mbs = list(range(microbatches))

    async def main() -> dict[str, Any]:
        raw: list[float] = []
        chan: list[float] = []
        published = 0
        if world > 1:
            ch = DecisionChannel(
                group, leader=leader, rank=layout.rank, tp_rank=layout.tp_rank, stage=0
            )
            step = 0

            async def channel_batch() -> float:
                nonlocal step
                dist.barrier(group=group)
                t = time.perf_counter()
                ch.begin_step(step, n)
                if ch.is_leader:
                    for seq in range(n):
                        ch.publish(step, seq, Task(0, "F", seq))
                    await ch.end_step()
                else:
                    for seq in range(n):
                        got = await ch.receive(step, seq)
                        if got.mb != seq:
                            raise RuntimeError(f"decision {seq} carried {got}")
                step += 1
                return time.perf_counter() - t

            raw_batch()
            await channel_batch()
            for _ in range(batches):
                raw.append(raw_batch())
                chan.append(await channel_batch())
            # The stages below get channels of their own on the same group.
            await asyncio.get_running_loop().run_in_executor(None, ch.close)
            published = ch.published

        async def stage_times(seconds: float) -> tuple[dict[str, list[list[float]]], int]:
            """Per variant, per timed step: [step time, first task's start, step end - last
            task's end] (seconds from the barrier), steps of the variants alternating."""
            times: dict[str, list[list[float]]] = {v: [] for v in _VARIANTS}
            decisions = 0
            executors: dict[str, _TimedSleepExecutor] = {}

            def make(variant: str) -> DistributedStage:
                executors[variant] = _TimedSleepExecutor(seconds)
                return DistributedStage(
                    layout,
                    sched,
                    executors[variant],
                    groups=groups_of[variant],
                    policy="readiness_first",
                    coordinate_tp=variant != "off",
                    verify_tp=variant in ("on", "gather", "wait"),
                    fold_tp_check=variant in ("on", "wait"),
                    deduce_tp=variant == "on",
                    step_timeout=60.0,
                )

            async with (
                make("off") as off,
                make("dec") as dec,
                make("gather") as gather,
                make("wait") as wait,
                make("on") as on,
            ):
                stages = {"off": off, "dec": dec, "gather": gather, "wait": wait, "on": on}
                k = len(_VARIANTS)
                for s in range(steps + 1):
                    # Rotate the order, so that no variant always follows the same one.
                    order = _VARIANTS[s % k :] + _VARIANTS[: s % k]
                    for v in order:
                        dist.barrier()
                        t = time.perf_counter()
                        st = await stages[v].run_step(mbs, step=s)
                        t1 = time.perf_counter()
                        ex = executors[v]
                        if s:  # the first step of each warms up
                            times[v].append([t1 - t, ex.first[s] - t, t1 - ex.last[s]])
                        decisions = st.decisions
            for ex in executors.values():
                ex.close()
            return times, decisions

        noop, d = await stage_times(0.0)
        busy = {}
        for c in computes:
            busy[c], _ = await stage_times(c)
        return {
            "raw": raw,
            "channel": chan,
            "noop": noop,
            "busy": busy,
            "decisions": d,
            "published": published,
        }

    with asyncio.Runner(loop_factory=loop_factory(True)) as runner:
        return runner.run(main())


def _slowest(per_rank: Sequence[dict[str, Any]], key: str) -> list[float]:
    """Per batch / step, the slowest rank's time (what the stage as a whole pays)."""
    return [max(vals) for vals in zip(*(r[key] for r in per_rank), strict=True)]


def _pairs(per_rank: Sequence[dict[str, Any]], get: Any) -> dict[str, list[list[float]]]:
    """Per variant, per timed step: [step, first start, tail], each the slowest rank's."""
    out: dict[str, list[list[float]]] = {}
    for v in _VARIANTS:
        cols = [get(r)[v] for r in per_rank]
        out[v] = [[max(x[k] for x in rows) for k in range(3)] for rows in zip(*cols, strict=True)]
    return out


def _step_figures(t: dict[str, list[list[float]]], compute_ms: float) -> Row:
    """The per-step figures of one task length from paired steps (medians of differences
    over step tuples: off, decisions only, all-gather check, waited, default)."""
    off, dec, gat, wai, on = t["off"], t["dec"], t["gather"], t["wait"], t["on"]
    z = list(zip(off, dec, gat, wai, on, strict=True))
    return {
        "compute_ms": compute_ms,
        "step_off_ms": 1e3 * median_of(x[0] for x in off),
        "step_dec_ms": 1e3 * median_of(x[0] for x in dec),
        "step_gather_ms": 1e3 * median_of(x[0] for x in gat),
        "step_wait_ms": 1e3 * median_of(x[0] for x in wai),
        "step_on_ms": 1e3 * median_of(x[0] for x in on),
        "cost_us": 1e6 * median_of(c[0] - a[0] for a, _, _, _, c in z),
        "wait_cost_us": 1e6 * median_of(w[0] - a[0] for a, _, _, w, _ in z),
        "gather_cost_us": 1e6 * median_of(g[0] - a[0] for a, _, g, _, _ in z),
        "decisions_cost_us": 1e6 * median_of(b[0] - a[0] for a, b, _, _, _ in z),
        "check_cost_us": 1e6 * median_of(w[0] - b[0] for _, b, _, w, _ in z),
        "gather_check_us": 1e6 * median_of(g[0] - b[0] for _, b, g, _, _ in z),
        "first_delay_us": 1e6 * median_of(c[1] - a[1] for a, _, _, _, c in z),
        "wait_first_us": 1e6 * median_of(w[1] - a[1] for a, _, _, w, _ in z),
        "end_cost_us": 1e6 * median_of(c[2] - a[2] for a, _, _, _, c in z),
        "wait_end_us": 1e6 * median_of(w[2] - a[2] for a, _, _, w, _ in z),
        "gather_end_us": 1e6 * median_of(g[2] - a[2] for a, _, g, _, _ in z),
        "share": median_of((c[0] - a[0]) / c[0] for a, _, _, _, c in z),
        "wait_share": median_of((w[0] - a[0]) / w[0] for a, _, _, w, _ in z),
        "gather_share": median_of((g[0] - a[0]) / g[0] for a, _, g, _, _ in z),
        "samples": {
            "cost": [c[0] - a[0] for a, _, _, _, c in z],
            "wait": [w[0] - a[0] for a, _, _, w, _ in z],
            "gather": [g[0] - a[0] for a, _, g, _, _ in z],
            "first": [c[1] - a[1] for a, _, _, _, c in z],
            "wait_first": [w[1] - a[1] for a, _, _, w, _ in z],
            "end": [c[2] - a[2] for a, _, _, _, c in z],
            "wait_end": [w[2] - a[2] for a, _, _, w, _ in z],
        },
    }


def tp_coordination(
    tps: Sequence[int] = (1, 2, 4, 8),
    *,
    decisions: int = 200,
    compute_ms: float = 5.0,
    computes_ms: Sequence[float] = (1.0, 5.0, 20.0),
    microbatches: int = 8,
    steps: int = 20,
    batches: int = 20,
    timeout: float = 300.0,
) -> list[Row]:
    """TP coordination per decision and per step, against a raw broadcast and against no
    coordination, at each TP degree.

    Per TP size, one ``spawn`` job of ``tp`` processes (one pipeline stage, its TP ranks,
    the dedicated decision group from ``build_groups``):

    * per decision (TP >= 2): ``raw_us``: blocking ``dist.broadcast`` of an ``int64[6]`` (a
      decision's size) from the leader, back to back; ``channel_us``: ``DecisionChannel`` --
      the leader ``publish``es the batch's decisions and awaits ``end_step``, followers
      ``receive`` each and check it. Both: the slowest rank's time from a group barrier /
      decisions, ``batches`` interleaved batches; lower deciles as in ``message_cost``
      (medians and paired ratios too); ``ratio`` = channel / raw.
    * per step, inside real ``DistributedStage``s (1-stage 1F1B plan, ``microbatches``
      microbatches, so ``2 x microbatches`` decisions a step): the stages of ``_VARIANTS``
      side by side, their steps alternating (order rotating) -- no coordination (``off``),
      decisions only (``dec``), the all-gather check (``gather``), every decision waited
      for (``wait``, whose figures are prefixed ``wait_``), the default (``on``: deduced
      decisions, the end-of-step sequence check folded into the decisions). With
      no-op tasks, ``stage_us`` = (on - off) / decisions; then for each task length of
      ``computes_ms`` (tasks sleeping on a compute thread, like ``TorchStageExecutor``'s
      emulated GPU time), medians over the step triples of the slowest rank's: ``cost_us``
      (on - off step time), ``wait_cost_us`` (wait - off), ``decisions_cost_us`` (dec -
      off), ``check_cost_us`` (wait - dec: the folded check), ``first_delay_us`` (when the
      first task started, on - off), ``wait_first_us`` (the same, wait - off: the
      followers wait for the first decision), ``end_cost_us`` / ``wait_end_us`` (step end
      after the last task), ``share`` ((on - off) / on), ``wait_share``. At TP 1 there
      is nothing to coordinate: its figures are the noise floor of the pairing.
    * pooled over the task lengths (what ``tp_model`` fits): ``first_delay_us``,
      ``wait_first_us``, ``end_cost_us``, ``wait_end_us``; ``step_cost_us``,
      ``wait_step_cost_us`` and ``gather_step_cost_us`` (the all-gather check) over tasks
      of ``compute_ms`` and longer, where the look-ahead hides each decision's latency
      behind the running task; ``share_measured`` / ``wait_share_measured`` at
      ``compute_ms`` (the target's).

    Returns:
        One row per TP size: ``{tp, decisions, raw_us, channel_us, ratio, raw_median_us,
        channel_median_us, ratio_paired, contended, stage_us, stage_coord_us,
        stage_uncoord_us, compute_ms, share, steps: [per task length], step_cost_us,
        wait_step_cost_us, first_delay_us, wait_first_us, end_cost_us, wait_end_us,
        check_cost_us, step_coord_ms, step_uncoord_ms, share_measured,
        wait_share_measured, step_decisions, published, target_ratio, met_ratio, met_share}``
        (per-decision figures None at TP 1).
    """
    from rrfp_async.distributed import spawn

    n = max(1, decisions // batches)
    computes = sorted({*computes_ms, compute_ms})
    rows: list[Row] = []
    for tp in tps:
        if tp < 1:
            raise ValueError(f"TP coordination needs tp >= 1, got {tp}")
        res = spawn(
            _tp_rank,
            tp,
            n,
            batches,
            [c / 1e3 for c in computes],
            microbatches,
            steps,
            timeout=timeout,
        )
        row: Row = {"tp": tp, "decisions": n * batches if tp > 1 else 0}
        if tp > 1:
            fig = transport_figures(_slowest(res, "raw"), _slowest(res, "channel"), n)
            row.update(fig)
            row["share"] = fig["channel_us"] / (fig["channel_us"] + compute_ms * 1e3)
        else:
            for k in ("raw_us", "channel_us", "ratio", "raw_median_us", "channel_median_us"):
                row[k] = None
            row.update(ratio_paired=None, contended=False, share=None)
        d = res[0]["decisions"]
        noop = _pairs(res, lambda r: r["noop"])
        on = median_of(x[0] for x in noop["on"])
        off = median_of(x[0] for x in noop["off"])
        per = [_step_figures(_pairs(res, lambda r, c=c: r["busy"][c / 1e3]), c) for c in computes]
        pooled = {
            k: [x for p in per for x in p["samples"][k]]
            for k in ("cost", "wait", "gather", "first", "wait_first", "end", "wait_end")
        }
        # The step's total: tasks of compute_ms and longer only, where the look-ahead hides
        # the per-decision latency (shorter tasks pay it per decision: see their rows).
        long = [p for p in per if p["compute_ms"] >= compute_ms]
        for k in ("cost", "wait", "gather"):
            pooled[k] = [x for p in long for x in p["samples"][k]]
        head = next(p for p in per if p["compute_ms"] == compute_ms)
        for p in per:
            del p["samples"]
        row.update(
            {
                "stage_us": 1e6 * (on - off) / d,
                "stage_coord_us": 1e6 * on / d,
                "stage_uncoord_us": 1e6 * off / d,
                "compute_ms": compute_ms,
                "steps": per,
                "step_cost_us": 1e6 * median_of(pooled["cost"]),
                "wait_step_cost_us": 1e6 * median_of(pooled["wait"]),
                "gather_step_cost_us": 1e6 * median_of(pooled["gather"]),
                "first_delay_us": 1e6 * median_of(pooled["first"]),
                "wait_first_us": 1e6 * median_of(pooled["wait_first"]),
                "end_cost_us": 1e6 * median_of(pooled["end"]),
                "wait_end_us": 1e6 * median_of(pooled["wait_end"]),
                "check_cost_us": median_of(p["check_cost_us"] for p in per),
                "step_coord_ms": head["step_on_ms"],
                "step_uncoord_ms": head["step_off_ms"],
                "share_measured": head["share"],
                "wait_share_measured": head["wait_share"],
                "step_decisions": d,
                "published": res[0]["published"],
                "target_ratio": TP_TARGET_RATIO,
                "met_ratio": None if tp == 1 else row["ratio"] <= TP_TARGET_RATIO,
                "met_share": head["share"] < TP_SHARE_TARGET,
            }
        )
        rows.append(row)
    return rows


_TERMS = (
    ("channel_us", "per decision: DecisionChannel", 2),
    ("raw_us", "per decision: raw broadcast", 2),
    ("wait_first_us", "per step: first-task delay, decision waited for", 1),
    ("wait_end_us", "per step: end of step, decisions waited for", 1),
    ("wait_step_cost_us", "per step: total, every decision waited for, long tasks", 1),
    ("gather_step_cost_us", "per step: total with the all-gather check, long tasks", 1),
)
"""The model's terms: the decision path (every decision waited for), which a task with an
input message takes; deduced decisions (this benchmark's single stage) cost less."""


def tp_model(
    rows: Sequence[Row],
    *,
    predict: Sequence[int] = (16, 32),
    task_ms: float = 5.0,
    step_decisions: Sequence[int] = (16, 256),
) -> Row:
    """The model of TP coordination fitted to ``tp_coordination``'s rows.

    Each term (per decision: the channel, the raw broadcast, fitted on TP >= 2; per step,
    with every decision waited for (the path of a task with an input message; a deduced
    decision costs less): first-task delay, end of step, total, fitted on every TP
    measured, TP 1 being the pairing's noise floor) is fitted as ``a + b * log2(tp)`` and
    ``a + b * (tp - 1)`` (``sim.fit_tp_term``: the smaller RMS residual wins), then
    checked leave-one-out: fit on the other TP sizes, predict each measured one
    (``error`` = predicted / measured - 1; target within ``TP_MODEL_TOLERANCE`` at TP
    2/4/8).

    Returns:
        ``{terms: [{key, name, form, a_us, b_us, residual_us, other_form,
        other_residual_us, measured: {tp: us}, loo: [{tp, measured_us, predicted_us,
        error}], predicted: {tp: us}}], share: [{tp, decisions, task_ms, step_ms,
        cost_us, share}], task_ms}``: the shares of a step of ``decisions`` tasks of
        ``task_ms`` from the fitted per-step total, for every measured and predicted TP.
    """
    from rrfp_async.sim import fit_tp_term

    terms = []
    fitted = {}
    for key, name, lo in _TERMS:
        pts = [(r["tp"], r[key] * 1e-6) for r in rows if r["tp"] >= lo and r[key] is not None]
        if len({tp for tp, _ in pts}) < 2:
            continue
        term, other = fit_tp_term(pts)
        fitted[key] = term
        loo = []
        if len(pts) >= 3:
            for i, (tp, y) in enumerate(pts):
                if tp < 2:
                    continue
                t, _ = fit_tp_term([p for j, p in enumerate(pts) if j != i], term.form)
                pred = t.a + t.b * (math.log2(tp) if t.form == "log2" else tp - 1)
                loo.append(
                    {
                        "tp": tp,
                        "measured_us": 1e6 * y,
                        "predicted_us": 1e6 * pred,
                        "error": pred / y - 1 if y > 0 else None,
                    }
                )
        terms.append(
            {
                "key": key,
                "name": name,
                "form": term.form,
                "a_us": 1e6 * term.a,
                "b_us": 1e6 * term.b,
                "residual_us": 1e6 * term.residual,
                "other_form": None if other is None else other.form,
                "other_residual_us": None if other is None else 1e6 * other.residual,
                "measured": {tp: 1e6 * y for tp, y in pts},
                "loo": loo,
                "predicted": {tp: 1e6 * term(tp) for tp in predict},
                "met_loo": all(
                    x["error"] is not None and abs(x["error"]) <= TP_MODEL_TOLERANCE for x in loo
                ),
            }
        )
    shares = []
    total = fitted.get("wait_step_cost_us")
    if total is not None:
        for tp in sorted({*(r["tp"] for r in rows), *predict}):
            for d in step_decisions:
                cost = total(tp)
                step = d * task_ms * 1e-3
                shares.append(
                    {
                        "tp": tp,
                        "decisions": d,
                        "task_ms": task_ms,
                        "step_ms": 1e3 * step,
                        "cost_us": 1e6 * cost,
                        "share": cost / (step + cost),
                        "measured": tp in {r["tp"] for r in rows},
                    }
                )
    return {"terms": terms, "share": shares, "task_ms": task_ms}
