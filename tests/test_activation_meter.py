"""The activation meter: hand-counted bytes, what it must not count, what it must not change;
and ``TorchStageExecutor(measure_activations=...)`` through a ``LocalPipeline``."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import nn

import rrfp_async as rr
from rrfp_async.distributed._activation_meter import (
    ActivationMeter,
    storage_bytes,
    weight_storages,
)
from rrfp_lab.models import ImageTextConfig, build_stage_modules, loss_fn, make_microbatches

pytestmark = pytest.mark.timeout(120)

F32 = 4


def _lin_tanh() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh())


# ------------------------------------------------------------------ the meter alone (CPU)


def test_linear_tanh_counts_its_input_and_output_not_its_weight() -> None:
    mod, meter = _lin_tanh(), ActivationMeter()
    x = torch.randn(4, 3, requires_grad=True)
    with meter.measure(exclude=weight_storages(mod)) as m:
        y = mod(x)
    # linear saves x and weight.t() (a view of the weight: excluded); tanh saves its output
    assert m.bytes == (4 * 3 + 4 * 5) * F32
    assert m.saved_tensors == 3
    # not vacuous: without the exclusion the weight's storage (5 x 3) is counted once
    with meter.measure() as m2:
        y = mod(x)
    assert m2.bytes == (4 * 3 + 4 * 5 + 5 * 3) * F32
    y.sum().backward()
    assert x.grad is not None


class _Wrapper(torch.Tensor):
    """A wrapper subclass (as FSDP's and TP's ``DTensor`` parameters are): its storage
    object has no data (``data_ptr`` raises "invalid python storage")."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> _Wrapper:
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)  # type: ignore[attr-defined,no-any-return]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        raise NotImplementedError(func)


def test_wrapper_subclass_parameters_are_keyed_by_object_not_read() -> None:
    # torchtitan's stages are FSDP-wrapped (DTensor parameters): listing a stage's weights
    # raised "invalid python storage" at its first measured forward.
    mod = _lin_tanh()
    sharded = _Wrapper(torch.zeros(2, 3))
    mod.register_buffer("sharded", sharded)
    weights = weight_storages(mod)
    assert len(weights) == 2  # the linear's weight and bias; the wrapper has no storage
    assert storage_bytes([sharded]) == 2 * 3 * F32  # its elements, keyed by the object


def test_a_storage_saved_twice_or_through_views_counts_once() -> None:
    meter = ActivationMeter()
    x = torch.randn(6, 8, requires_grad=True)
    with meter.measure() as m:
        y = x * x  # mul saves self and other: x twice
    assert m.bytes == 6 * 8 * F32
    with meter.measure() as m:
        y = x[:3] * x[3:]  # two views of one storage: the whole storage, once
    assert m.bytes == 6 * 8 * F32
    with meter.measure() as m:
        h = torch.exp(x)  # saves its output h
        y = h * h  # saves h twice more
    assert m.bytes == 6 * 8 * F32  # h only: x is not saved by exp
    y.sum().backward()


def test_only_what_is_alive_at_the_end_counts() -> None:
    meter = ActivationMeter()
    x = torch.randn(16, 16, requires_grad=True)
    with meter.measure() as m:
        dropped = torch.exp(x)  # saves its output: freed with the graph below
        del dropped
        kept = torch.tanh(x)
    assert m.bytes == 16 * 16 * F32
    assert m.saved_tensors == 2  # both were saved; one was freed before the end
    kept.sum().backward()


def test_keep_and_hold_add_what_the_caller_keeps_once() -> None:
    meter = ActivationMeter()
    x = torch.randn(5, 7, requires_grad=True)
    with meter.measure(keep=[x]) as m:
        y = x + 1.0  # saves nothing
        m.hold([y])
    assert m.bytes == 2 * 5 * 7 * F32
    with meter.measure(keep=[x]) as m:
        y = torch.tanh(x * 2.0)  # saves its output
        m.hold([y, y.detach()])  # the same storage as the saved output
    assert m.bytes == 2 * 5 * 7 * F32
    assert storage_bytes([x, x.detach(), x[1:]]) == 5 * 7 * F32


def test_inplace_change_of_a_saved_tensor_still_raises() -> None:
    # torch skips its version check for tensors saved through hooks; the meter keeps it
    meter = ActivationMeter()
    a = torch.randn(3, requires_grad=True)
    with meter.measure():
        c = (a * 2).exp()
    with torch.no_grad():
        c.mul_(2)
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation.*activation meter"):
        c.sum().backward()


def test_a_saved_output_does_not_keep_itself_alive() -> None:
    # identity hooks (pack = lambda t: t) would: output -> grad_fn -> packed output
    meter = ActivationMeter()
    x = torch.randn(64, 64, requires_grad=True)
    with meter.measure():
        y = torch.tanh(x)
    ref = weakref.ref(y)
    del y
    gc.collect()
    assert ref() is None


class _SavesItsOutput(torch.autograd.Function):
    """Saves its input and its output; its forward makes a node (grad on inside)."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            torch.ones(1, requires_grad=True).exp()  # a node newer than this function's
        out = a.exp()
        ctx.save_for_backward(a, out)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        _, out = ctx.saved_tensors
        return g * out


def test_custom_function_outputs_do_not_keep_themselves_alive() -> None:
    meter = ActivationMeter()
    x = torch.randn(32, requires_grad=True)
    with meter.measure() as m:
        y = _SavesItsOutput.apply(x * 1.0)
    assert m.bytes == 2 * 32 * F32
    ref = weakref.ref(y)
    del y
    gc.collect()
    assert ref() is None


def test_a_saved_input_keeps_its_tensor_as_torch_does() -> None:
    # torch keeps the original variable of a saved non-output (W's test of the split
    # backward watches it through a weak reference); so does the meter
    meter = ActivationMeter()
    x = torch.randn(8, requires_grad=True)
    with meter.measure():
        h = x * 2.0
        y = h * h  # saves h, no output of the mul that saves it
    ref = weakref.ref(h)
    del h
    gc.collect()
    assert ref() is not None
    y.sum().backward()
    assert ref() is None  # freed with the graph
    assert x.grad is not None and torch.equal(x.grad, 8 * x.detach())


def test_gradients_are_bitwise_those_without_the_meter() -> None:
    torch.manual_seed(1)
    mod = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))
    x = torch.randn(10, 8)
    grads = []
    for enabled in (True, False):
        mod.zero_grad()
        with ActivationMeter(enabled=enabled).measure() as m:
            loss = mod(x).square().mean()
        loss.backward()
        grads.append([p.grad.clone() for p in mod.parameters() if p.grad is not None])
        assert (m.bytes > 0) == enabled
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_disabled_meter_installs_nothing() -> None:
    meter = ActivationMeter(enabled=False)
    a = torch.randn(3, requires_grad=True)
    with meter.measure(keep=[a]) as m:
        c = (a * 2).exp()
    with torch.no_grad():
        c.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as e:
        c.sum().backward()
    assert "activation meter" not in str(e.value)  # torch's own check
    assert m.bytes == 0


def test_hooks_are_removed_when_the_forward_raises() -> None:
    meter = ActivationMeter()
    x = torch.randn(4, requires_grad=True)

    def forward_that_raises() -> None:
        with meter.measure():
            torch.tanh(x)
            raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        forward_that_raises()
    with meter.measure() as outer:
        pass
    assert outer.bytes == 0
    y = torch.tanh(x)  # saved by torch itself again: its version check, not ours
    with torch.no_grad():
        y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace") as e:
        y.sum().backward()
    assert "activation meter" not in str(e.value)


def test_bad_arguments() -> None:
    with pytest.raises(rr.PlanError, match="mode must be 'saved' or 'allocator'"):
        ActivationMeter(mode="bytes")  # type: ignore[arg-type]
    with pytest.raises(rr.PlanError, match="enabled must be True or False"):
        ActivationMeter(enabled=1)  # type: ignore[arg-type]
    if not torch.cuda.is_available():
        with pytest.raises(rr.PlanError, match="CUDA is not available"):
            ActivationMeter(mode="allocator")
    with pytest.raises(rr.PlanError, match="measure_activations must be a bool"):
        rr.TorchStageExecutor({0: nn.Linear(2, 2)}, measure_activations="yes")  # type: ignore[arg-type]


# ------------------------------------------------------------------ CUDA (GPU machines)


@pytest.mark.gpu
def test_allocator_mode_counts_the_blocks_the_forward_keeps() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.manual_seed(0)
    mod = nn.Sequential(nn.Linear(64, 128), nn.Tanh()).cuda()
    x = torch.randn(256, 64, device="cuda", requires_grad=True)
    mod(x).sum().backward()  # warm-up: cuBLAS's workspace is allocated once, here
    torch.cuda.synchronize()
    alloc, saved = ActivationMeter(mode="allocator"), ActivationMeter(mode="saved")
    with alloc.measure(keep=[x]) as a:
        y = mod(x)
    # the tanh output stays (saved); the linear output is freed; x was there before (keep)
    want = (256 * 128 + 256 * 64) * F32  # multiples of 512: no rounding
    assert a.bytes == want
    with saved.measure(exclude=weight_storages(mod), keep=[x]) as s:
        y2 = mod(x)
    assert s.bytes == want
    (y.sum() + y2.sum()).backward()


@pytest.mark.gpu
def test_executor_on_a_cuda_worker_measures_with_the_allocator() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    cfg = ImageTextConfig(n_layers=2)
    mods = {v: m.cuda() for v, m in build_stage_modules(cfg, 2, [0, 1]).items()}
    execs = [
        rr.TorchStageExecutor(
            {v: mods[v]},
            loss_fn,
            rank=v,
            worker=rr.loop.ComputeWorker("cuda"),
            measure_activations=True,
        )
        for v in range(2)
    ]
    assert all(e._meter.meter.mode == "allocator" for e in execs)
    m = 4
    plan = rr.StepPlan(topology=rr.Topology(stages=2), microbatches=m)
    pipe = rr.LocalPipeline(rr.StepSchedule.build(plan, "1f1b"), execs, policy="strict")
    mbs = [_to_cuda(mb) for mb in make_microbatches(m, cfg, seed=0)]
    try:
        rr.run(pipe.run_step(mbs))
        for v, e in enumerate(execs):
            got = e.activation_bytes()
            assert sorted(got) == [(v, i) for i in range(m)]
            # the allocator's count is device-wide: the other stage's thread allocating or
            # freeing during a forward moves it (documented), so no exact figure here
            assert all(b >= 0 for b in got.values()) and sum(got.values()) > 0, got
    finally:
        for e in execs:
            e.close()


def _to_cuda(mb: rr.Microbatch) -> rr.Microbatch:
    data = {k: t.cuda() for k, t in mb.data.items()}
    return rr.Microbatch(
        index=mb.index, tokens=mb.tokens, patches=mb.patches, images=mb.images, data=data
    )


# ------------------------------------------------------------------ through the executor

CFG = ImageTextConfig(n_layers=4)


def _pipeline(
    measure: bool, m: int, *, split: bool = False, stages: int = 2
) -> tuple[rr.LocalPipeline, list[rr.TorchStageExecutor], dict[int, nn.Module]]:
    mods = build_stage_modules(CFG, stages, list(range(stages)))
    execs = [
        rr.TorchStageExecutor({v: mods[v]}, loss_fn, rank=v, measure_activations=measure)
        for v in range(stages)
    ]
    plan = rr.StepPlan(
        topology=rr.Topology(stages=stages),
        microbatches=m,
        split_backward=split,
        ordered_weights=split,
    )
    sched = rr.StepSchedule.build(plan, "zb_h1" if split else "1f1b")
    return rr.LocalPipeline(sched, execs, policy="strict"), execs, mods


def _train(
    measure: bool, steps: Sequence[list[rr.Microbatch]], *, split: bool = False
) -> tuple[list[dict[int, float]], dict[str, torch.Tensor], list[dict[tuple[int, int], int]]]:
    pipe, execs, mods = _pipeline(measure, len(steps[0]), split=split)
    params = [p for mod in mods.values() for p in mod.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    losses, measured = [], []
    try:
        for mbs in steps:
            opt.zero_grad()
            rr.run(pipe.run_step(mbs))
            opt.step()
            losses.append(dict(execs[-1].losses))
            measured.append({k: b for e in execs for k, b in e.activation_bytes().items()})
    finally:
        for e in execs:
            e.close()
    state = {
        f"{v}.{n}": p.detach().clone() for v, mod in mods.items() for n, p in mod.named_parameters()
    }
    return losses, state, measured


@pytest.mark.parametrize("split", [False, True], ids=["B", "I+W"])
def test_executor_reports_every_forward_and_trains_bitwise_as_without(split: bool) -> None:
    m = 4
    steps = [make_microbatches(m, CFG, seed=s) for s in (0, 1)]
    losses_on, state_on, measured = _train(True, steps, split=split)
    losses_off, state_off, unmeasured = _train(False, steps, split=split)
    assert losses_on == losses_off  # floats, compared exactly
    assert state_on.keys() == state_off.keys()
    assert all(torch.equal(state_on[k], state_off[k]) for k in state_on), "params differ"
    # every (stage, microbatch) of each step, each step's own numbers (reset at its begin)
    for got in measured:
        assert sorted(got) == [(v, i) for v in range(2) for i in range(m)]
        assert all(b > 0 for b in got.values())
    assert measured[0] != measured[1]  # other sizes, other bytes (not the first step's kept)
    assert unmeasured == [{}, {}]


def test_executor_bytes_grow_with_the_microbatch_and_skip_forward_only_steps() -> None:
    def mb(i: int, k: int, length: int) -> rr.Microbatch:
        g = torch.Generator().manual_seed(i)
        ppi = CFG.patches_per_image
        data = {
            "images": torch.rand((k, CFG.channels, CFG.image_size, CFG.image_size), generator=g),
            "text": torch.randint(0, CFG.vocab, (length,), generator=g),
        }
        return rr.Microbatch(index=i, tokens=k * ppi + length, patches=k * ppi, images=k, data=data)

    pipe, execs, _ = _pipeline(True, 3)
    try:
        rr.run(pipe.run_step([mb(0, 0, 8), mb(1, 0, 16), mb(2, 2, 16)]))
        got = {k: b for e in execs for k, b in e.activation_bytes().items()}
        for v in range(2):
            assert got[(v, 0)] < got[(v, 1)] < got[(v, 2)], got
        # stage 1 keeps its received input [1, S, d] (the stash) and what its blocks save
        assert got[(1, 0)] > 8 * CFG.d_model * F32
        rr.run(pipe.run_step([mb(0, 0, 8), mb(1, 0, 16), mb(2, 2, 16)], train=False))
        assert all(e.activation_bytes() == {} for e in execs)  # nothing is kept for a backward
    finally:
        for e in execs:
            e.close()
