"""The I/W split of ``TorchStageExecutor``: I keeps what W needs, W does not rerun the backward.

Every check compares against a plain ``B`` on the same module and inputs: per microbatch the
parameter gradients of I + W are those of B (bitwise: the same backward functions on the same
values), W never runs the activation part of the backward again (small weight ops: no autograd
engine run at all; large ones: one run that starts and ends at the op), and with ordered W the
accumulated ``.grad`` is bitwise independent of the order of the Is. Most tests run both ways
W can take (``w_path``).
"""

from __future__ import annotations

import asyncio
import itertools
import weakref
from collections.abc import Sequence
from typing import Any, cast

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import rrfp_async as rr
from rrfp_async.distributed import _split_backward as sb
from rrfp_lab._split_measure import measure_split_backward
from rrfp_lab.models import ImageTextConfig, build_stage_modules, loss_fn, make_microbatches

CFG = ImageTextConfig()
STAGES = 4


# ------------------------------------------------------------------------------------------
# Helpers


@pytest.fixture(params=["direct", "engine"])
def w_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test twice: W calling the weight ops' nodes directly (what a model as small as
    these gets), and W asking the engine for every op it can (what large ops get)."""
    if request.param == "engine":
        monkeypatch.setattr(sb, "_ENGINE_MIN_WORK", 0)
    return str(request.param)


def _example() -> tuple[dict[int, nn.Module], list[rr.Microbatch], list[Any]]:
    """The example model in 4 stages, 4 microbatches, and each stage's inputs per microbatch."""
    modules = build_stage_modules(CFG, STAGES, range(STAGES))
    mbs = make_microbatches(4, CFG, seed=7)
    inputs: list[Any] = []
    with torch.no_grad():
        for mb in mbs:
            per_stage: list[Any] = [mb]
            h: Any = mb.data
            for v in range(STAGES - 1):
                h = modules[v](h)
                # As it arrives from the previous stage: a leaf that requires grad.
                per_stage.append(h.detach().requires_grad_(True))
            inputs.append(per_stage)
    return modules, mbs, inputs


def _plan(split: bool, ordered: bool = False, n: int = 4) -> rr.StepPlan:
    return rr.StepPlan(
        topology=rr.Topology(stages=STAGES),
        microbatches=n,
        split_backward=split,
        ordered_weights=ordered,
    )


def _out_grad(module: nn.Module, x: Any, seed: int) -> torch.Tensor:
    with torch.no_grad():
        out = module(x)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out.shape, generator=g) * 1e-2


def _grads(module: nn.Module) -> dict[str, torch.Tensor | None]:
    return {
        n: None if p.grad is None else p.grad.detach().clone() for n, p in module.named_parameters()
    }


def _zero(module: nn.Module) -> None:
    for p in module.parameters():
        p.grad = None


def _tasks(
    ex: rr.TorchStageExecutor, ctx: rr.TaskContext, tasks: Sequence[tuple[rr.Task, Any]]
) -> list[Any]:
    """Run ``tasks`` in order through ``execute`` (the compute thread); their outputs."""

    def arrived(t: rr.Task, d: Any) -> Any:
        # A middle stage's input as a channel delivers it: a leaf that requires grad when
        # the producer's output did (every float activation here).
        if t.kind == "F" and t.stage > 0 and isinstance(d, torch.Tensor):
            return d.detach().requires_grad_(d.is_floating_point())
        return d

    async def go() -> list[Any]:
        return [await ex.execute(t, arrived(t, d), ctx) for t, d in tasks]

    return rr.run(go())


def _assert_same(a: dict[str, torch.Tensor | None], b: dict[str, torch.Tensor | None]) -> None:
    assert a.keys() == b.keys()
    for n in a:
        x, y = a[n], b[n]
        assert (x is None) == (y is None), n
        if x is not None:
            assert y is not None
            assert torch.equal(x, y), (n, (x - y).abs().max().item())


# ------------------------------------------------------------------------------------------
# (1) Per microbatch, I + W gives exactly B's gradients


@pytest.mark.parametrize("v", range(STAGES), ids=["first", "second", "third", "last"])
def test_split_gradients_equal_plain_backward_bitwise(v: int, w_path: str) -> None:
    modules, mbs, inputs = _example()
    mod = modules[v]
    last = v == STAGES - 1
    ex = rr.TorchStageExecutor({v: mod}, loss_fn)
    try:
        for m, mb in enumerate(mbs):
            x = inputs[m][v]
            g = None if last else _out_grad(mod, x if v else mb.data, seed=m)
            ctx_b = rr.TaskContext(0, 2 * m, _plan(False), mbs)
            _zero(mod)
            _, gx_b = _tasks(ex, ctx_b, [(rr.Task(v, "F", m), x), (rr.Task(v, "B", m), g)])
            want = _grads(mod)
            ctx_s = rr.TaskContext(0, 2 * m + 1, _plan(True), mbs)
            _zero(mod)
            _, gx_i, none = _tasks(
                ex,
                ctx_s,
                [(rr.Task(v, "F", m), x), (rr.Task(v, "I", m), g), (rr.Task(v, "W", m), None)],
            )
            assert none is None
            if v == 0:  # the input is data: no input gradient either way
                assert gx_b is None and gx_i is None
            else:
                assert torch.equal(gx_i, gx_b)
            got = _grads(mod)
            _assert_same(got, want)
            # every parameter got a gradient (images or not: zeros count)
            assert all(t is not None for t in got.values())
            assert not ex._kept and not ex._stash  # W released what I kept
    finally:
        ex.close()


def test_split_accumulates_like_backward_over_microbatches(w_path: str) -> None:
    modules, mbs, inputs = _example()
    v = 1
    mod = modules[v]
    grads = [_out_grad(mod, inputs[m][v], seed=m) for m in range(len(mbs))]
    ex = rr.TorchStageExecutor({v: mod}, loss_fn)
    try:
        _zero(mod)
        _tasks(
            ex,
            rr.TaskContext(0, 0, _plan(False), mbs),
            [
                (rr.Task(v, cast(rr.Kind, k), m), inputs[m][v] if k == "F" else grads[m])
                for m in range(len(mbs))
                for k in "FB"
            ],
        )
        want = _grads(mod)
        _zero(mod)
        seq: list[tuple[rr.Task, Any]] = [(rr.Task(v, "F", m), inputs[m][v]) for m in range(4)]
        seq += [(rr.Task(v, "I", m), grads[m]) for m in range(4)]
        seq += [(rr.Task(v, "W", m), None) for m in range(4)]
        _tasks(ex, rr.TaskContext(0, 1, _plan(True), mbs), seq)
        _assert_same(_grads(mod), want)
    finally:
        ex.close()


class _Count(torch.autograd.Function):
    """Identity whose backward counts its calls."""

    calls = 0

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        _Count.calls += 1
        return g


class _ScaleFn(torch.autograd.Function):
    """``x * w`` as a custom Function: a weight op W cannot call node by node."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum_to_size(w.shape)


class _Odd(nn.Module):
    """Parameters used in the ways a stage graph can hold them."""

    def __init__(self, custom: bool = False) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.custom = custom
        self.lin = nn.Linear(8, 8)  # used twice: a parameter shared by two weight ops
        self.scale = nn.Parameter(torch.rand(8, generator=g) + 0.5)  # elementwise weight
        self.bias = nn.Parameter(torch.randn(8, generator=g))  # broadcast: reduced to [8]
        self.table = nn.Parameter(torch.randn(16, 8, generator=g))  # sliced: param-only node
        self.proj = nn.Parameter(torch.randn(8, 12, generator=g) * 0.3)  # split in 3 chunks
        self.frozen = nn.Parameter(torch.randn(8, generator=g), requires_grad=False)
        self.unused = nn.Parameter(torch.randn(3, generator=g))  # gets no gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = torch.relu(self.lin(x))
        self.saved = weakref.ref(r)  # saved by the second weight op for its dW
        h = self.lin(r)
        h = _Count.apply(h)
        h = _ScaleFn.apply(h, self.scale) if self.custom else h * self.scale
        half = self.bias * 0.5  # a parameter-only node under two weight ops
        h = h * half + half + self.table[: h.shape[1]] * self.frozen
        a, b, c = (h @ self.proj).chunk(3, dim=-1)
        return torch.cat([a * b, c.tanh()], dim=-1)


class _Embed(nn.Module):
    """A first stage on integer tokens: nothing but parameters reaches the output."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.token = nn.Parameter(torch.randn(10, 8, generator=g))
        self.pos = nn.Parameter(torch.randn(6, 8, generator=g))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.token) + self.pos[: tokens.shape[0]]


def _odd_run(
    mod: nn.Module, first: bool, data: list[torch.Tensor], split: bool
) -> tuple[dict[str, torch.Tensor | None], list[Any]]:
    """F + B (or F + I + W) of every microbatch on stage 0 or 1 of a 3-stage plan."""
    v = 0 if first else 1
    plan = rr.StepPlan(topology=rr.Topology(stages=3), microbatches=len(data), split_backward=split)
    ex = rr.TorchStageExecutor({v: mod}, loss_fn)
    outs: list[Any] = []
    try:
        _zero(mod)
        for m, x in enumerate(data):
            with torch.no_grad():
                g = torch.randn(mod(x).shape, generator=torch.Generator().manual_seed(m))
            kinds = "FIW" if split else "FB"
            ctx = rr.TaskContext(0, m, plan, list(range(len(data))))
            res = _tasks(
                ex, ctx, [(rr.Task(v, cast(rr.Kind, k), m), x if k == "F" else g) for k in kinds]
            )
            outs.append(res[1])
            assert not ex._kept
    finally:
        ex.close()
    return _grads(mod), outs


@pytest.mark.parametrize("custom", [False, True], ids=["graph", "custom-function-fallback"])
def test_split_handles_shared_sliced_broadcast_frozen_unused_params(
    custom: bool, w_path: str
) -> None:
    mod = _Odd(custom)
    g = torch.Generator().manual_seed(3)
    data = [torch.randn(2, 5, 8, generator=g) for _ in range(3)]
    want, gx_b = _odd_run(mod, first=False, data=data, split=False)
    got, gx_s = _odd_run(mod, first=False, data=data, split=True)
    assert want["frozen"] is None and got["frozen"] is None
    assert want["unused"] is None and got["unused"] is None
    for n, t in want.items():
        if t is not None:
            torch.testing.assert_close(got[n], t, rtol=1e-6, atol=1e-7, msg=n)
    for a, b in zip(gx_b, gx_s, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("first", [True, False], ids=["first-stage-data", "middle"])
def test_split_on_a_data_input_stage(first: bool, w_path: str) -> None:
    # Stage 0 takes data (a float tensor that does not require grad): I still stops at the
    # weight ops and W does only their parameter part.
    mod = _Odd()
    g = torch.Generator().manual_seed(4)
    data = [torch.randn(2, 5, 8, generator=g) for _ in range(2)]
    want, _ = _odd_run(mod, first=first, data=data, split=False)
    _Count.calls = 0
    got, outs = _odd_run(mod, first=first, data=data, split=True)
    assert _Count.calls == len(data)
    if first:
        assert outs == [None, None]
    for n, t in want.items():
        if t is not None:
            torch.testing.assert_close(got[n], t, rtol=1e-6, atol=1e-7, msg=n)


def test_split_parameter_only_stage(w_path: str) -> None:
    # Integer tokens -> embedding: the whole graph depends on parameters only, so I has
    # nothing to compute and W runs it all.
    mod = _Embed()
    data = [torch.tensor([1, 4, 4, 9]), torch.tensor([0, 3])]
    want, _ = _odd_run(mod, first=True, data=data, split=False)
    got, outs = _odd_run(mod, first=True, data=data, split=True)
    assert outs == [None, None]
    _assert_same(got, want)


def test_weight_task_releases_what_input_task_kept(w_path: str) -> None:
    mod = _Odd()
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(8))
    g = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(9))
    plan = rr.StepPlan(topology=rr.Topology(stages=3), microbatches=1, split_backward=True)
    ex = rr.TorchStageExecutor({1: mod}, loss_fn)
    try:
        ctx = rr.TaskContext(0, 0, plan, [0])
        _tasks(ex, ctx, [(rr.Task(1, "F", 0), x), (rr.Task(1, "I", 0), g)])
        assert mod.saved() is not None  # W needs it (the input of a weight op)
        _tasks(ex, ctx, [(rr.Task(1, "W", 0), None)])
        assert mod.saved() is None and not ex._kept
    finally:
        ex.close()


def test_split_stage_without_parameters() -> None:
    data = [torch.randn(3, 4)]
    got, outs = _odd_run(nn.Tanh(), first=False, data=data, split=True)
    _, want = _odd_run(nn.Tanh(), first=False, data=data, split=False)
    assert got == {}
    assert torch.equal(outs[0], want[0])


# ------------------------------------------------------------------------------------------
# (2) W does not rerun the stage's backward


def test_weight_task_does_not_rerun_the_backward(
    monkeypatch: pytest.MonkeyPatch, w_path: str
) -> None:
    mod = _Odd()
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(5))
    g = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(6))
    plan = rr.StepPlan(topology=rr.Topology(stages=3), microbatches=1, split_backward=True)
    ex = rr.TorchStageExecutor({1: mod}, loss_fn)
    engine_runs: list[Any] = []
    real_grad, real_backward = torch.autograd.grad, torch.autograd.backward

    def grad(outputs: Any, inputs: Any, *a: Any, **k: Any) -> Any:
        engine_runs.append(outputs)
        return real_grad(outputs, inputs, *a, **k)

    def backward(*a: Any, **k: Any) -> Any:
        engine_runs.append(a)
        return real_backward(*a, **k)

    monkeypatch.setattr(torch.autograd, "grad", grad)
    monkeypatch.setattr(torch.autograd, "backward", backward)
    try:
        ctx = rr.TaskContext(0, 0, plan, [0])
        _Count.calls = 0
        _tasks(ex, ctx, [(rr.Task(1, "F", 0), x), (rr.Task(1, "I", 0), g)])
        assert _Count.calls == 1 and len(engine_runs) == 1  # I: one backward through the stage
        ops = [m for m, _, _ in ex._kept[(1, 0)].ops]
        _tasks(ex, ctx, [(rr.Task(1, "W", 0), None)])
        # W did not run the activation part of the backward again (the counting identity
        # sits between weight ops): either no engine run at all, or single-op runs that
        # start at a weight op.
        assert _Count.calls == 1
        in_w = engine_runs[1:]
        if w_path == "direct":
            assert in_w == []
        else:
            assert 0 < len(in_w) < len(ops)  # ops with shared parameter inputs: called
            for outputs in in_w:
                assert {e.node for e in outputs} <= set(ops) and len({e.node for e in outputs}) == 1
        assert mod.lin.weight.grad is not None and mod.proj.grad is not None
    finally:
        ex.close()


def test_input_task_computes_no_weight_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    # I asks the engine for the input gradient and the weight ops' incoming gradients only:
    # never for a parameter (so no dW matmul runs in I).
    modules, mbs, inputs = _example()
    v = 2
    mod = modules[v]
    params = {id(p) for p in mod.parameters()}
    asked: list[Any] = []
    real_grad = torch.autograd.grad

    def grad(outputs: Any, inputs: Any, *a: Any, **k: Any) -> Any:
        asked.extend(inputs)
        return real_grad(outputs, inputs, *a, **k)

    monkeypatch.setattr(torch.autograd, "grad", grad)
    ex = rr.TorchStageExecutor({v: mod}, loss_fn)
    try:
        g = _out_grad(mod, inputs[0][v], seed=0)
        ctx = rr.TaskContext(0, 0, _plan(True), mbs)
        _tasks(ex, ctx, [(rr.Task(v, "F", 0), inputs[0][v]), (rr.Task(v, "I", 0), g)])
        assert asked and not any(id(t) in params for t in asked)
        assert all(p.grad is None for p in mod.parameters())
        kept = ex._kept[(v, 0)]
        assert kept.recompute is None and len(kept.ops) == 16  # 8 weight ops per block
        _tasks(ex, ctx, [(rr.Task(v, "W", 0), None)])
    finally:
        ex.close()


# ------------------------------------------------------------------------------------------
# (3) Ordered W: .grad is bitwise independent of the order of the Is


@pytest.mark.parametrize("v", [0, 2, 3], ids=["first", "middle", "last"])
def test_ordered_weights_are_bitwise_independent_of_input_grad_order(v: int, w_path: str) -> None:
    modules, mbs, inputs = _example()
    mod = modules[v]
    n = len(mbs)
    last = v == STAGES - 1
    grads = [
        None if last else _out_grad(mod, inputs[m][v] if v else mbs[m].data, m) for m in range(n)
    ]
    plan = _plan(True, ordered=True, n=n)
    results = []
    ex = rr.TorchStageExecutor({v: mod}, loss_fn)
    try:
        for step, order in enumerate([(0, 1, 2, 3), (3, 1, 0, 2), (2, 3, 1, 0)]):
            _zero(mod)
            seq: list[tuple[rr.Task, Any]] = [(rr.Task(v, "F", m), inputs[m][v]) for m in range(n)]
            seq += [(rr.Task(v, "I", m), grads[m]) for m in order]
            seq += [(rr.Task(v, "W", m), None) for m in range(n)]  # microbatch order
            _tasks(ex, rr.TaskContext(0, step, plan, mbs), seq)
            results.append(_grads(mod))
    finally:
        ex.close()
    for a, b in itertools.pairwise(results):
        _assert_same(a, b)


# ------------------------------------------------------------------------------------------
# Bookkeeping and the benchmark


def test_step_with_kept_weight_work_left_raises() -> None:
    mod = nn.Linear(4, 4)
    plan = rr.StepPlan(topology=rr.Topology(stages=3), microbatches=1, split_backward=True)
    ex = rr.TorchStageExecutor({1: mod}, loss_fn)
    try:
        x, g = torch.randn(2, 4), torch.randn(2, 4)
        _tasks(
            ex, rr.TaskContext(0, 0, plan, [0]), [(rr.Task(1, "F", 0), x), (rr.Task(1, "I", 0), g)]
        )
        with pytest.raises(rr.PlanError, match=r"left activations \[\(1, 0\)\]"):
            _tasks(ex, rr.TaskContext(0, 1, plan, [0]), [(rr.Task(1, "F", 0), x)])
    finally:
        ex.close()


def test_measure_split_backward_runs() -> None:
    r = measure_split_backward(stages=2, stage=1, microbatches=2, repeats=1)
    for k in ("b", "i", "w", "iw", "ratio", "b_cpu", "iw_cpu", "ratio_cpu"):
        assert r[k] > 0, k
    assert r["iw"] == pytest.approx(r["i"] + r["w"])
    assert (r["stage"], r["stages"], r["microbatches"], r["split"]) == (1, 2, 2, 1.0)
    r0 = measure_split_backward(stages=2, stage=0, microbatches=1, repeats=1)
    assert r0["stage"] == 0 and r0["b"] > 0
    with pytest.raises(rr.PlanError, match="outside"):
        measure_split_backward(stages=2, stage=2)


def test_a_failed_step_does_not_block_the_next() -> None:
    """A step that failed after a forward left its activation stashed: the next step refuses
    to start (a leak would be a bug) unless the stage said the step failed; then the stash is
    dropped and the next step runs and gives the same gradients as on a fresh executor."""
    modules, mbs, inputs = _example()
    v = 1
    mod = modules[v]
    x0, x1 = inputs[0][v], inputs[1][v]
    g = _out_grad(mod, x1, seed=1)
    ex = rr.TorchStageExecutor({v: mod}, loss_fn)
    try:
        _tasks(ex, rr.TaskContext(0, 0, _plan(False), mbs), [(rr.Task(v, "F", 0), x0)])
        with pytest.raises(rr.PlanError, match="step 0 left activations"):
            _tasks(ex, rr.TaskContext(0, 1, _plan(False), mbs), [(rr.Task(v, "F", 1), x1)])
        ex.step_failed(0)
        _zero(mod)
        ctx = rr.TaskContext(0, 1, _plan(False), mbs)
        _tasks(ex, ctx, [(rr.Task(v, "F", 1), x1), (rr.Task(v, "B", 1), g)])
        got = _grads(mod)
    finally:
        ex.close()
    fresh = rr.TorchStageExecutor({v: mod}, loss_fn)
    try:
        _zero(mod)
        ctx = rr.TaskContext(0, 0, _plan(False), mbs)
        _tasks(fresh, ctx, [(rr.Task(v, "F", 1), x1), (rr.Task(v, "B", 1), g)])
        _assert_same(got, _grads(mod))
    finally:
        fresh.close()


def test_an_output_of_a_dead_step_is_not_sent() -> None:
    """The output hook carries the task's step; the stage drops the output of a step that is
    no longer running (it failed while the task computed) instead of sending it as part of
    the step that runs now."""
    sent: list[tuple[int, int, rr.Task]] = []

    class Endpoint:
        threadsafe_send = True
        rank = 0
        inflight = 0

        def bind(self, stage: Any) -> None:
            pass

        def send(self, dst: int, step: int, task: rr.Task, payload: Any) -> None:
            sent.append((dst, step, task))

    class Executor:
        output_hook: Any = None

        def set_output_hook(self, hook: Any, /) -> None:
            self.output_hook = hook

        async def execute(self, task: rr.Task, data: Any, ctx: rr.TaskContext) -> Any:
            return None

    plan = rr.StepPlan(topology=rr.Topology(stages=2), microbatches=2)
    sched = rr.StepSchedule.build(plan, "1f1b")
    ex = Executor()
    stage = rr.StageLoop(0, schedule=sched, executor=ex, endpoint=Endpoint())
    assert ex.output_hook is not None

    async def go() -> None:
        started = asyncio.Event()
        release = asyncio.Event()

        async def slow_execute(task: rr.Task, data: Any, ctx: rr.TaskContext) -> Any:
            started.set()
            await release.wait()
            return None

        ex.execute = slow_execute  # type: ignore[method-assign]
        run = asyncio.ensure_future(stage.run_step([0, 1], step=5))
        await started.wait()
        run.cancel()  # step 5 dies while its first forward computes
        with pytest.raises(asyncio.CancelledError):
            await run
        ex.execute = Executor.execute.__get__(ex)  # type: ignore[method-assign]
        nxt = asyncio.ensure_future(stage.run_step([0, 1], step=6))
        await asyncio.sleep(0)
        ex.output_hook(rr.Task(0, "F", 0), "late", 5)  # the dead step's compute ends now
        ex.output_hook(rr.Task(0, "F", 1), "live", 6)
        nxt.cancel()
        with pytest.raises(asyncio.CancelledError):
            await nxt

    rr.run(go())
    assert sent == [(1, 6, rr.Task(1, "F", 1))]  # "late" (F0 of step 5) was dropped
