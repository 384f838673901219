"""Training semantics in one process: the tasks' random
streams, gradient accumulation over tied parameters in a ``LocalPipeline``, a failed step's
accumulated gradients, the synchronous face.

Each check compares with the single-process reference of ``tests/_semantics.py`` (plain
autograd on the unsplit model, ``rr.task_rng`` around each stage's forward).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from typing import Any, cast

import pytest
import torch
from torch import nn

import rrfp_async as rr
from tests._semantics import (
    SEED,
    batches,
    build,
    loss_fn,
    max_diff,
    parameters,
    reference,
    state,
)

pytestmark = pytest.mark.timeout(120)

COST = rr.CostModel(default=rr.StageProfile(per_token=1e-4, fixed=1e-4))


def _pipe(
    mods: Sequence[nn.Module],
    spec: Any,
    m: int,
    *,
    policy: str = "readiness_first",
    hint: str = "1f1b",
    split: bool = False,
    latency: Any = None,
    mbs: Sequence[rr.Microbatch] | None = None,
    **ex_kw: Any,
) -> tuple[rr.LocalPipeline, list[rr.TorchStageExecutor]]:
    """A LocalPipeline of one executor (one compute thread) per stage."""
    plan = rr.StepPlan(
        topology=rr.Topology(stages=len(mods)),
        microbatches=m,
        split_backward=split,
        ordered_weights=split,
    )
    durations = COST.declared(plan, mbs) if mbs is not None else None
    sched = rr.StepSchedule.build(plan, hint, durations=durations, memory_factor=2.0)
    execs = [
        rr.TorchStageExecutor({v: mods[v]}, loss_fn, rank=v, shared=spec, **ex_kw)
        for v in range(len(mods))
    ]
    return rr.LocalPipeline(sched, execs, policy=policy, latency=latency), execs


def _close(execs: Sequence[rr.TorchStageExecutor]) -> None:
    for e in execs:
        e.close()


# ------------------------------------------------------------------ the streams themselves


def test_task_seeds_differ_within_a_step_and_repeat() -> None:
    seeds = {(v, m): rr.task_seed(SEED, 3, v, m) for v, m in itertools.product(range(8), range(64))}
    # within a step no two tasks share even the low 32 bits (all the CPU generator reads)
    assert len({s & 0xFFFFFFFF for s in seeds.values()}) == len(seeds)
    assert seeds[(2, 5)] == rr.task_seed(SEED, 3, 2, 5)  # a function of its arguments
    others = {rr.task_seed(SEED, 4, 0, m) for m in range(64)} | {rr.task_seed(1, 3, 0, 0)}
    assert not others & set(seeds.values())  # other steps, other seeds: other streams
    assert all(0 <= s < 1 << 64 for s in seeds.values())
    assert rr.task_seed(-1, 0, 0, 0) == rr.task_seed((1 << 64) - 1, 0, 0, 0)  # as torch


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0, -1, 0, 0), "step must be >= 0"),
        ((0, 0, 4096, 0), r"stage must be in 0\.\.4095"),
        ((0, 0, 0, 1 << 20), r"microbatch must be in 0\.\.1048575"),
        ((0, 0, True, 0), "stage must be an int"),
        ((0.5, 0, 0, 0), "seed must be an int"),
    ],
)
def test_task_seed_refuses_what_it_cannot_take(args: tuple[Any, ...], match: str) -> None:
    with pytest.raises(rr.PlanError, match=match):
        rr.task_seed(*args)


def test_task_rng_draws_its_task_stream_and_puts_the_generator_back() -> None:
    torch.manual_seed(5)
    before = torch.get_rng_state()
    with rr.task_rng(SEED, 2, 1, 3):
        a = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before)
    drawn: list[torch.Tensor] = []

    def fail() -> None:
        with rr.task_rng(SEED, 2, 1, 3):
            drawn.append(torch.rand(4))
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fail()
    b = drawn[0]
    assert torch.equal(torch.get_rng_state(), before)  # also when the block raises
    assert torch.equal(a, b)
    g = torch.Generator().manual_seed(rr.task_seed(SEED, 2, 1, 3))
    assert torch.equal(a, torch.rand(4, generator=g))  # the stream is task_seed's
    with rr.task_rng(SEED, 2, 1, 4):
        assert not torch.equal(a, torch.rand(4))


class _Draw(nn.Module):
    """Returns its input plus a draw from the global generator; records the draw."""

    def __init__(self, stage: int) -> None:
        super().__init__()
        self.stage = stage
        self.w = nn.Parameter(torch.ones(1))
        self.draws: dict[int, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = torch.rand(6)
        self.draws[len(self.draws)] = r
        return x * self.w + r.sum()


def test_every_forward_draws_its_own_stream_whatever_the_order() -> None:
    # Fails without per-task streams: the draws then follow the dispatch order (and two
    # stages that start from one state draw the same numbers).
    m = 5
    mods = [_Draw(v) for v in range(3)]
    plan = rr.StepPlan(topology=rr.Topology(stages=3), microbatches=m)
    execs = [
        rr.TorchStageExecutor({v: mods[v]}, lambda out, mb: out.sum(), rank=v, seed=11)
        for v in range(3)
    ]
    pipe = rr.LocalPipeline(rr.StepSchedule.build(plan, "gpipe"), execs, policy="strict")
    torch.manual_seed(99)
    before = torch.get_rng_state()
    try:
        for step in (0, 1):
            for mod in mods:
                mod.draws.clear()
            rr.run(pipe.run_step([torch.zeros(1) for _ in range(m)]))
            for v, mod in enumerate(mods):
                # gpipe with strict runs the forwards of a stage in microbatch order
                for mb, r in mod.draws.items():
                    with rr.task_rng(11, step, v, mb):
                        assert torch.equal(r, torch.rand(6)), (step, v, mb)
    finally:
        _close(execs)
    # the caller's generator is where it was: a step draws nothing from its stream
    assert torch.equal(torch.get_rng_state(), before)
    draws = [tuple(r.tolist()) for mod in mods for r in mod.draws.values()]
    assert len(set(draws)) == len(draws) == 3 * m  # no two tasks share a stream


def test_the_executor_seed_defaults_to_torch_initial_seed_and_can_be_off() -> None:
    mods, _ = build(2, "untied")
    torch.manual_seed(1234)
    ex = rr.TorchStageExecutor({0: mods[0]})
    assert ex.rng_seed == 1234 and not ex.rng_seed_given  # the job's seed replaces it
    given = rr.TorchStageExecutor({0: mods[0]}, seed=-1)
    assert given.rng_seed == (1 << 64) - 1 and given.rng_seed_given
    assert rr.TorchStageExecutor({0: mods[0]}, task_rng=False).rng_seed is None
    with pytest.raises(rr.PlanError, match="seed must be an int or None"):
        rr.TorchStageExecutor({0: mods[0]}, seed="0")  # type: ignore[arg-type]
    with pytest.raises(rr.PlanError, match="task_rng must be a bool"):
        rr.TorchStageExecutor({0: mods[0]}, task_rng=1)  # type: ignore[arg-type]


# ------------------------------------------------------------------ dropout and the order


def _jitter(seed: int) -> Any:
    """A message latency model: 0-3 ms per message, seeded per (step, task)."""

    def latency(step: int, task: rr.Task) -> float:
        return random.Random(hash((seed, step, str(task)))).random() * 3e-3

    return latency


def test_dropout_gives_bitwise_the_same_parameters_under_every_policy_and_hint() -> None:
    # Fails without per-task streams (each order draws the masks in its own order).
    steps = [(s, batches(s, 6)) for s in range(2)]
    runs: list[tuple[dict[str, torch.Tensor], list[list[tuple[rr.Task, ...]]]]] = []
    configs = [
        ("strict", "1f1b", 1),
        ("readiness_first", "1f1b", 2),
        ("readiness_first", "breadth_first_weighted", 3),
        ("readiness_first", "gpipe", 4),
        ("strict", "1f1b", 1),  # the first again: a run repeats bitwise
    ]
    for policy, hint, jitter in configs:
        mods, spec = build(3, "copies")
        pipe, execs = _pipe(
            mods,
            spec,
            6,
            policy=policy,
            hint=hint,
            split=True,
            latency=_jitter(jitter),
            mbs=steps[0][1],
        )
        orders = []
        try:
            for s, mbs in steps:
                stats = rr.run(pipe.run_step(mbs, step=s))
                orders.append([tuple(e.task for e in st.executed) for st in stats])
        finally:
            _close(execs)
        runs.append((state(mods), orders))
    first = runs[0][0]
    for got, _ in runs[1:]:
        assert max_diff(got, first) == 0.0
    # the orders really differed (the test is not vacuous)
    assert len({str(o) for _, o in runs[:4]}) == 4
    # and the single-process reference draws the same masks (accumulating in microbatch
    # order, like the ordered W tasks)
    ref, _ = build(3, "one")
    reference(ref, steps)
    assert max_diff(first, state(ref)) <= 1e-6


class _Checkpointed(nn.Module):
    """A stage whose dropout runs under activation checkpointing: its backward recomputes
    the forward, which must draw the same mask again."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        out = checkpoint(self.inner, x, use_reentrant=False)
        assert isinstance(out, torch.Tensor)
        return out


def test_activation_checkpointing_replays_the_task_stream() -> None:
    # Fails if a recomputation in the backward drew another mask than its forward (the
    # gradient would then be that of another mask), or if two compute threads forked the
    # global generators at once.
    mods, spec = build(3, "copies")
    wrapped = [_Checkpointed(m) for m in mods]
    spec = {"wte": [(0, "inner.emb.weight"), (2, "inner.weight")]}
    pipe, execs = _pipe(wrapped, spec, 5, policy="readiness_first", latency=_jitter(7))
    try:
        rr.run(pipe.run_step(batches(0, 5)))
    finally:
        _close(execs)
    ref, _ = build(3, "one")
    reference(ref, [(0, batches(0, 5))])
    assert max_diff(state(mods), state(ref)) <= 1e-6


# ------------------------------------------------------------------ ties and accumulation


@pytest.mark.parametrize("kind", ["copies", "one", "untied"])
def test_accumulating_steps_add_each_tied_contribution_once(kind: str) -> None:
    # Three steps without zero_grad, then SGD: fails (copies) when the end-of-step tie
    # reduction sums the whole accumulated .grad (2 G1 + G2 + ... instead of G1 + G2 + ...).
    sizes = (4, 2, 5)  # a step of another size each time
    mods, spec = build(3, kind)
    pipe, execs = _pipe(mods, spec, sizes[0])
    opt = torch.optim.SGD(parameters(mods), lr=0.5)
    ref, _ = build(3, "one" if kind != "untied" else "untied")
    ref_opt = torch.optim.SGD(parameters(ref), lr=0.5)
    try:
        for s, n in enumerate(sizes):
            rr.run(pipe.run_step(batches(s, n)))
            reference(ref, [(s, batches(s, n))])
            if kind == "copies":  # every step leaves both copies with the one gradient
                g0 = cast(torch.Tensor, mods[0].emb.weight).grad
                g2 = cast(torch.Tensor, mods[2].weight).grad
                assert g0 is not None and g2 is not None
                assert torch.equal(g0, g2)
            assert max_diff(state(mods), state(ref)) <= 1e-6, s
        opt.step()
        ref_opt.step()
    finally:
        _close(execs)
    assert max_diff(state(mods), state(ref)) <= 1e-6


class _Boom(nn.Module):
    """Wraps a stage; raises in the forward or the backward of one microbatch when armed."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.arm: str | None = None  # "forward" or "backward"
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.arm == "forward":
            raise RuntimeError("boom in the forward")
        if self.arm == "backward":  # the stage's own gradients come first, then it fails
            x = _FailBackward.apply(x)
        return self.inner(x)


class _FailBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom in the backward")


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_failed_step_leaves_the_accumulated_tied_gradient_in_place(where: str) -> None:
    # The stash is restored when a step fails: each copy holds its accumulated gradient
    # plus what the failed step's backwards had added here (unreduced), as autograd leaves
    # an untied parameter. Fails if the stash were lost (the tied .grad would be None or
    # this step's part only).
    def run(accumulated: bool) -> tuple[dict[str, torch.Tensor], str]:
        mods, _ = build(2, "copies")
        head = _Boom(mods[1])
        spec = {"wte": [(0, "emb.weight"), (1, "inner.weight")]}
        pipe, execs = _pipe([mods[0], head], spec, 3, policy="strict")
        try:
            if accumulated:
                rr.run(pipe.run_step(batches(0, 3), step=0))
            # the failing step: stage 0's backwards never run (its input gradient fails)
            head.arm = where
            with pytest.raises(RuntimeError, match="boom") as ei:
                rr.run(pipe.run_step(batches(1, 3), step=1))
        finally:
            _close(execs)
        return state(mods), str(ei.value)

    before_mods, spec = build(2, "copies")
    pipe, execs = _pipe(before_mods, spec, 3, policy="strict")
    try:
        rr.run(pipe.run_step(batches(0, 3), step=0))
    finally:
        _close(execs)
    stashed = state(before_mods)  # what step 0 left (tie reduced)
    alone, _ = run(accumulated=False)  # what the failing step alone leaves
    got, msg = run(accumulated=True)
    assert "boom" in msg
    for k in ("0.emb.weight.grad", "1.weight.grad"):
        want = stashed[k] + alone[k] if k in alone else stashed[k]
        torch.testing.assert_close(got[k], want, rtol=0, atol=1e-6)
    if where == "forward":  # nothing of the failed step reached a gradient
        assert "1.weight.grad" not in alone
        assert torch.equal(got["1.weight.grad"], stashed["1.weight.grad"])


def test_the_sync_face_accumulates_like_the_async_one() -> None:
    mods, spec = build(2, "copies")
    pipe, execs = _pipe(mods, spec, 3)
    ref, _ = build(2, "one")
    try:
        with pipe:
            for s in range(3):
                pipe.run_step_sync(batches(s, 3))
        reference(ref, [(s, batches(s, 3)) for s in range(3)])
    finally:
        _close(execs)
    assert max_diff(state(mods), state(ref)) <= 1e-6


def test_a_step_with_more_tasks_than_the_streams_tell_apart_is_refused() -> None:
    mods, _ = build(2, "untied")
    ex = rr.TorchStageExecutor({0: mods[0]}, loss_fn)
    plan = rr.StepPlan(topology=rr.Topology(stages=4097), microbatches=1)
    mb = batches(0, 1)
    try:
        with pytest.raises(rr.PlanError, match="at most 4096 virtual stages and 1048576"):
            ex._run(rr.Task(0, "F", 0), mb[0], rr.TaskContext(0, 0, plan, mb))
        off = rr.TorchStageExecutor({0: mods[0]}, loss_fn, task_rng=False)
        off._run(rr.Task(0, "F", 0), mb[0], rr.TaskContext(0, 0, plan, mb))  # no streams
        off.close()
    finally:
        ex.close()
