"""PNG timelines of traces: one panel per trace, one row per rank, bars coloured by task
kind, gaps = bubbles (needs matplotlib, the ``plot`` extra)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .._tasks import Task
from ._records import TraceData, from_chrome
from ._summary import summarize

__all__ = ["KIND_COLORS", "render_png"]

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
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as e:  # pragma: no cover - matplotlib is a dev / plot extra
        raise RuntimeError("render_png needs matplotlib: pip install 'rrfp-async[plot]'") from e
    datas = [(name, t if isinstance(t, TraceData) else from_chrome(t)) for name, t in traces]
    n_ranks = max((len({s.lane for s in d.spans}) for _, d in datas), default=1)
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
        lanes = sorted({s.lane for s in d.spans})
        summ = summarize(d)
        for row, lane in enumerate(lanes):
            for span in (s for s in d.spans if s.lane == lane):
                t = Task.parse(span.task)
                x, w = (span.start - t0) * 1e3, (span.end - span.start) * 1e3
                ax.broken_barh(
                    [(x, w)],
                    (row - 0.4, 0.8),
                    facecolors=KIND_COLORS[t.kind],
                    edgecolor="white",
                    linewidth=0.3,
                )
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
        ax.set_yticks(range(len(lanes)), [f"rank {r}" for r in lanes])
        ax.invert_yaxis()
        ax.set_title(
            f"{name}: makespan {summ['makespan'] * 1e3:.1f} ms, bubble ratio"
            f" {summ['bubble_ratio']:.1%}, deviations {summ['deviations']}",
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
