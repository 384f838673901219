"""The options of the benchmarks against a peer's own engine on the peer benchmark's
emulated work (``bench megatron``, ``bench deepspeed``): the cost per token, the width, the
jitter, the seed and the workloads."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import click

from rrfp_async.cli import jitter_option, seed_option

__all__ = ["emulated_work_options"]

FC = TypeVar("FC", bound=Callable[..., object])


def emulated_work_options(*, us_per_token: float, per: str, together: str) -> Callable[[FC], FC]:
    """``--us-per-token`` (default ``us_per_token``; µs per token of ``per``), ``--hidden``,
    ``--jitter``, ``--seed`` and ``--workload`` (repeatable; both by default, ``together``
    says how they run)."""

    def wrap(f: FC) -> FC:
        f = click.option(
            "--workload",
            "workloads",
            type=click.Choice(["uniform", "variable"]),
            multiple=True,
            help="uniform (equal microbatches, no jitter) and / or variable (multimodal"
            f" lengths, jitter). Default: both, {together}.",
        )(f)
        f = seed_option(f)
        f = jitter_option(
            help_text="Sigma of the lognormal noise on every duration (variable workload)."
        )(f)
        f = click.option("--hidden", type=click.IntRange(min=1), default=32, show_default=True)(f)
        return click.option(
            "--us-per-token",
            type=click.FloatRange(min=0, min_open=True),
            default=us_per_token,
            show_default=True,
            help=f"Emulated forward µs per token of {per} (backward 2x).",
        )(f)

    return wrap
