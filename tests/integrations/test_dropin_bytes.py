"""The torch pipelining drop-in with memory in bytes: ``activation_bytes=`` and
``memory_budget=`` on variable-length microbatches (2 gloo processes)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import rrfp_async as rr
from tests._pool import pooled_spawn

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

D, M = 8, 6
LENGTHS = [30, 4, 26, 6, 3, 28]  # tokens per microbatch: the bytes follow them
PER_TOKEN = 1000  # bytes one token stashes on a stage (a declared model, for the test)


def model(world: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(world)])


def batch() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(1, n, D, generator=g) for n in LENGTHS]
    return xs, [torch.randn_like(x) for x in xs]


def nbytes(plan: rr.StepPlan, _mbs: Any) -> rr.ActivationBytes:
    # Every rank computes the same: the lengths come from the loader's metadata here.
    return rr.ActivationBytes.from_sizes(plan, LENGTHS, PER_TOKEN)


def durations(plan: rr.StepPlan, _mbs: Any) -> rr.Durations:
    return rr.Durations.from_arrays(plan, [[float(n) for n in LENGTHS]] * plan.num_virtual)


def worker(rank: int, world: int, budget: Any) -> dict[str, Any]:
    from torch.distributed.pipelining import PipelineStage

    from rrfp_async.pipelining import ScheduleReadinessFirst

    torch.set_num_threads(1)
    m = model(world)
    stage = PipelineStage(m[rank], rank, world, torch.device("cpu"))
    out: dict[str, Any] = {}
    try:  # a byte budget without the bytes is refused at construction, naming the fix
        ScheduleReadinessFirst(stage, M, loss_fn=F.mse_loss, memory_budget=1.5, sizes=False)
    except rr.PlanError as e:
        out["refused"] = str(e)
    # A value no step could take: refused at construction too, not at the first step.
    for bad in ([1.0], "lots", 0):
        try:
            ScheduleReadinessFirst(stage, M, loss_fn=F.mse_loss, memory_budget=bad)
        except rr.PlanError as e:
            out.setdefault("bad", []).append(str(e))
    xs, ys = batch()
    schedule = ScheduleReadinessFirst(
        stage,
        M,
        loss_fn=F.mse_loss,
        durations=durations,
        activation_bytes=nbytes,
        memory_budget=budget,
    )
    losses: list[Any] = []
    schedule.step_microbatches(
        arg_mbs=[(x,) for x in xs] if rank == 0 else None,
        target_mbs=ys if rank == world - 1 else None,
        losses=losses,
    )
    st = schedule.last_stats
    assert st is not None
    schedule.close()
    out.update(
        grads=[p.grad.clone() for p in m[rank].parameters()],
        losses=[float(v) for v in losses],
        peak=st.peak_bytes,
        budget=st.budget_bytes,
        reference=st.reference_bytes,
        executed=[str(e.task) for e in st.executed],
    )
    return out


@pytest.mark.parametrize("budget", [None, 1.5], ids=["same-bytes", "1.5x"])
def test_a_byte_budget_holds_and_training_is_unchanged(budget: float | None) -> None:
    world = 2
    res = pooled_spawn(worker, world, budget, timeout=200)
    # The reference: one process, plain autograd, summed losses over M (scale_grads).
    m = model(world)
    xs, ys = batch()
    for x, y in zip(xs, ys, strict=True):
        F.mse_loss(m(x), y).backward()
    for r in range(world):
        for a, p in zip(res[r]["grads"], m[r].parameters(), strict=True):
            assert p.grad is not None
            torch.testing.assert_close(a, p.grad / M, rtol=0, atol=1e-6)
    b = [n * PER_TOKEN for n in LENGTHS]
    # 1F1B's peak bytes: rank 0 holds two microbatches in a row at most, rank 1 one.
    want_ref = [max(b[i] + b[i + 1] for i in range(M - 1)), max(b)]
    for r in range(world):
        got = res[r]
        assert got["reference"] == want_ref[r]
        factor = 1.0 if budget is None else budget
        assert got["budget"] == int(factor * want_ref[r])
        assert got["peak"] <= got["budget"], got
        assert "activation_bytes" in got["refused"] and "memory_factor" in got["refused"]
        assert "here sizes=False switched the learning off" in got["refused"]
        assert got["bad"][0] == "memory_budget needs one value per rank (2), got 1"
        assert got["bad"][1].startswith("memory_budget='lots' is no size")
        assert got["bad"][2].startswith("memory_budget=0: a budget must be a finite number > 0")
        # The peak the stage reports is what its executed order held.
        held = peak = 0
        for t in map(rr.parse_tasks, got["executed"]):
            task = t[0]
            if task.kind == "F":
                held += b[task.mb]
            elif task.kind == "B":
                held -= b[task.mb]
            peak = max(peak, held)
        assert peak == got["peak"]


STEPS = [
    [30, 4, 26, 6, 3, 28],
    [12, 40, 7, 33, 18, 2],
    [25, 3, 18, 60, 9, 14],
    [5, 44, 27, 11, 36, 20],
]


def sizes_worker(rank: int, world: int, budget: float | None, given: bool = True) -> dict[str, Any]:
    """Four steps of new lengths with ``sizes=`` (``given``) or with no argument (the sizes
    read off the microbatches): the bytes are measured, learned and then bound the steps;
    what each step really held (measured) against its budget."""
    from rrfp_async.integrations import _torch_learning

    # Every step measured (by default one in LEARN_EVERY once fitted), so that each step's
    # measured peak can be checked against its budget; restored (the process is pooled).
    every, _torch_learning.LEARN_EVERY = _torch_learning.LEARN_EVERY, 1
    try:
        return _sizes_steps(rank, world, budget, given)
    finally:
        _torch_learning.LEARN_EVERY = every


def _sizes_steps(rank: int, world: int, budget: float | None, given: bool) -> dict[str, Any]:
    from torch.distributed.pipelining import PipelineStage

    from rrfp_async.pipelining import ScheduleReadinessFirst

    torch.set_num_threads(1)
    m = model(world)
    stage = PipelineStage(m[rank], rank, world, torch.device("cpu"))
    lengths: list[int] = []
    learn: dict[str, Any] = (
        {"sizes": lambda plan, mbs: [{"tokens": float(n)} for n in lengths]} if given else {}
    )
    schedule = ScheduleReadinessFirst(stage, M, loss_fn=F.mse_loss, memory_budget=budget, **learn)
    g = torch.Generator().manual_seed(7)
    out: dict[str, Any] = {"steps": []}
    for step in STEPS:
        lengths[:] = step
        xs = [torch.randn(1, n, D, generator=g) for n in step]
        ys = [torch.randn_like(x) for x in xs]
        schedule.step_microbatches(
            arg_mbs=[(x,) for x in xs] if rank == 0 else None,
            target_mbs=ys if rank == world - 1 else None,
        )
        st = schedule.last_stats
        assert st is not None
        measured = schedule.activation_bytes()
        out.setdefault("grads", []).append([p.grad.clone() for p in m[rank].parameters()])
        out["steps"].append(
            {
                "budget": st.budget_bytes,
                "planned_peak": st.peak_bytes,
                "measured_peak": st.held_peak(measured),
                "measured": {f"{v}:{i}": b for (v, i), b in measured.items()},
            }
        )
        for p in m[rank].parameters():
            p.grad = None
    learned = schedule.learned_bytes
    costs = schedule.learned_durations
    assert learned is not None and costs is not None
    out["error"] = learned.error(schedule.plan)
    out["costs_ready"] = costs.ready(schedule.plan)
    schedule.close()
    return out


@pytest.mark.parametrize("given", [True, False], ids=["sizes=", "no-argument"])
@pytest.mark.parametrize("budget", [None, 1.5], ids=["same-bytes", "1.5x"])
def test_sizes_learn_the_bytes_and_then_a_step_holds_its_measured_budget(
    budget: float | None, given: bool
) -> None:
    res = pooled_spawn(sizes_worker, 2, budget, given, timeout=200)
    for r in range(2):
        steps = res[r]["steps"]
        # The first step runs before anything was measured: uniform bytes, i.e. the count
        # bound (1F1B's: 2 on rank 0, 1 on rank 1). Its six distinct lengths identify every
        # stage's fit, so from the second step the plan's bytes are the measured ones and
        # each step's measured peak stays within its byte budget (1F1B's measured bytes).
        assert steps[0]["budget"] == int((budget or 1.0) * (2 - r)), steps[0]
        for s in steps[1:]:
            assert s["budget"] is not None and s["budget"] > 1000, s  # bytes, not a count
            assert s["measured_peak"] <= s["budget"], (r, s)
            assert s["planned_peak"] == s["measured_peak"], (r, s)
        assert res[r]["error"] < 1e-6, res[r]["error"]
        # No durations= given: the tasks' times were learned too (the cost-aware hint).
        assert res[r]["costs_ready"]
    # Training is unchanged: each step's gradients are plain autograd's (up to the order in
    # which the microbatches' contributions were summed).
    m = model(2)
    g = torch.Generator().manual_seed(7)
    for k, step in enumerate(STEPS):
        m.zero_grad(set_to_none=True)
        xs = [torch.randn(1, n, D, generator=g) for n in step]
        ys = [torch.randn_like(x) for x in xs]
        for x, y in zip(xs, ys, strict=True):
            F.mse_loss(m(x), y).backward()
        for r in range(2):
            for a, p in zip(res[r]["grads"][k], m[r].parameters(), strict=True):
                assert p.grad is not None
                torch.testing.assert_close(a, p.grad / M, rtol=0, atol=1e-6)
    # Every rank planned alike: the same budgets' key (the fitted predictions agree).
    assert [s["budget"] is not None for s in res[0]["steps"]] == [
        s["budget"] is not None for s in res[1]["steps"]
    ]


def plain_worker(rank: int, world: int, mode: str) -> dict[str, Any]:
    """Two steps where the schedule learns nothing: microbatches of one size (torch's own
    chunking of a batch), or ``policy="strict"`` (torch's fixed order, bit for bit)."""
    from torch.distributed.pipelining import PipelineStage

    from rrfp_async.pipelining import ScheduleReadinessFirst

    torch.set_num_threads(1)
    m = model(world)
    stage = PipelineStage(m[rank], rank, world, torch.device("cpu"))
    kw: dict[str, Any] = {"policy": "strict"} if mode == "strict" else {}
    if mode == "measure-all":
        kw["measure_activations"] = True
    if mode.startswith("uniform-budget"):  # one size, and a byte budget (torchtitan's case)
        kw["memory_budget"] = 1.5 if mode == "uniform-budget-factor" else "1MiB"
    schedule = ScheduleReadinessFirst(stage, M, loss_fn=F.mse_loss, **kw)
    g = torch.Generator().manual_seed(5)
    out: dict[str, Any] = {"budgets": [], "measured": []}
    if mode in ("varying", "measure-all"):
        steps = STEPS
    elif mode == "uniform-then-varying":
        steps = [[8] * M, [8] * M, [9] * M, STEPS[0]]
    elif mode.startswith("uniform-budget"):
        steps = [[8] * M] * 4
    else:
        steps = STEPS[:2]
    for step in steps:
        lengths = [8] * M if mode == "uniform" else step
        xs = [torch.randn(1, n, D, generator=g) for n in lengths]
        schedule.step_microbatches(
            arg_mbs=[(x,) for x in xs] if rank == 0 else None,
            target_mbs=[torch.randn_like(x) for x in xs] if rank == world - 1 else None,
        )
        st = schedule.last_stats
        assert st is not None
        out["budgets"].append(st.budget_bytes)
        out.setdefault("peaks", []).append(st.peak_bytes)
        out["measured"].append(len(schedule.activation_bytes()))
        if out["measured"][-1]:
            out["bytes"] = sorted(set(schedule.activation_bytes().values()))
    out["learned"] = schedule.learned_bytes is not None
    schedule.close()
    return out


@pytest.mark.parametrize("mode", ["uniform", "strict"])
def test_without_varying_sizes_or_under_strict_nothing_is_learned(mode: str) -> None:
    res = pooled_spawn(plain_worker, 2, mode, timeout=200)
    for r in range(2):
        # The fixed order's count bound, nothing measured (no hook on any forward).
        assert res[r]["budgets"] == [None, None], res[r]
        assert res[r]["measured"] == [0, 0], res[r]
    # Uniform steps still open the learning (a varying step may come); strict never does.
    assert res[0]["learned"] is (mode == "uniform")


@pytest.mark.parametrize("mode", ["varying", "measure-all"])
def test_once_fitted_only_one_step_in_learn_every_is_measured(mode: str) -> None:
    from rrfp_async.integrations._torch_learning import LEARN_EVERY

    assert len(STEPS) < LEARN_EVERY
    res = pooled_spawn(plain_worker, 2, mode, timeout=200)
    for r in range(2):
        # The first step identifies every fit (six lengths); the next three are planned in
        # bytes from the fits, with no meter on their forwards, unless every step's bytes
        # were asked for (measure_activations=True).
        want = [M] * 4 if mode == "measure-all" else [M, 0, 0, 0]
        assert res[r]["measured"] == want, res[r]
        assert all(b is not None and b > 1000 for b in res[r]["budgets"][1:]), res[r]


def test_a_job_of_one_size_stops_reading_sizes_after_two_steps() -> None:
    res = pooled_spawn(plain_worker, 2, "uniform-then-varying", timeout=200)
    for r in range(2):
        # Two first steps of one size each: the sizes are no longer read (no broadcast), so
        # a later step of varying sizes runs the fixed order, measured nothing.
        assert res[r]["budgets"] == [None] * 4, res[r]
        assert res[r]["measured"] == [0] * 4, res[r]


def dp_worker(rank: int, world: int) -> dict[str, Any]:
    """PP 2 x DP 2 with no argument: each replica steps microbatches of its own lengths
    (replica 1 the same lengths reversed, so the two plans differ); every step measured."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    from rrfp_async.integrations import _torch_learning
    from rrfp_async.pipelining import ScheduleReadinessFirst

    torch.set_num_threads(1)
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes both
    replica, pp_rank = divmod(rank, 2)
    m = model(2)
    stage = PipelineStage(m[pp_rank], pp_rank, 2, torch.device("cpu"), group=groups[replica])
    every, _torch_learning.LEARN_EVERY = _torch_learning.LEARN_EVERY, 1
    try:
        schedule = ScheduleReadinessFirst(stage, M, loss_fn=F.mse_loss)
        g = torch.Generator().manual_seed(11 + replica)
        out: dict[str, Any] = {"steps": [], "grads": [], "replica": replica, "pp": pp_rank}
        for step in STEPS:
            lengths = step if replica == 0 else step[::-1]
            xs = [torch.randn(1, n, D, generator=g) for n in lengths]
            ys = [torch.randn_like(x) for x in xs]
            schedule.step_microbatches(
                arg_mbs=[(x,) for x in xs] if pp_rank == 0 else None,
                target_mbs=ys if pp_rank == 1 else None,
            )
            st = schedule.last_stats
            assert st is not None
            measured = schedule.activation_bytes()
            out["grads"].append([p.grad.clone() for p in m[pp_rank].parameters()])
            out["steps"].append(
                {
                    "budget": st.budget_bytes,
                    "planned_peak": st.peak_bytes,
                    "measured_peak": st.held_peak(measured),
                    "order": [str(e.task) for e in st.executed],
                    "hint": st.hint,
                }
            )
            for p in m[pp_rank].parameters():
                p.grad = None
        learned = schedule.learned_bytes
        assert learned is not None
        out["error"] = learned.error(schedule.plan)
        schedule.close()
        return out
    finally:
        _torch_learning.LEARN_EVERY = every


def test_data_parallel_replicas_learn_together_and_plan_their_own_steps() -> None:
    res = pooled_spawn(dp_worker, 4, timeout=200)
    for r in res:
        steps = r["steps"]
        # Step 0 measures (nothing fitted yet); from step 1 every replica plans in bytes,
        # with the job's fits, its own step within the bytes 1F1B holds on its lengths.
        for s in steps[1:]:
            assert s["hint"] == "breadth_first_weighted", (r["replica"], r["pp"], s)
            assert s["budget"] is not None and s["budget"] > 1000, s
            assert s["measured_peak"] <= s["budget"], (r["replica"], r["pp"], s)
            assert s["planned_peak"] == s["measured_peak"], (r["replica"], r["pp"], s)
        assert r["error"] < 1e-6, r["error"]
    by = {(r["replica"], r["pp"]): r for r in res}
    # The replicas saw other lengths and planned other steps (orders or budgets differ).
    assert any(
        (a["order"], a["budget"]) != (b["order"], b["budget"])
        for a, b in zip(by[0, 0]["steps"][1:], by[1, 0]["steps"][1:], strict=True)
    )
    # Training is unchanged on each replica: plain autograd's gradients of its microbatches.
    for replica in (0, 1):
        m = model(2)
        g = torch.Generator().manual_seed(11 + replica)
        for k, step in enumerate(STEPS):
            m.zero_grad(set_to_none=True)
            lengths = step if replica == 0 else step[::-1]
            xs = [torch.randn(1, n, D, generator=g) for n in lengths]
            ys = [torch.randn_like(x) for x in xs]
            for x, y in zip(xs, ys, strict=True):
                F.mse_loss(m(x), y).backward()
            for pp in (0, 1):
                for a, p in zip(by[replica, pp]["grads"][k], m[pp].parameters(), strict=True):
                    assert p.grad is not None
                    torch.testing.assert_close(a, p.grad / M, rtol=0, atol=1e-6)


@pytest.mark.parametrize("budget", ["factor", "bytes"])
def test_one_size_steps_with_a_byte_budget_are_planned_in_their_measured_bytes(
    budget: str,
) -> None:
    # Microbatches of one size never identify a fit (torchtitan's, packed to seq_len): the
    # budget fell back to the count bound (a budget in bytes never applied) and every step
    # was measured and exchanged. The one size measured is known exactly: from the second
    # step on the steps are planned in its bytes, measured one step in LEARN_EVERY.
    res = pooled_spawn(plain_worker, 2, f"uniform-budget-{budget}", timeout=200)
    for r in range(2):
        got = res[r]
        (per_mb,) = got["bytes"]  # every forward of one size keeps the same bytes
        assert got["measured"] == [M, 0, 0, 0], got
        ref = (2 - r) * per_mb  # 1F1B holds 2 microbatches on rank 0, 1 on rank 1
        want = int(1.5 * ref) if budget == "factor" else 2**20
        assert got["budgets"][1:] == [want] * 3, got
        assert all(p is not None and p <= want for p in got["peaks"][1:]), got
        # the first step, before anything was measured: a factor of the count (uniform
        # bytes), or, for a budget in bytes, the fixed order's count bound
        assert got["budgets"][0] == (int(1.5 * (2 - r)) if budget == "factor" else None), got
