"""Megatron-style tensor parallelism: the TP group, collectives with autograd, parallel linears.

Generic layers any model can shard with (the example ``image_text`` model uses them):

* ``TPContext``: the TP process group, its size and this process's rank in it; size 1 means
  no tensor parallelism and no communication at all.
* ``copy_to_tp`` / ``reduce_from_tp``: the two collectives of a tensor-parallel region, as
  autograd functions. ``copy_to_tp`` enters it (identity forward, all-reduce of the
  gradient backward); ``reduce_from_tp`` leaves it (all-reduce forward, identity backward).
* ``ColumnParallelLinear`` starts with ``copy_to_tp`` and keeps a block of output rows;
  ``RowParallelLinear`` keeps a block of input columns and ends with ``reduce_from_tp`` plus
  the full bias. A column-parallel layer followed by a row-parallel one (attention's QKV and
  output projections, an MLP's up and down projections) communicates once each way.
  Both take the FULL weight and bias and slice their shard from it, so a model initialised
  in full starts from the same numbers at every TP size.
* **Recognising parallel linears by name**: a parameter whose module name ends in
  ``COLUMN_SUFFIX`` (``_col``) belongs to a ``ColumnParallelLinear`` (weight and bias split
  on dim 0), one whose module name ends in ``ROW_SUFFIX`` (``_row``) to a
  ``RowParallelLinear`` (weight split on dim 1, bias replicated); everything else is
  replicated. ``parallel_kind`` and ``shard_dim`` implement the rule, so a state dict can
  be reassembled from its shards knowing only the names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from rrfp_async import PlanError

__all__ = [
    "COLUMN_SUFFIX",
    "ROW_SUFFIX",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TPContext",
    "copy_to_tp",
    "parallel_kind",
    "reduce_from_tp",
    "shard_dim",
]

COLUMN_SUFFIX = "_col"
"""Module-name suffix of every ``ColumnParallelLinear`` in a model (``attn.qkv_col``)."""

ROW_SUFFIX = "_row"
"""Module-name suffix of every ``RowParallelLinear`` in a model (``mlp.down_row``)."""


@dataclass(frozen=True)
class TPContext:
    """The tensor-parallel group a stage module is sharded over.

    Attributes:
        group: The TP process group; ``None`` is torch.distributed's default (world) group.
            Unused when ``size`` is 1.
        size: Number of TP ranks (1: no tensor parallelism, no communication).
        rank: This process's rank inside ``group`` (``0 .. size-1``).

    Raises:
        PlanError: ``size < 1`` or ``rank`` outside ``0 .. size-1``.
    """

    group: ProcessGroup | None
    size: int
    rank: int

    def __post_init__(self) -> None:
        if self.size < 1:
            raise PlanError(f"TPContext.size must be >= 1, got {self.size}")
        if not 0 <= self.rank < self.size:
            raise PlanError(f"TPContext.rank must be in 0..{self.size - 1}, got {self.rank}")

    @classmethod
    def none(cls) -> TPContext:
        """No tensor parallelism: size 1, rank 0, no group."""
        return cls(None, 1, 0)

    @classmethod
    def of(cls, group: ProcessGroup | None = None) -> TPContext:
        """The context of this process in ``group`` (default: the world group).

        torch.distributed must be initialised.
        """
        return cls(group, dist.get_world_size(group), dist.get_rank(group))


# --------------------------------------------------------------------------------------------
# Collectives with autograd


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce (sum) of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup | None) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        g = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce (sum) forward; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup | None) -> Tensor:
        y = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def copy_to_tp(x: Tensor, tp: TPContext) -> Tensor:
    """Enter a tensor-parallel region: identity forward, gradient all-reduced (sum) backward.

    With ``tp.size == 1`` this returns ``x`` unchanged and never communicates.
    """
    if tp.size == 1:
        return x
    return cast(Tensor, _CopyToTP.apply(x, tp.group))  # type: ignore[no-untyped-call]


def reduce_from_tp(x: Tensor, tp: TPContext) -> Tensor:
    """Leave a tensor-parallel region: all-reduce (sum) forward, identity backward.

    With ``tp.size == 1`` this returns ``x`` unchanged and never communicates.
    """
    if tp.size == 1:
        return x
    return cast(Tensor, _ReduceFromTP.apply(x, tp.group))  # type: ignore[no-untyped-call]


# --------------------------------------------------------------------------------------------
# Parallel linears


def _check_linear(kind: str, in_f: int, out_f: int, weight: Tensor, bias: Tensor) -> None:
    if tuple(weight.shape) != (out_f, in_f):
        raise PlanError(
            f"{kind}: the full weight must have shape ({out_f}, {in_f}), got {tuple(weight.shape)}"
        )
    if tuple(bias.shape) != (out_f,):
        raise PlanError(
            f"{kind}: the full bias must have shape ({out_f},), got {tuple(bias.shape)}"
        )


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with the output features split over the TP ranks (no gather).

    Keeps rows ``rank*n .. (rank+1)*n - 1`` (``n = out_f / tp.size``) of the FULL weight and
    bias given; its input goes through ``copy_to_tp`` first, so the input gradient is
    summed over the TP ranks in backward. Register it under a name ending in
    ``COLUMN_SUFFIX`` (``shard_dim`` recognises it by that name).

    Args:
        in_f: Input features.
        out_f: Output features of the full layer; a multiple of ``tp.size``.
        tp: The TP group.
        weight: The full weight ``[out_f, in_f]`` (copied, not kept).
        bias: The full bias ``[out_f]``.

    Raises:
        PlanError: Shapes do not match or ``out_f`` is not a multiple of ``tp.size``.
    """

    def __init__(self, in_f: int, out_f: int, tp: TPContext, weight: Tensor, bias: Tensor) -> None:
        super().__init__()
        _check_linear("ColumnParallelLinear", in_f, out_f, weight, bias)
        if out_f % tp.size:
            raise PlanError(
                f"ColumnParallelLinear: out_f ({out_f}) must be a multiple of the TP size"
                f" ({tp.size})"
            )
        n = out_f // tp.size
        rows = slice(tp.rank * n, (tp.rank + 1) * n)
        self.tp = tp
        self.in_features = in_f
        self.out_features = out_f
        self.weight = nn.Parameter(weight.detach()[rows].clone())
        self.bias = nn.Parameter(bias.detach()[rows].clone())

    def forward(self, x: Tensor) -> Tensor:
        """This rank's block of output features, ``[..., out_f / tp.size]``."""
        return F.linear(copy_to_tp(x, self.tp), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with the input features split over the TP ranks.

    Keeps columns ``rank*n .. (rank+1)*n - 1`` (``n = in_f / tp.size``) of the FULL weight;
    its input is this rank's block of input features. The partial products are summed with
    ``reduce_from_tp`` and the FULL bias is added once after the reduction, so the result
    equals the unsharded linear up to the order of the float sums. Register it under a name
    ending in ``ROW_SUFFIX``.

    Args:
        in_f: Input features of the full layer; a multiple of ``tp.size``.
        out_f: Output features.
        tp: The TP group.
        weight: The full weight ``[out_f, in_f]`` (copied, not kept).
        bias: The full bias ``[out_f]`` (replicated on every rank).

    Raises:
        PlanError: Shapes do not match or ``in_f`` is not a multiple of ``tp.size``.
    """

    def __init__(self, in_f: int, out_f: int, tp: TPContext, weight: Tensor, bias: Tensor) -> None:
        super().__init__()
        _check_linear("RowParallelLinear", in_f, out_f, weight, bias)
        if in_f % tp.size:
            raise PlanError(
                f"RowParallelLinear: in_f ({in_f}) must be a multiple of the TP size ({tp.size})"
            )
        n = in_f // tp.size
        self.tp = tp
        self.in_features = in_f
        self.out_features = out_f
        self.weight = nn.Parameter(weight.detach()[:, tp.rank * n : (tp.rank + 1) * n].clone())
        self.bias = nn.Parameter(bias.detach().clone())

    def forward(self, x: Tensor) -> Tensor:
        """The full output ``[..., out_f]``, identical on every TP rank."""
        return reduce_from_tp(F.linear(x, self.weight), self.tp) + self.bias


# --------------------------------------------------------------------------------------------
# Recognising parallel linears by name


def parallel_kind(name: str) -> Literal["column", "row"] | None:
    """Which parallel linear a parameter (or state-dict entry) belongs to, by its name.

    ``"column"`` when the module name (everything before the last dot) ends in
    ``COLUMN_SUFFIX``, ``"row"`` when it ends in ``ROW_SUFFIX``, otherwise ``None``
    (a replicated tensor).
    """
    module = name.rpartition(".")[0]
    if module.endswith(COLUMN_SUFFIX):
        return "column"
    if module.endswith(ROW_SUFFIX):
        return "row"
    return None


def shard_dim(name: str) -> int | None:
    """The dimension a tensor-parallel parameter is split on, or ``None`` if replicated.

    Column-parallel weights and biases: 0; row-parallel weights: 1; row-parallel biases
    and everything else: ``None``.
    """
    kind = parallel_kind(name)
    leaf = name.rpartition(".")[2]
    if kind == "column":
        return 0
    if kind == "row" and leaf == "weight":
        return 1
    return None
