"""PNG timelines of traces: one panel per trace, one row per rank, bars coloured by task
kind, gaps = bubbles (needs matplotlib, the ``plot`` extra).

Bounded: a panel draws at most ``MAX_PNG_LANES`` ranks (the first ones; its title says how
many it left out), bars are drawn as one collection per rank and kind, and microbatch
labels only while a figure has at most ``MAX_PNG_LABELS`` bars, so a trace of thousands of
ranks renders in seconds, not minutes and gigabytes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .._errors import PlanError
from .._tasks import Task
from ._records import TraceData, from_chrome
from ._summary import summarize

__all__ = ["KIND_COLORS", "MAX_PNG_LABELS", "MAX_PNG_LANES", "render_png"]

MAX_PNG_LANES = 64
"""Most ranks (rows) a panel draws; the rest are left out, and the panel's title says so."""

MAX_PNG_LABELS = 2000
"""Most bars of a figure that get their microbatch number written on them."""

KIND_COLORS = {"F": "#4C78A8", "B": "#54A24B", "I": "#F58518", "W": "#B279A2"}
"""The bar colour of each task kind."""


def render_png(
    traces: Sequence[tuple[str, TraceData | Mapping[str, Any]]],
    path: str | Path,
    *,
    title: str = "",
    labels: bool = True,
) -> Path:
    """Draw timelines (one panel per trace, one row per rank, bars coloured by kind, gaps =
    bubbles) with real durations, and save a PNG.

    Args:
        traces: ``[(panel title, recording or Chrome trace), ...]``; panels share the x axis.
        path: Output file.
        title: Figure title (say whether time is virtual, real or emulated).
        labels: Write microbatch numbers on bars wide enough to hold them.

    Raises:
        RuntimeError: matplotlib is not installed (``pip install rrfp-async[plot]``).
        PlanError: ``path`` has an extension matplotlib cannot write (``.png``, ``.pdf``,
            ``.svg``, ... are fine).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.backend_bases import FigureCanvasBase
        from matplotlib.patches import Patch
    except ImportError as e:  # pragma: no cover - matplotlib is a dev / plot extra
        raise RuntimeError("render_png needs matplotlib: pip install 'rrfp-async[plot]'") from e
    kinds = FigureCanvasBase.get_supported_filetypes()
    ext = Path(path).suffix.lower().lstrip(".")
    if ext not in kinds:
        shown = f".{ext}" if ext else "(none)"
        raise PlanError(
            f"cannot write an image to {str(path)!r}: the extension {shown} is no image format;"
            f" use .png (or one of {', '.join('.' + k for k in sorted(kinds))})"
        )
    datas = [(name, t if isinstance(t, TraceData) else from_chrome(t)) for name, t in traces]
    n_ranks = min(MAX_PNG_LANES, max((len({s.lane for s in d.spans}) for _, d in datas), default=1))
    n_bars = 0
    for _, d in datas:
        drawn = set(sorted({x.lane for x in d.spans})[:MAX_PNG_LANES])
        n_bars += sum(1 for x in d.spans if x.lane in drawn)
    labels = labels and n_bars <= MAX_PNG_LABELS
    fig, axes = plt.subplots(
        len(datas),
        1,
        figsize=(14, 1.0 + 0.45 * n_ranks * len(datas) + 0.6),
        sharex=True,
        squeeze=False,
    )
    span_max = 0.0
    for ax, (name, d) in zip(axes[:, 0], datas, strict=True):
        if not d.spans:
            continue
        t0 = min(s.start for s in d.spans)
        every = sorted({s.lane for s in d.spans})
        lanes = every[:MAX_PNG_LANES]
        row_of = {lane: row for row, lane in enumerate(lanes)}
        summ = summarize(d)
        bars: dict[tuple[int, str], list[tuple[float, float]]] = {}
        for span in d.spans:
            row = row_of.get(span.lane)
            if row is None:
                continue
            t = Task.parse(span.task)
            x, w = (span.start - t0) * 1e3, (span.end - span.start) * 1e3
            bars.setdefault((row, t.kind), []).append((x, w))
            span_max = max(span_max, x + w)
            if labels and w > 0:
                ax.text(
                    x + w / 2,
                    row,
                    str(t.mb),
                    ha="center",
                    va="center",
                    fontsize=6,
                    color="white",
                    clip_on=True,
                )
        for (row, kind), xw in bars.items():
            ax.broken_barh(
                xw,
                (row - 0.4, 0.8),
                facecolors=KIND_COLORS[kind],
                edgecolor="white",
                linewidth=0.3,
            )
        ax.set_yticks(range(len(lanes)), [f"rank {r}" for r in lanes])
        ax.invert_yaxis()
        left_out = (
            f" (showing ranks {lanes[0]}..{lanes[-1]}, {len(lanes)} of {len(every)}: MAX_PNG_LANES)"
            if len(every) > len(lanes)
            else ""
        )
        ax.set_title(
            f"{name}: makespan {summ['makespan'] * 1e3:.1f} ms, bubble ratio"
            f" {summ['bubble_ratio']:.1%}, deviations {summ['deviations']}{left_out}",
            fontsize=9,
            loc="left",
        )
    axes[-1, 0].set_xlabel("time (ms)")
    axes[-1, 0].set_xlim(0, span_max * 1.01 if span_max else 1)
    fig.legend(
        handles=[Patch(color=c, label=k) for k, c in KIND_COLORS.items()],
        loc="upper right",
        ncol=4,
        fontsize=8,
    )
    if title:
        fig.suptitle(title, fontsize=10, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p
