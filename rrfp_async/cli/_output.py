"""What a command shows: the console, its tables, and errors as one clean line.

Errors are handled in one place, :class:`CleanErrorsGroup`, the class of every group: a
command raises what it raises and the group turns the expected failures into click's
``Error: <message>`` with exit code 1. Expected means :data:`CLEAN_ERRORS`, the package's own
errors (a configuration it refuses, a step that failed; their messages name the rank, step
and task) and the operating system's (a file that cannot be read or written). Anything else
is a bug and keeps its traceback. A command that knows another exception type is a user
error too (``trace`` and a file that is not a trace) says so around that one call with
:func:`clean_errors`.

With ``--json`` on the command line, a script reads stdout, so every error, a refused
option value included, is one JSON object there, ``{"error": {"type": ..., "message":
...}}``, with the same exit code (1; 2 for a usage error); an unexpected one also keeps its
traceback on stderr.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from .._errors import ExtraMissingError, RRFPError

__all__ = [
    "CLEAN_ERRORS",
    "CleanErrorsGroup",
    "Progress",
    "clean_errors",
    "console",
    "json_error",
    "optional_png",
    "progress",
    "require_plot_extra",
    "table",
]

#: Exceptions reported as ``Error: <message>`` (exit code 1) instead of a traceback.
CLEAN_ERRORS: tuple[type[Exception], ...] = (RRFPError, OSError)


@contextmanager
def clean_errors(*also: type[Exception]) -> Iterator[None]:
    """Report :data:`CLEAN_ERRORS` (and ``also``) raised inside as a ``click.ClickException``.

    A broken pipe (``rrfp-async ... | head``) is left to click, which exits quietly on it.

    Raises:
        click.ClickException: carrying the message of the exception it replaces.
    """
    try:
        yield
    except (*CLEAN_ERRORS, *also) as e:
        if isinstance(e, OSError) and e.errno == errno.EPIPE:
            raise
        raise click.ClickException(str(e)) from e


def json_error(e: BaseException) -> str:
    """The JSON error object a ``--json`` command prints on stdout for ``e``."""
    msg = e.format_message() if isinstance(e, click.ClickException) else str(e)
    return json.dumps({"error": {"type": type(e).__name__, "message": msg}})


class CleanErrorsGroup(click.Group):
    """A click group whose commands (and subgroups' commands) report :data:`CLEAN_ERRORS` as
    ``Error: <message>``, or, with ``--json``, every error as a JSON object on stdout."""

    def invoke(self, ctx: click.Context) -> Any:
        # click >= 8.2 keeps the leading arguments in ctx._protected_args (8.1: protected_args).
        rest = [*getattr(ctx, "_protected_args", ()), *ctx.args]
        if "--json" not in rest:
            with clean_errors():
                return super().invoke(ctx)
        try:
            with clean_errors():
                return super().invoke(ctx)
        except click.exceptions.Exit:
            raise
        except click.ClickException as e:
            cause = e.__cause__ if isinstance(e.__cause__, Exception) else e
            click.echo(json_error(cause))
            ctx.exit(e.exit_code)
        except Exception as e:  # a bug: its traceback on stderr, still JSON on stdout
            traceback.print_exc(file=sys.stderr)
            click.echo(json_error(e))
            ctx.exit(1)


def require_plot_extra(option: str = "--png") -> None:
    """Refuse an option that asks for a PNG when matplotlib cannot be imported, before the
    command writes anything (a note and exit 0 with no PNG is what a script takes for
    success).

    Raises:
        ExtraMissingError: naming the option and the install command (exit code 1).
    """
    try:
        import matplotlib  # noqa: F401 - what render_png needs
    except ImportError as e:
        raise ExtraMissingError(
            f"{option} needs matplotlib (the plot extra), which cannot be imported ({e}):"
            f" pip install 'rrfp-async[plot]', or leave out {option}; nothing was written"
        ) from None


def optional_png(render: Callable[[], Any]) -> str | None:
    """Run ``render`` (a PNG timeline) unless its extra is missing: then say so in one line on
    stderr and go on, so that a plain install keeps every table and file a command wrote.

    Returns:
        What ``render`` returned, as text, or None when matplotlib is missing.
    """
    try:
        return str(render())
    except ExtraMissingError as e:
        console(stderr=True).print(
            f"PNG skipped: {e}", markup=False, highlight=False, soft_wrap=True
        )
        return None


def console(*, stderr: bool = False) -> Console:
    """A rich console (on stderr with ``stderr``).

    On a terminal it is as wide as the terminal. Otherwise (files, pipes, tests) it is
    ``$COLUMNS`` wide when that is set (``COLUMNS=80 rrfp-async ... | cat``), else 120.
    Tables never cut a cell short at any width (see :func:`table`).
    """
    c = Console(stderr=stderr)
    if not c.is_terminal:
        cols = os.environ.get("COLUMNS", "")
        c = Console(stderr=stderr, width=int(cols) if cols.isdigit() and int(cols) > 0 else 120)
    return c


def table(
    title: str,
    columns: Iterable[str],
    *,
    left: Collection[str] = (),
    whole: Collection[str] = (),
) -> Table:
    """A table titled on the left, its columns right-justified (numbers) except ``left``.

    Nothing is cut short at any console width (``COLUMNS=80``, a pipe): a cell too long for
    its column wraps at spaces and folds a word longer than the column onto the next line
    (``overflow="fold"``), never ends in an ellipsis. The ``whole`` columns (short names: a
    policy) are not narrowed while the others can wrap, so ``readiness_first`` stays on one
    line. A header may hold a newline (``"step ms\nmedian of 4"``: what the column is over).
    """
    t = Table(title=title, title_justify="left", caption_justify="left")
    for c in columns:
        t.add_column(
            c, justify="left" if c in left else "right", no_wrap=c in whole, overflow="fold"
        )
    return t


#: ``update(description, advance)``: say what runs now; ``advance`` counts one unit done.
Progress = Callable[[str, bool], None]


@contextmanager
def progress(total: int, *, enabled: bool = True) -> Iterator[Progress]:
    """Progress of a long command on stderr (stdout keeps the results: tables or JSON).

    On a terminal, a rich progress bar (gone when done); otherwise (a pipe, a file, a test)
    one plain line per update, ``[done/total] description (elapsed s)``; nothing when not
    ``enabled`` (``--json``).

    Args:
        total: Units of work (the bar's length).
        enabled: Show anything at all.

    Yields:
        ``update(description, advance)``.
    """
    if not enabled:
        yield lambda description, advance: None
        return
    con = console(stderr=True)
    if not con.is_terminal:
        t0 = time.perf_counter()
        done = 0

        def line(description: str, advance: bool) -> None:
            nonlocal done
            done += advance
            click.echo(
                f"[{done}/{total}] {description} ({time.perf_counter() - t0:.0f} s)", err=True
            )

        yield line
        return
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
    from rich.progress import Progress as Bar

    with Bar(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=con,
        transient=True,
    ) as bar:
        task = bar.add_task("", total=total)
        yield lambda description, advance: bar.update(
            task, advance=int(advance), description=description
        )


PAIRING_CAPTION = (
    "a step: the slowest rank, from a common barrier; the policies take their steps in turn"
    " (step i of each, in a rotating order): the pairing removes the microbatches' variation"
    " and drift of the machine's load, not noise within a step"
)


def speedup_table(
    title: str,
    rows: Iterable[tuple[str, float, Any]],
    *,
    steps: int,
    microbatches: int,
    base: str,
) -> Table:
    """The paired-speedup table of the real-pipeline commands (``demo``, ``bench
    pipeline``): per policy, its median step, samples per second, and its speedup over
    ``base`` (a ``PairedRatio``: median, min–max, verdict).

    Args:
        title: The table's title (what was run).
        rows: ``(policy, median step seconds, PairedRatio against base)``.
        steps: Timed steps per policy.
        microbatches: Microbatches (samples) per step.
        base: The baseline policy (its row shows no spread).
    """
    t = table(
        title,
        (
            "policy",
            f"step ms\n(median\nof {steps})",
            f"samples/s\n(median\nof {steps})",
            f"speedup\nvs {base}\n(median\nof {steps})",
            f"\nmin–max\n(of {steps}\npaired)",
            "verdict",
        ),
        left={"policy", "verdict"},
        whole={"policy"},
    )
    t.caption = PAIRING_CAPTION
    for name, step, vs in rows:
        t.add_row(
            name,
            f"{step * 1e3:.1f}",
            f"{microbatches / step:.1f}",
            f"{vs.median:.3f}x",
            "" if name == base else vs.spread,
            "baseline" if name == base else vs.note(base),
        )
    return t
