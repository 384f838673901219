"""What the ``bench overhead`` sections share: batch statistics against a raw baseline.

Every figure is a statistic over batches (a batch times many back-to-back operations, so
timer and scheduling noise is amortised); a raw baseline runs in batches interleaved with
the variant it is compared to, so a noisy neighbour moves both.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "CONTENDED",
    "QUANTILE",
    "Row",
    "loop_kind",
    "lower_quantile",
    "median_of",
    "transport_figures",
]

Row = dict[str, Any]

CONTENDED = 3.0
"""Batches whose median is this many times their lower decile ran on a contended machine
(most of them measured scheduling delays, not transport)."""
QUANTILE = 0.1
"""Transport figures are the lower decile of short batches: on a shared machine the batches
that no other process disturbed (see ``_overhead_message.message_cost``)."""


def median_of(xs: Iterable[float]) -> float:
    """The median of ``xs`` as a float."""
    return float(statistics.median(list(xs)))


def lower_quantile(xs: Sequence[float], q: float = QUANTILE) -> float:
    """The ``q`` quantile of ``xs`` (nearest rank, rounded down)."""
    s = sorted(xs)
    return s[int(q * (len(s) - 1))]


def transport_figures(raw: Sequence[float], variant: Sequence[float], per: float) -> dict[str, Any]:
    """Figures of a variant against its raw baseline from interleaved batch times (seconds
    per batch; ``per`` operations per batch): lower deciles (the headline), medians, the
    median of the paired ratios, and whether the machine was contended."""
    return {
        "raw_us": 1e6 * lower_quantile(raw) / per,
        "channel_us": 1e6 * lower_quantile(variant) / per,
        "ratio": lower_quantile(variant) / lower_quantile(raw),
        "raw_median_us": 1e6 * median_of(raw) / per,
        "channel_median_us": 1e6 * median_of(variant) / per,
        "ratio_paired": median_of(c / r for c, r in zip(variant, raw, strict=True)),
        "contended": median_of(raw) > CONTENDED * lower_quantile(raw)
        or median_of(variant) > CONTENDED * lower_quantile(variant),
    }


def loop_kind(loop: asyncio.AbstractEventLoop) -> str:
    """``"uvloop"`` or ``"asyncio"``: the kind of ``loop``."""
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


def blocking_round_trip(buf: torch.Tensor, rank: int, peer: int) -> None:
    """One blocking gloo ping-pong of ``buf`` between ranks 0 and ``peer`` (the raw
    transport every message figure is compared with)."""
    import torch.distributed as dist

    if rank == 0:
        dist.send(buf, peer)
        dist.recv(buf, peer)
    else:
        dist.recv(buf, peer)
        dist.send(buf, peer)
