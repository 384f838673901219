"""What the step-failure tests share: a linear pipeline's loss, its seeded microbatches, the
one-process reference it must equal, and the comparison."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

WIDTH = 4
"""Features of every stage's ``nn.Linear(WIDTH, WIDTH)``."""


def loss(out: torch.Tensor, mb: torch.Tensor) -> torch.Tensor:
    return (out - mb).pow(2).mean()


def batches(seed: int, steps: int, m: int) -> list[list[torch.Tensor]]:
    """``steps`` steps of ``m`` microbatches of shape (3, WIDTH), seeded."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(3, WIDTH, generator=g) for _ in range(m)] for _ in range(steps)]


def reference(
    mods: Sequence[nn.Module], steps: list[list[torch.Tensor]], skip: int | None
) -> list[dict[str, torch.Tensor]]:
    """One process, ``mods`` composed (stage 0 first), SGD (lr 0.1) on every step but
    ``skip``, gradients accumulated in microbatch order (as 1F1B's backwards run); each
    stage's parameters after the last step."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # like every spawned rank
    try:
        opt = torch.optim.SGD([p for m in mods for p in m.parameters()], lr=0.1)
        for k, mbs in enumerate(steps):
            if k == skip:
                continue
            for mb in mbs:
                x = mb
                for m in mods:
                    x = m(x)
                (loss(x, mb) / len(mbs)).backward()
            opt.step()
            opt.zero_grad()
        return [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in mods]
    finally:
        torch.set_num_threads(n)


def check_params(res: list[dict[str, Any]], ref: list[dict[str, torch.Tensor]]) -> None:
    """Every rank's ``params`` equal the reference's stage of that rank (1e-6)."""
    for rank, r in enumerate(res):
        for k, v in r["params"].items():
            assert torch.allclose(v, ref[rank][k], rtol=0, atol=1e-6), (rank, k)
