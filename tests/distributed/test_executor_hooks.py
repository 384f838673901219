"""The optional executor hooks a ``DistributedStage`` reads (``distributed._executor_hooks``)
and the microbatch's ``tokens`` (``TokenCounted``): with the hook it is read or called,
without it the stage does what it did. Pure: the stage's parts are driven on stand-ins."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

import rrfp_async as rr
from rrfp_async.distributed._executor_hooks import (
    EmulatingExecutor,
    EventWaitingExecutor,
    ModulesExecutor,
    SeedAdoptingExecutor,
    SeededExecutor,
    SeedGivenExecutor,
    StreamOrderingExecutor,
    TieSpecExecutor,
    executor_seed,
)
from rrfp_async.distributed._stage_grads import TiedGradients, order_after_step
from rrfp_async.distributed._torch_executor import TokenCounted, TorchStageExecutor

pytestmark = pytest.mark.timeout(30)


class Plain:
    async def execute(self, task: Any, data: Any, ctx: Any) -> Any:
        return data


def test_the_torch_executor_has_every_hook() -> None:
    ex = TorchStageExecutor({0: torch.nn.Linear(2, 2)}, loss_fn=lambda out, mb: out.sum())
    for hook in (
        SeededExecutor,
        SeedGivenExecutor,
        SeedAdoptingExecutor,
        ModulesExecutor,
        StreamOrderingExecutor,
        EmulatingExecutor,
        EventWaitingExecutor,
        TieSpecExecutor,
    ):
        assert isinstance(ex, hook), hook.__name__
        assert not isinstance(Plain(), hook), hook.__name__


def test_executor_seed_reads_the_seed_and_whether_it_is_the_default() -> None:
    assert executor_seed(Plain()) == (None, False)
    assert executor_seed(SimpleNamespace(rng_seed=7)) == (7, False)  # given, unless it says
    assert executor_seed(SimpleNamespace(rng_seed=7, rng_seed_given=False)) == (7, True)
    ex = TorchStageExecutor({0: torch.nn.Linear(2, 2)}, loss_fn=lambda out, mb: out.sum())
    seed, default = executor_seed(ex)
    assert seed is not None and default
    ex = TorchStageExecutor({0: torch.nn.Linear(2, 2)}, loss_fn=lambda o, mb: o.sum(), seed=3)
    assert executor_seed(ex) == (3, False)


class Ordering(Plain):
    def __init__(self) -> None:
        self.ordered = 0
        self.p = torch.nn.Parameter(torch.zeros(1))

    def order_after_step(self) -> None:
        self.ordered += 1

    def shared_parameters(self) -> dict[str, tuple[torch.nn.Parameter, ...]]:
        return {"w": (self.p,)}


def _ties(ex: object) -> TiedGradients:
    return TiedGradients(
        ex,
        layout=rr.ProcessLayout(pp=1, rank=0),
        control_group=None,
        check_undeclared=False,
        timeout=None,
        who="rank 0",
    )


def test_the_gradient_part_calls_the_hooks_it_finds_and_skips_the_rest() -> None:
    ex = Ordering()
    order_after_step(ex)
    assert ex.ordered == 1
    assert _ties(ex).shared_parameters() == {"w": [ex.p]}
    order_after_step(Plain())
    assert _ties(Plain()).shared_parameters() == {}


def test_the_job_seed_is_adopted_only_by_a_default_seed() -> None:
    ex = TorchStageExecutor({0: torch.nn.Linear(2, 2)}, loss_fn=lambda o, mb: o.sum())
    ex.adopt_seed(-5)  # (a digest's signed seed: kept as the unsigned 64-bit one)
    assert executor_seed(ex) == ((1 << 64) - 5, True)
    given = TorchStageExecutor({0: torch.nn.Linear(2, 2)}, loss_fn=lambda o, mb: o.sum(), seed=3)
    given.adopt_seed(9)
    assert executor_seed(given) == (3, False)
    off = TorchStageExecutor(
        {0: torch.nn.Linear(2, 2)}, loss_fn=lambda o, mb: o.sum(), task_rng=False
    )
    off.adopt_seed(9)
    assert executor_seed(off) == (None, True)


def test_token_counts_come_from_the_microbatch_when_it_has_them() -> None:
    ex = SimpleNamespace(tokens_fn=None, rank=0)
    mb = rr.Microbatch(index=0, tokens=12)
    assert isinstance(mb, TokenCounted)
    assert TorchStageExecutor._tokens(ex, mb, 0) == 12  # type: ignore[arg-type]
    assert not isinstance(torch.zeros(2), TokenCounted)
    with pytest.raises(rr.PlanError, match=r"microbatch 1 gave None .*tokens_fn"):
        TorchStageExecutor._tokens(ex, torch.zeros(2), 1)  # type: ignore[arg-type]
    counted = SimpleNamespace(tokens_fn=lambda mb: 5, rank=0)
    assert TorchStageExecutor._tokens(counted, torch.zeros(2), 0) == 5  # type: ignore[arg-type]
