"""The options the commands share, each defined once, and the policy-name check.

Commands differ only in a default or a help line (``--jitter`` is 0 for ``simulate``, 0.3 for
the real-process runs), so each option is a small factory taking those and nothing else: the
flag names, the destination and the type stay the same everywhere. An option one command
repeats (``bench peer`` sweeps hints, policies and memory factors) is the same factory with
``repeatable=True``; its destination is then the plural (``hints``, ``memory_factors``).

Nothing here imports a benchmark: ``rrfp-async --help`` must not pay for torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

from ..policies import available_policies

if TYPE_CHECKING:
    from ..observability import LogFormat

__all__ = [
    "DEFAULT_HINT",
    "chunks_option",
    "hint_option",
    "jitter_option",
    "json_option",
    "latency_option",
    "log_choice",
    "log_options",
    "memory_budget_option",
    "memory_factor_option",
    "microbatches_option",
    "png_option",
    "policy_names",
    "policy_option",
    "repeats_option",
    "seed_option",
    "stages_option",
    "steps_option",
    "tp_option",
]

FC = TypeVar("FC", bound=Callable[..., Any])

#: The hint a command runs when given none.
DEFAULT_HINT = "breadth_first_weighted"


def _shown(default: object) -> bool | None:
    """Show a default in the help only when there is one (click's own default otherwise)."""
    return True if default is not None else None


# -- logging (every command and the group itself) ---------------------------------------------


def _set_logging(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    # The choice lives on the root context so that ``rrfp-async --log-format json simulate
    # --log-level debug`` combines both; each eager callback reconfigures with what is known.
    meta = ctx.find_root().meta
    if value is not None:
        meta[f"log_{param.name}"] = value
    fmt = meta.get("log_format", "console")
    level = meta.get("log_level", "warning")
    from ..observability import configure_logging

    configure_logging(format=fmt, level=level)
    return value


def log_options(f: FC) -> FC:
    """``--log-format`` and ``--log-level`` (step-traced structlog events) for a command."""
    f = click.option(
        "--log-level",
        "level",
        default=None,
        expose_value=False,
        callback=_set_logging,
        is_eager=True,
        type=click.Choice(["debug", "info", "warning", "error"]),
        help="debug: one event per transition; info: steps (default warning).",
    )(f)
    return click.option(
        "--log-format",
        "format",
        default=None,
        expose_value=False,
        callback=_set_logging,
        is_eager=True,
        type=click.Choice(["json", "console"]),
        help="Log lines as JSON or as console columns (stderr).",
    )(f)


def log_choice() -> tuple[LogFormat | None, str]:
    """The log format workers should configure (None: nothing would be logged), and the level."""
    meta = click.get_current_context().find_root().meta
    level: str = meta.get("log_level", "warning")
    fmt: LogFormat = meta.get("log_format", "console")
    return (fmt if level in ("debug", "info") else None), level


# -- the step's shape ------------------------------------------------------------------------


def stages_option(
    default: int | None = None, *, minimum: int = 1, help_text: str | None = None
) -> Callable[[FC], FC]:
    """``--stages`` / ``-p``, pipeline ranks; required when there is no ``default``."""
    if default is None:
        return click.option(
            "--stages",
            "-p",
            type=click.IntRange(min=minimum),
            required=True,
            help=help_text,
        )
    return click.option(
        "--stages",
        "-p",
        type=click.IntRange(min=minimum),
        default=default,
        show_default=True,
        help=help_text,
    )


def microbatches_option(
    default: int | None = None, *, short: bool = True, help_text: str | None = None
) -> Callable[[FC], FC]:
    """``--microbatches`` (``-m`` unless ``short=False``); required when there is no
    ``default``."""
    decls = ("--microbatches", "-m") if short else ("--microbatches",)
    if default is None:
        return click.option(*decls, type=click.IntRange(min=1), required=True, help=help_text)
    return click.option(
        *decls, type=click.IntRange(min=1), default=default, show_default=True, help=help_text
    )


def chunks_option() -> Callable[[FC], FC]:
    """``--chunks`` / ``-v``, model chunks per rank."""
    return click.option(
        "--chunks",
        "-v",
        type=click.IntRange(min=1),
        default=1,
        show_default=True,
        help="Model chunks per rank V.",
    )


def steps_option(default: int, help_text: str | None = None) -> Callable[[FC], FC]:
    """``--steps``, timed training steps."""
    return click.option(
        "--steps", type=click.IntRange(min=1), default=default, show_default=True, help=help_text
    )


def tp_option() -> Callable[[FC], FC]:
    """``--tp``, tensor-parallel ranks per stage."""
    return click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True)


# -- what runs the step -----------------------------------------------------------------------


def hint_option(help_text: str | None = None, *, repeatable: bool = False) -> Callable[[FC], FC]:
    """``--hint``: one (default :data:`DEFAULT_HINT`) or, ``repeatable``, several
    (``hints``)."""
    if repeatable:
        return click.option("--hint", "hints", multiple=True, help=help_text)
    return click.option("--hint", default=DEFAULT_HINT, show_default=True, help=help_text)


def policy_option(help_text: str) -> Callable[[FC], FC]:
    """``--policy`` (repeatable, into ``policies``); check the names with
    :func:`policy_names`."""
    return click.option("--policy", "policies", multiple=True, help=help_text)


def policy_names(
    given: tuple[str, ...], default: list[str], *, with_hint: bool = False
) -> list[str]:
    """The policies to compare (``default`` when none given); unknown names are refused.
    With ``with_hint``, ``policy@hint`` (``strict@1f1b``) names a policy run on another
    hint (the demo).

    Raises:
        click.BadParameter: a name no policy is registered under (exit code 2).
    """
    names = list(given) or default
    known = available_policies()
    for n in names:
        if (n.partition("@")[0] if with_hint else n) not in known:
            raise click.BadParameter(
                f"unknown policy {n!r}; choose from {known}", param_hint="--policy"
            )
    return names


def memory_factor_option(
    default: float | None = None, help_text: str | None = None, *, repeatable: bool = False
) -> Callable[[FC], FC]:
    """``--memory-factor``, the admission bound as a multiple of 1F1B's; ``repeatable``: several
    (``memory_factors``)."""
    kind = click.FloatRange(min=0, min_open=True)
    if repeatable:
        return click.option(
            "--memory-factor", "memory_factors", type=kind, multiple=True, help=help_text
        )
    return click.option(
        "--memory-factor",
        type=kind,
        default=default,
        show_default=_shown(default),
        help=help_text,
    )


class _MemoryBudget(click.ParamType):  # type: ignore[type-arg]  # (generic from click 8.2)
    """A byte budget from the command line: a plain number is a factor of the default
    (``1.5``), a number with a unit is bytes (``24GiB``, ``512MB``, ``1000000B``)."""

    name = "FACTOR|SIZE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str):
            return value
        try:
            factor = float(value)
        except ValueError:
            from .._errors import PlanError
            from .._memory import parse_memory_budget

            try:
                return parse_memory_budget(value, "--memory-budget")
            except PlanError as e:
                self.fail(str(e), param, ctx)
        if not factor > 0 or factor == float("inf"):
            self.fail(f"{value!r}: a factor must be a finite number > 0", param, ctx)
        return factor


def memory_budget_option(
    default: float | None = None, help_text: str | None = None
) -> Callable[[FC], FC]:
    """``--memory-budget``: each rank's activation byte budget, a factor of what strict 1F1B
    holds on the step's microbatches (a plain number) or bytes (a number with a unit)."""
    return click.option(
        "--memory-budget",
        type=_MemoryBudget(),
        default=default,
        show_default=_shown(default),
        help=help_text,
    )


# -- noise and timing -------------------------------------------------------------------------


def jitter_option(default: float = 0.3, help_text: str | None = None) -> Callable[[FC], FC]:
    """``--jitter``, sigma of the lognormal compute noise."""
    return click.option(
        "--jitter",
        type=click.FloatRange(min=0),
        default=default,
        show_default=True,
        help=help_text,
    )


def latency_option(default: float, help_text: str | None = None) -> Callable[[FC], FC]:
    """``--latency``, mean simulated message latency in seconds."""
    return click.option(
        "--latency",
        type=click.FloatRange(min=0),
        default=default,
        show_default=True,
        help=help_text,
    )


def seed_option(f: FC) -> FC:
    """``--seed`` of the workload and the noise."""
    return click.option("--seed", type=int, default=0, show_default=True)(f)


def repeats_option(
    default: int, *, minimum: int = 1, help_text: str | None = None
) -> Callable[[FC], FC]:
    """``--repeats`` of a measurement."""
    return click.option(
        "--repeats",
        type=click.IntRange(min=minimum),
        default=default,
        show_default=True,
        help=help_text,
    )


# -- output ------------------------------------------------------------------------------------


def json_option(help_text: str) -> Callable[[FC], FC]:
    """``--json`` (into ``as_json``): print JSON instead of tables."""
    return click.option("--json", "as_json", is_flag=True, help=help_text)


def png_option(help_text: str) -> Callable[[FC], FC]:
    """``--png`` (into ``png_path``): where a timeline goes."""
    return click.option(
        "--png",
        "png_path",
        type=click.Path(dir_okay=False),
        default=None,
        help=help_text,
    )
