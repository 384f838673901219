"""Any torch model through the runtime, in one process: pytree boundaries, keyword and side
inputs, frozen stages, loss scaling, outputs, steps of any size and tied parameters.

Every check compares against plain autograd on the unsplit model (same init, same data),
and each one is written so that it fails when the feature is missing (see the comments).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import rrfp_async as rr

V = 40  # vocabulary


class Embed(nn.Module):
    """Stage 0: token embedding -> (hidden, mask, {"pos": positions, "scale": 0.5})."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 8)
        self.lin = nn.Linear(8, 8)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
        h = self.lin(self.emb(input_ids))
        pos = torch.arange(input_ids.shape[1])
        return (h, attention_mask, {"pos": pos, "scale": 0.5})


class Middle(nn.Module):
    """Stage 1: takes the tuple as *args, returns rr.Args with a keyword."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor, mask: torch.Tensor, extra: dict[str, Any]) -> Any:
        h = torch.tanh(self.lin(h) * extra["scale"] + extra["pos"][None, :, None].float() / 10)
        return rr.Args(h, mask=mask, skip=h * 2)


class Head(nn.Module):
    """Last stage: (h, *, mask, skip, [position_ids]) -> logits."""

    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(8, V)

    def forward(
        self,
        h: torch.Tensor,
        *,
        mask: torch.Tensor,
        skip: torch.Tensor,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if position_ids is not None:
            h = h + position_ids[..., None].float() / 100
        return self.out(h + skip) * mask[..., None]


def build(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [Embed(), Middle(), Head()]


def batches(n: int, seed: int = 1) -> list[rr.Microbatch]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 3 + (i * 5) % 7  # variable lengths per microbatch
        ids = torch.randint(0, V, (2, length), generator=g)
        mask = torch.ones(2, length)
        mask[1, -1] = 0.0
        out.append(
            rr.Microbatch(
                index=i,
                tokens=int(mask.sum()),
                data={"input_ids": ids, "attention_mask": mask, "position_ids": ids % 3},
            )
        )
    return out


def loss_fn(out: torch.Tensor, mb: rr.Microbatch) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, V), mb.data["input_ids"].reshape(-1))


def first_input(mb: rr.Microbatch) -> rr.Args:
    d = mb.data
    return rr.Args(input_ids=d["input_ids"], attention_mask=d["attention_mask"])


def reference(
    mods: Sequence[nn.Module],
    mbs: Sequence[rr.Microbatch],
    weights: Sequence[float] | None = None,
    side: bool = False,
) -> list[float]:
    """Plain autograd on the composed model; returns the per-microbatch losses."""
    losses = []
    for i, mb in enumerate(mbs):
        h = mods[0](**first_input(mb).kwargs)
        a = mods[1](*h)
        extra = {"position_ids": mb.data["position_ids"]} if side else {}
        out = mods[2](*a.args, **a.kwargs, **extra)
        loss = loss_fn(out, mb)
        losses.append(float(loss.detach()))
        w = 1.0 / len(mbs) if weights is None else weights[i]
        (loss * w).backward()
    return losses


def run_pipeline(
    mods: Sequence[nn.Module],
    mbs: Sequence[rr.Microbatch],
    *,
    split: bool = False,
    policy: str = "readiness_first",
    hint: str = "1f1b",
    train: bool = True,
    **ex_kw: Any,
) -> list[rr.StepStats]:
    plan = rr.StepPlan(
        topology=rr.Topology(stages=3),
        microbatches=len(mbs),
        split_backward=split,
        ordered_weights=split,
    )
    execs = [
        rr.TorchStageExecutor({r: mods[r]}, loss_fn, rank=r, input_fn=first_input, **ex_kw)
        for r in range(3)
    ]
    pipe = rr.LocalPipeline(rr.StepSchedule.build(plan, hint), execs, policy=policy)
    try:
        return rr.run(pipe.run_step(mbs, train=train))
    finally:
        for e in execs:
            e.close()


def grads(mods: Sequence[nn.Module]) -> list[torch.Tensor | None]:
    return [p.grad for m in mods for p in m.parameters()]


def assert_close(a: Sequence[torch.Tensor | None], b: Sequence[torch.Tensor | None]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert (x is None) == (y is None)
        if x is not None:
            assert y is not None
            torch.testing.assert_close(x, y, rtol=0, atol=1e-6)


# ------------------------------------------------------------------ pytree boundaries


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("split", "policy", "hint"),
    [
        (False, "strict", "1f1b"),
        (False, "readiness_first", "breadth_first_weighted"),
        (True, "readiness_first", "1f1b"),
        (True, "strict", "gpipe"),
    ],
)
def test_tuple_dict_and_args_boundaries_train_like_autograd(
    split: bool, policy: str, hint: str
) -> None:
    # Fails without pytree boundaries (a tuple has no .detach), without tuple -> *args or
    # rr.Args -> (*args, **kwargs), and if gradients of tuple leaves were dropped.
    mbs = batches(5)
    ref = build()
    want_losses = reference(ref, mbs)
    mods = build()
    stats = run_pipeline(mods, mbs, split=split, policy=policy, hint=hint)
    assert_close(grads(mods), grads(ref))
    assert stats[2].losses is not None
    torch.testing.assert_close(list(stats[2].losses), want_losses)
    assert stats[0].losses is None  # only the last stage's rank reports them


@pytest.mark.timeout(60)
def test_side_inputs_reach_every_later_stage_by_key_or_function() -> None:
    mbs = batches(4)
    ref = build()
    reference(ref, mbs, side=True)
    for side in (
        ["position_ids"],
        lambda stage, mb: {"position_ids": mb.data["position_ids"]} if stage == 2 else {},
    ):
        mods = build()
        if isinstance(side, list):
            # Keys go to every stage after the first: give Middle a pass-through keyword.
            orig = mods[1].forward

            def fwd(*a: Any, position_ids: Any = None, _o: Any = orig) -> Any:
                return _o(*a)

            mods[1].forward = fwd  # type: ignore[method-assign]
        run_pipeline(mods, mbs, side_inputs=side)
        assert_close(grads(mods), grads(ref))  # without the side input, Head differs


def test_bad_side_inputs_are_named() -> None:
    with pytest.raises(rr.PlanError, match="side_inputs must be a function"):
        rr.TorchStageExecutor({0: nn.Linear(2, 2)}, side_inputs="position_ids")
    mods = build()
    with pytest.raises(rr.PlanError, match=r"1F0: microbatch 0 has no side input\(s\) \['nope'\]"):
        run_pipeline(mods, batches(1), side_inputs=["nope"])


# ------------------------------------------------------------------ frozen stages, bad outputs


@pytest.mark.timeout(60)
@pytest.mark.parametrize("split", [False, True])
def test_a_frozen_first_stage_backward_is_a_no_op(split: bool) -> None:
    # Fails with "element 0 of tensors does not require grad" when the first stage's
    # backward runs although nothing in it needs a gradient.
    mbs = batches(3)
    ref = build()
    for p in ref[0].parameters():
        p.requires_grad_(False)
    reference(ref, mbs)
    mods = build()
    for p in mods[0].parameters():
        p.requires_grad_(False)
    stats = run_pipeline(mods, mbs, split=split)
    assert_close(grads(mods), grads(ref))
    assert all(p.grad is None for p in mods[0].parameters())
    assert len(stats[0].executed) == len(mbs) * (3 if split else 2)


class _Detaching(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor, mask: torch.Tensor, extra: dict[str, Any]) -> Any:
        return rr.Args(self.lin(h).detach(), mask=mask, skip=h.detach())


def test_a_stage_whose_output_needs_no_grad_is_named() -> None:
    mods = build()
    mods[1] = _Detaching()
    with pytest.raises(rr.PlanError, match=r"step 0 1F0: the stage's output needs no grad"):
        run_pipeline(mods, batches(2))


def test_a_non_scalar_loss_is_a_plan_error_naming_the_task() -> None:
    mods = build()
    plan = rr.StepPlan(topology=rr.Topology(stages=3), microbatches=2)
    execs = [
        rr.TorchStageExecutor(
            {r: mods[r]},
            lambda out, mb: F.cross_entropy(
                out.reshape(-1, V), mb.data["input_ids"].reshape(-1), reduction="none"
            ),
            input_fn=first_input,
        )
        for r in range(3)
    ]
    pipe = rr.LocalPipeline(rr.StepSchedule.build(plan, "1f1b"), execs)
    with pytest.raises(rr.PlanError, match=r"2F0: loss_fn must return a scalar tensor"):
        rr.run(pipe.run_step(batches(2)))
    for e in execs:
        e.close()


# ------------------------------------------------------------------ losses and outputs


@pytest.mark.timeout(60)
def test_token_weighted_loss_scaling() -> None:
    # Fails if the step loss were the plain mean of microbatch means.
    mbs = batches(4)
    total = sum(mb.tokens for mb in mbs)
    ref = build()
    reference(ref, mbs, weights=[mb.tokens / total for mb in mbs])
    mods = build()
    run_pipeline(mods, mbs, loss_scale="tokens")
    assert_close(grads(mods), grads(ref))
    plain = build()
    run_pipeline(plain, mbs)
    assert not all(
        torch.allclose(cast(torch.Tensor, a), cast(torch.Tensor, b))
        for a, b in zip(grads(plain), grads(ref), strict=True)
    )  # the two scalings really differ on these sizes


@pytest.mark.timeout(60)
def test_eval_step_returns_outputs_in_microbatch_order_and_computes_no_gradient() -> None:
    mbs = batches(4)
    mods = build()
    stats = run_pipeline(mods, mbs, train=False, policy="readiness_first")
    assert all(p.grad is None for m in mods for p in m.parameters())
    assert all(e.task.kind == "F" for st in stats for e in st.executed)
    out = stats[2].outputs
    assert out is not None and len(out) == 4
    ref = build()
    with torch.no_grad():
        for mb, got in zip(mbs, out, strict=True):
            a = ref[1](*ref[0](**first_input(mb).kwargs))
            torch.testing.assert_close(got, ref[2](*a.args, **a.kwargs), rtol=0, atol=0)
    assert stats[2].losses is not None  # a loss_fn was given: eval losses too


@pytest.mark.timeout(60)
def test_training_step_returns_outputs_on_request() -> None:
    mbs = batches(2)
    assert run_pipeline(build(), mbs)[2].outputs is None
    out = run_pipeline(build(), mbs, return_outputs=True)[2].outputs
    assert out is not None and [o.shape[1] for o in out] == [3, 8]
    assert not out[0].requires_grad


# ------------------------------------------------------------------ steps of any size


@pytest.mark.timeout(60)
def test_steps_of_different_sizes_without_reopening() -> None:
    mods = build()
    plan = rr.StepPlan(topology=rr.Topology(stages=3), microbatches=4)
    execs = [rr.TorchStageExecutor({r: mods[r]}, loss_fn, input_fn=first_input) for r in range(3)]
    pipe = rr.LocalPipeline(rr.StepSchedule.build(plan), execs)
    ref = build()
    for n in (4, 2, 5):
        mbs = batches(n, seed=n)
        reference(ref, mbs)
        rr.run(pipe.run_step(mbs))
        assert_close(grads(mods), grads(ref))
    for e in execs:
        e.close()


# ------------------------------------------------------------------ tied parameters


class TiedEmbed(nn.Module):
    def __init__(self, emb: nn.Embedding) -> None:
        super().__init__()
        self.emb = emb

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.emb(ids))


class TiedHead(nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.weight.t()


def _tied(copies: bool) -> tuple[list[nn.Module], dict[str, list[tuple[int, str]]]]:
    torch.manual_seed(3)
    emb = nn.Embedding(V, 8)
    w = emb.weight if not copies else nn.Parameter(emb.weight.detach().clone())
    return [TiedEmbed(emb), TiedHead(w)], {"wte": [(0, "emb.weight"), (1, "weight")]}


def _tied_loss(out: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, V), ids.reshape(-1))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("copies", [False, True], ids=["one-object", "declared-copies"])
def test_tied_parameters_in_a_local_pipeline(copies: bool) -> None:
    # One object: autograd accumulates both uses. Declared copies: the pipeline sums them.
    # Fails (copies) when the LocalPipeline does not reduce declared ties.
    g = torch.Generator().manual_seed(4)
    mbs = [torch.randint(0, V, (2, 5), generator=g) for _ in range(4)]
    ref, _ = _tied(copies=False)
    for ids in mbs:
        (_tied_loss(ref[1](ref[0](ids)), ids) / 4).backward()
    mods, spec = _tied(copies)
    plan = rr.StepPlan(topology=rr.Topology(stages=2), microbatches=4)
    execs = [
        rr.TorchStageExecutor({r: mods[r]}, _tied_loss, shared=spec if copies else None)
        for r in range(2)
    ]
    rr.run(rr.LocalPipeline(rr.StepSchedule.build(plan), execs).run_step(mbs))
    want = ref[0].emb.weight.grad
    assert want is not None
    for p in (mods[0].emb.weight, mods[1].weight):  # type: ignore[union-attr]
        assert p.grad is not None
        torch.testing.assert_close(p.grad, want, rtol=0, atol=1e-6)
    for e in execs:
        e.close()


def test_bad_tie_declarations_are_named() -> None:
    mods, _ = _tied(copies=True)
    with pytest.raises(rr.PlanError, match=r"virtual stage 0's module has no parameter 'nope'"):
        rr.TorchStageExecutor({0: mods[0]}, shared={"t": [(0, "nope"), (1, "weight")]})
    with pytest.raises(rr.PlanError, match=r"names 1 place\(s\); a tie needs >= 2"):
        rr.TorchStageExecutor({0: mods[0]}, shared={"t": [(0, "emb.weight")]})
    ex = rr.TorchStageExecutor({0: mods[0]}, shared={"t": [(0, "emb.weight"), (1, "weight")]})
    assert ex.shared_parameters() == {"t": [mods[0].emb.weight]}  # type: ignore[union-attr]
    ex.close()
