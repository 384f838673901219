"""PNG timelines of traces: one panel per trace, one row per rank, bars coloured by task
kind, gaps = bubbles (needs matplotlib, the ``plot`` extra).

The legend lists the kinds the figure holds (no I / W without a split backward) and says
that the numbers on the bars are microbatches. A rank that runs several model chunks
(virtual stages) draws its second chunk in a lighter shade of the kind's colour with a
hatch (``CHUNK_HATCHES``), its third lighter still with another, and the legend shows each
kind x chunk drawn: chunk ``c`` of a rank is its ``c``-th virtual stage in stage order.

Bounded: a panel draws at most ``MAX_PNG_LANES`` ranks (the first ones; its title says how
many it left out), bars are drawn as one collection per rank and kind, and microbatch
labels only while a figure has at most ``MAX_PNG_LABELS`` bars, so a trace of thousands of
ranks renders in seconds, not minutes and gigabytes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .._errors import ExtraMissingError, PlanError
from .._tasks import Task
from ._summary import summarize
from ._trace_data import TraceData, from_chrome

__all__ = [
    "CHUNK_HATCHES",
    "KIND_COLORS",
    "KIND_NAMES",
    "MAX_PNG_LABELS",
    "MAX_PNG_LANES",
    "render_png",
]

MAX_PNG_LANES = 64
"""Most ranks (rows) a panel draws; the rest are left out, and the panel's title says so."""

MAX_PNG_LABELS = 2000
"""Most bars of a figure that get their microbatch number written on them."""

KIND_COLORS = {"F": "#4C78A8", "B": "#54A24B", "I": "#F58518", "W": "#B279A2"}
"""The bar colour of each task kind (of a rank's first chunk; later chunks are lighter)."""

KIND_NAMES = {"F": "forward", "B": "backward", "I": "input grad", "W": "weight grad"}
"""What the legend calls each task kind."""

CHUNK_HATCHES = ("", "//", "..", "xx", "\\\\", "++")
"""The hatch of each chunk of a rank (chunk 0 plain); beyond the last, they repeat."""


def _chunk_style(kind: str, chunk: int) -> tuple[tuple[float, float, float], str]:
    """The face colour and hatch of a bar of ``kind`` on a rank's chunk ``chunk``: the kind's
    colour, mixed with white by 40 % per chunk (at most 70 %), and a hatch per chunk."""
    from matplotlib.colors import to_rgb

    r, g, b = to_rgb(KIND_COLORS[kind])
    w = min(0.7, 0.4 * chunk)
    hatch = "" if chunk == 0 else CHUNK_HATCHES[1 + (chunk - 1) % (len(CHUNK_HATCHES) - 1)]
    return (r + (1 - r) * w, g + (1 - g) * w, b + (1 - b) * w), hatch


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
        ExtraMissingError: matplotlib is not installed (``pip install rrfp-async[plot]``).
        PlanError: ``path`` has an extension matplotlib cannot write (``.png``, ``.pdf``,
            ``.svg``, ... are fine).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError as e:
        raise ExtraMissingError(
            "render_png needs matplotlib (the plot extra): pip install 'rrfp-async[plot]'"
        ) from e
    kinds = FigureCanvasBase.get_supported_filetypes()
    ext = Path(path).suffix.lower().lstrip(".")
    if ext not in kinds:
        shown = f".{ext}" if ext else "(none)"
        raise PlanError(
            f"cannot write an image to {str(path)!r}: the extension {shown} is no image format;"
            f" use .png (or one of {', '.join('.' + k for k in sorted(kinds))})"
        )
    fig = _timeline_figure(traces, title=title, labels=labels)
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(p, dpi=110)
    finally:
        plt.close(fig)
    return p


def _timeline_figure(
    traces: Sequence[tuple[str, TraceData | Mapping[str, Any]]],
    *,
    title: str = "",
    labels: bool = True,
) -> Any:
    """The matplotlib ``Figure`` that ``render_png`` saves (the caller closes it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

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
    styles: set[tuple[str, int]] = set()  # (kind, chunk) of the bars drawn
    many_chunks = False
    for ax, (name, d) in zip(axes[:, 0], datas, strict=True):
        if not d.spans:
            continue
        t0 = min(s.start for s in d.spans)
        every = sorted({s.lane for s in d.spans})
        lanes = every[:MAX_PNG_LANES]
        row_of = {lane: row for row, lane in enumerate(lanes)}
        summ = summarize(d)
        stages: dict[int, set[int]] = {}
        parsed = [(span, Task.parse(span.task)) for span in d.spans]
        for span, t in parsed:
            stages.setdefault(span.lane, set()).add(t.stage)
        chunk_of = {(lane, v): c for lane, vs in stages.items() for c, v in enumerate(sorted(vs))}
        many_chunks = many_chunks or any(len(vs) > 1 for vs in stages.values())
        bars: dict[tuple[int, str, int], list[tuple[float, float]]] = {}
        for span, t in parsed:
            row = row_of.get(span.lane)
            if row is None:
                continue
            x, w = (span.start - t0) * 1e3, (span.end - span.start) * 1e3
            bars.setdefault((row, t.kind, chunk_of[(span.lane, t.stage)]), []).append((x, w))
            span_max = max(span_max, x + w)
            if labels and w > 0:
                ax.text(
                    x + w / 2,
                    row,
                    str(t.mb),
                    ha="center",
                    va="center",
                    fontsize=6,
                    color="white" if chunk_of[(span.lane, t.stage)] == 0 else "#222222",
                    clip_on=True,
                )
        for (row, kind, chunk), xw in bars.items():
            face, hatch = _chunk_style(kind, chunk)
            styles.add((kind, chunk))
            ax.broken_barh(
                xw,
                (row - 0.4, 0.8),
                facecolors=face,
                edgecolor="white",
                linewidth=0.3,
                hatch=hatch or None,
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
    handles = []
    for kind in KIND_COLORS:  # F, B, I, W: only those drawn
        for chunk in sorted(ch for kd, ch in styles if kd == kind):
            face, hatch = _chunk_style(kind, chunk)
            label = f"{kind} chunk {chunk}" if many_chunks else f"{kind} {KIND_NAMES[kind]}"
            handles.append(
                Patch(facecolor=face, edgecolor="white", hatch=hatch or None, label=label)
            )
    if handles:
        fig.legend(
            handles=handles,
            loc="upper right",
            ncol=min(len(handles), 8),
            fontsize=8,
            title="numbers on the bars: microbatch" if labels else None,
            title_fontsize=8,
        )
    if title:
        fig.suptitle(title, fontsize=10, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return fig
