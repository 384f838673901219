"""The DeepSpeed drop-in's pure parts, without DeepSpeed (the compat tier runs it against
DeepSpeed's engine: ``tests/compat/test_deepspeed.py``): the executor's per-microbatch
state on a stand-in engine whose handlers behave as ``PipelineEngine``'s, the loss fold,
what crosses a stage boundary, and ``install``'s checks."""

from __future__ import annotations

import importlib.util
import types
from typing import Any

import pytest
import torch

from rrfp_async._tasks import Task
from rrfp_async.errors import PlanError
from rrfp_async.integrations import _deepspeed_executor as dx


class FakeEngine:
    """The parts of ``PipelineEngine`` the executor uses, as DeepSpeed's handlers act:
    ``_exec_forward_pass`` keeps one ``loss`` slot and adds to ``total_loss``;
    ``_exec_backward_pass`` reads the ``loss`` slot on the last stage."""

    def __init__(self, *, first: bool, last: bool, data: list[Any]) -> None:
        self.stage_id = 0 if first else 1
        self.module = torch.nn.Linear(2, 2)
        self.first, self.last = first, last
        self.data = iter(data)
        self.pipe_buffers: dict[str, list[Any]] = {
            k: [None] * 8 for k in ("inputs", "labels", "outputs", "output_tensors")
        }
        self.loss: Any = None
        self.total_loss: Any = None
        self.total_additional_losses: Any = None
        self.fwd_outputs: list[Any] = []
        self.grad_layer: Any = None
        self.eval_return_logits = False
        self.outputs: Any = None
        self.has_attention_mask = False
        self.has_bool_tensors = False
        self.backward_losses: list[float] = []

    def is_first_stage(self) -> bool:
        return self.first

    def is_last_stage(self) -> bool:
        return self.last

    def _exec_load_micro_batch(self, k: int) -> None:
        x, y = next(self.data)
        if self.first:
            self.pipe_buffers["inputs"][k] = x
        if self.last:
            self.pipe_buffers["labels"][k] = y

    def _exec_forward_pass(self, k: int) -> None:
        x = self.pipe_buffers["inputs"][k]
        out = x * 2.0
        self.pipe_buffers["outputs"][k] = out
        if self.last:
            self.loss = (out - self.pipe_buffers["labels"][k]).pow(2).mean()
            self.fwd_outputs.append(self.loss.detach())
            total = torch.zeros_like(self.loss) if self.total_loss is None else self.total_loss
            total += self.loss.detach()
            self.total_loss = total

    def _exec_backward_pass(self, k: int) -> None:
        if self.last:
            self.backward_losses.append(float(self.loss.detach()))
            self.loss.backward()
        else:
            self.pipe_buffers["outputs"][k].backward(self.grad_layer)


def _ctx(m: int) -> Any:
    return types.SimpleNamespace(plan=types.SimpleNamespace(microbatches=m), rank=1, step=0)


def _items(m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(3, generator=g), torch.randn(3, generator=g)) for _ in range(m)]


def test_the_last_stage_keeps_each_microbatchs_loss_for_its_own_backward() -> None:
    """DeepSpeed's ``loss`` is one slot: a second forward before the first backward would
    overwrite it. The executor keeps one per microbatch and folds the totals in microbatch
    order, whatever order the tasks ran in."""
    m = 3
    items = _items(m)
    e = FakeEngine(first=False, last=True, data=items)
    ex = dx.DeepSpeedExecutor(e, rank=1)
    try:
        ex.begin_step(_ctx(m), previous=None, failed=False)
        ctx = _ctx(m)
        for k in (0, 1, 2):  # forwards; each receives its input
            ex._dforward(Task(1, "F", k), items[k][0].clone(), ctx)
        for k in (2, 0, 1):  # backwards in another order
            ex._dbackward(Task(1, "B", k), None, ctx)
        ex.fold(m)
    finally:
        ex.close()
    want = [float(((x * 2.0) - y).pow(2).mean()) for x, y in items]
    assert e.backward_losses == [want[2], want[0], want[1]]
    assert [float(t) for t in e.fwd_outputs] == want  # (microbatch order)
    assert float(e.loss.detach()) == want[-1]  # DeepSpeed's slot: the last microbatch's
    total = torch.zeros(())
    for k in range(m):
        total += torch.tensor(want[k])
    assert torch.equal(e.total_loss, total)


def test_the_first_stage_reads_the_data_in_microbatch_order_and_sends_input_grads() -> None:
    m = 3
    items = _items(m)
    e = FakeEngine(first=True, last=False, data=items)
    ex = dx.DeepSpeedExecutor(e, rank=0)
    try:
        ctx = _ctx(m)
        ex.begin_step(ctx, previous=None, failed=False)
        out2 = ex._dforward(Task(0, "F", 2), None, ctx)  # reads items 0, 1, 2 in order
        assert torch.equal(out2, items[2][0] * 2.0) and not out2.requires_grad
        assert torch.equal(e.pipe_buffers["inputs"][0], items[0][0])
        out0 = ex._dforward(Task(0, "F", 0), None, ctx)  # (already read: not again)
        assert torch.equal(out0, items[0][0] * 2.0)
    finally:
        ex.close()


def test_a_middle_stage_receives_a_leaf_that_wants_grad_and_sends_its_grad() -> None:
    e = FakeEngine(first=False, last=False, data=[])
    ex = dx.DeepSpeedExecutor(e, rank=1)
    try:
        ctx = _ctx(1)
        ex.begin_step(ctx, previous=None, failed=False)
        x = torch.ones(3)
        ex._dforward(Task(1, "F", 0), x, ctx)
        got = e.pipe_buffers["inputs"][0]
        assert got.requires_grad and got.is_leaf
        g = ex._dbackward(Task(1, "B", 0), torch.full((3,), 0.5), ctx)
        assert torch.equal(g, torch.full((3,), 1.0))  # d(2x)/dx * 0.5
        assert e.pipe_buffers["inputs"][0] is None  # freed as DeepSpeed frees it
    finally:
        ex.close()


def test_a_dry_data_iter_is_a_plan_error_naming_the_microbatch_and_the_fix() -> None:
    e = FakeEngine(first=True, last=False, data=_items(1))
    ex = dx.DeepSpeedExecutor(e, rank=0)
    try:
        ctx = _ctx(4)
        ex.begin_step(ctx, previous=None, failed=False)
        with pytest.raises(PlanError, match="data_iter ran out at microbatch 1 of 4") as info:
            ex._dforward(Task(0, "F", 1), None, ctx)
        assert "RepeatingLoader" in str(info.value)
        # Read ahead (to learn the sizes), a dry iterator gives None past its end.
        e2 = FakeEngine(first=True, last=False, data=_items(2))
        ex2 = dx.DeepSpeedExecutor(e2, rank=0)
        try:
            got = ex2.preload(4)
            assert got[2:] == [None, None] and all(t is not None for t in got[:2])
            assert ex2.preloaded == 2
        finally:
            ex2.close()
    finally:
        ex.close()


def test_a_forward_that_draws_random_numbers_is_seen() -> None:
    e = FakeEngine(first=False, last=False, data=[])
    ex = dx.DeepSpeedExecutor(e, rank=1)
    try:
        ctx = _ctx(2)
        ex.begin_step(ctx, previous=None, failed=False)
        ex._dforward(Task(1, "F", 0), torch.ones(3), ctx)
        assert not ex.draws.drew
        plain = e._exec_forward_pass

        def drawing(k: int) -> None:  # a forward with dropout: it draws from the generator
            torch.rand(1)
            plain(k)

        e._exec_forward_pass = drawing  # type: ignore[method-assign]
        ex._dforward(Task(1, "F", 1), torch.ones(3), ctx)
        assert ex.draws.drew
    finally:
        ex.close()


def test_what_crosses_a_boundary_is_a_tensor_or_a_tuple_of_tensors() -> None:
    t = torch.ones(2, requires_grad=True) * 2
    assert not dx._sendable(t).requires_grad
    pair = dx._sendable([t, torch.zeros(2, dtype=torch.bool)])
    assert isinstance(pair, tuple) and len(pair) == 2
    with pytest.raises(PlanError, match="tensor or a tuple of tensors"):
        dx._sendable({"h": t})
    got = dx._received((torch.ones(2), torch.zeros(2, dtype=torch.bool)))
    assert got[0].requires_grad and not got[1].requires_grad


def test_install_without_deepspeed_names_the_package() -> None:
    if importlib.util.find_spec("deepspeed") is not None:
        pytest.skip("DeepSpeed is installed here (the compat tier tests install)")
    import rrfp_async.deepspeed as rr_ds

    with pytest.raises(PlanError, match="pip install deepspeed"):
        rr_ds.install()
    assert not rr_ds.installed()
    with pytest.raises(PlanError, match="memory_factor"):
        rr_ds.install(memory_factor=-1)
    with pytest.raises(PlanError, match="not both"):
        rr_ds.install(memory_factor=2, memory_budget=1.5)
    with pytest.raises(PlanError, match="sizes"):
        rr_ds.install(sizes="yes")  # type: ignore[arg-type]
