"""What the training-semantics tests share (one process and several): a small language model
whose embedding is tied to its output projection, with dropout in every stage and an MLP
that can be tensor-parallel; its seeded microbatches; and the single-process reference,
which runs each stage's forward of each microbatch inside ``rr.task_rng``.

Dropout sits only where every TP rank holds the full activation (after a row-parallel
linear), so a TP stage draws the same masks as the unsharded reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import rrfp_async as rr
from rrfp_lab.models import ColumnParallelLinear, RowParallelLinear, TPContext

V, D, H = 20, 8, 16  # vocabulary, width, MLP width (a multiple of the TP sizes used)
P_DROP = 0.3
SEED = 0
"""Every process seeds torch with it before building (``build``): the executors' default
seed (``torch.initial_seed()``) is then this."""


class _MLP(nn.Module):
    """``x + dropout(row(gelu(col(x))))``: column- then row-parallel, dropout where the
    activation is whole on every TP rank."""

    def __init__(self, p: float, tp: TPContext) -> None:
        super().__init__()
        w1, b1 = torch.randn(H, D) * 0.4, torch.randn(H) * 0.1
        w2, b2 = torch.randn(D, H) * 0.4, torch.randn(D) * 0.1
        self.up_col = ColumnParallelLinear(D, H, tp, w1, b1)
        self.down_row = RowParallelLinear(H, D, tp, w2, b2)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down_row(F.gelu(self.up_col(x))))


class Embed(nn.Module):
    """First stage: token ids -> hidden."""

    def __init__(self, p: float, tp: TPContext) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.mlp = _MLP(p, tp)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.emb(ids))


class Mid(nn.Module):
    """A middle stage."""

    def __init__(self, p: float, tp: TPContext) -> None:
        super().__init__()
        self.mlp = _MLP(p, tp)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.mlp(h)


class Head(nn.Module):
    """Last stage: hidden -> logits through ``weight`` (tied to the embedding, or not)."""

    def __init__(self, weight: torch.Tensor, p: float, tp: TPContext) -> None:
        super().__init__()
        self.mlp = _MLP(p, tp)
        self.norm = nn.LayerNorm(D)  # constant-initialised: never taken for a tie
        self.drop = nn.Dropout(p)
        self.weight = weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.drop(self.norm(self.mlp(h))) @ self.weight.t()


TIE = "wte"


def build(
    stages: int, kind: str, *, p: float = P_DROP, tp: TPContext | None = None
) -> tuple[list[nn.Module], dict[str, list[tuple[int, str]]] | None]:
    """The model's stage modules, seeded with ``SEED`` (the same numbers at every TP size).

    Args:
        stages: Virtual stages (>= 2).
        kind: ``"one"``: the tie as one parameter object (the reference; also what
            ``rr.split_model`` finds); ``"copies"``: each end its own copy, declared by the
            returned spec; ``"untied"``: the head has a weight of its own.
        p: Dropout probability.
        tp: The TP group (default: none).

    Returns:
        The modules and the tie declaration (``"copies"`` only, else None).
    """
    tp = tp if tp is not None else TPContext.none()
    torch.manual_seed(SEED)
    e = Embed(p, tp)
    mids = [Mid(p, tp) for _ in range(stages - 2)]
    if kind == "untied":
        w: torch.Tensor = nn.Parameter(torch.randn(V, D) * 0.5)
    elif kind == "copies":
        w = nn.Parameter(e.emb.weight.detach().clone())
    else:
        assert kind == "one", kind
        w = e.emb.weight
    mods: list[nn.Module] = [e, *mids, Head(w, p, tp)]
    spec = {TIE: [(0, "emb.weight"), (stages - 1, "weight")]} if kind == "copies" else None
    return mods, spec


def batches(step: int, n: int) -> list[rr.Microbatch]:
    """Step ``step``'s ``n`` microbatches: token ids of shape (2, 3..6), seeded by step."""
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for i in range(n):
        ids = torch.randint(0, V, (2, 3 + (i * 3 + step) % 4), generator=g)
        out.append(rr.Microbatch(index=i, tokens=int(ids.numel()), data=ids))
    return out


def loss_fn(out: torch.Tensor, mb: rr.Microbatch) -> torch.Tensor:
    ids = mb.data
    return F.cross_entropy(out.reshape(-1, V), ids.reshape(-1))


def reference(
    mods: Sequence[nn.Module],
    steps: Sequence[tuple[int, Sequence[rr.Microbatch]]],
    *,
    seed: int = SEED,
) -> None:
    """Accumulate the gradients of ``steps`` (step number, its microbatches) into
    ``mods`` in one process: stage ``v``'s forward of microbatch ``m`` (the last one's
    with the loss) inside ``rr.task_rng(seed, step, v, m)``, microbatches in order (as a
    pipeline's ``W`` tasks in microbatch order accumulate), one intra-op thread like every
    spawned rank."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        last = len(mods) - 1
        for step, mbs in steps:
            for m, mb in enumerate(mbs):
                x: Any = mb.data
                for v, mod in enumerate(mods):
                    with rr.task_rng(seed, step, v, m):
                        x = mod(x)
                        if v == last:
                            x = loss_fn(x, mb) / len(mbs)
                x.backward()
    finally:
        torch.set_num_threads(n)


def parameters(mods: Sequence[nn.Module]) -> list[nn.Parameter]:
    """The modules' parameters, each object once (what an optimizer takes)."""
    out: list[nn.Parameter] = []
    seen: set[int] = set()
    for m in mods:
        for p in m.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def state(mods: Sequence[nn.Module]) -> dict[str, torch.Tensor]:
    """Every stage's parameters and gradients, by ``"{stage}.{name}"`` and
    ``"{stage}.{name}.grad"`` (a missing gradient is absent)."""
    out: dict[str, torch.Tensor] = {}
    for v, mod in enumerate(mods):
        out.update(stage_state(v, mod))
    return out


def stage_state(v: int, mod: nn.Module) -> dict[str, torch.Tensor]:
    """``state`` of one stage module."""
    out: dict[str, torch.Tensor] = {}
    for name, p in mod.named_parameters(remove_duplicate=False):
        out[f"{v}.{name}"] = p.detach().clone()
        if p.grad is not None:
            out[f"{v}.{name}.grad"] = p.grad.detach().clone()
    return out


def max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The largest difference over the parameters ``got`` has (each must be in ``want``,
    with a gradient where ``want`` has one and only there)."""
    for k in got:
        if not k.endswith(".grad"):
            assert (f"{k}.grad" in got) == (f"{k}.grad" in want), k
    worst = 0.0
    for k, t in got.items():
        worst = max(worst, float((t - want[k]).abs().max()))
    return worst
