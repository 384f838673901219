"""torchtitan's pipeline schedule by configuration value (``rrfp_async.torchtitan``).

A torchtitan user switches with two command-line flags and changes no code::

    torchrun ... -m torchtitan.train --module llama3 --config llama3_8b \\
        --override.imports rrfp_async.torchtitan.readiness_first \\
        --parallelism.pipeline_parallel_schedule ReadinessFirst

and configures the schedule through the override entry's keyword arguments::

    --override.imports 'rrfp_async.torchtitan.readiness_first={"policy": "strict", "hint": "1F1B"}'

Schedule names (case-insensitive, ``_`` and ``-`` ignored, like torch's own lookup
otherwise; every other name still goes to torch's ``get_schedule_class``):

* ``ReadinessFirst``: one stage per rank, the project's default hint;
  ``InterleavedReadinessFirst``: several stages per rank, interleaved (torch's loop placement).
* ``ReadinessFirst<torch order>``: torch's order as the hint, in the kind and placement torch's
  class has: ``ReadinessFirst1F1B``, ``ReadinessFirstGPipe`` (one stage per rank),
  ``ReadinessFirstInterleaved1F1B``, ``ReadinessFirstLoopedBFS``,
  ``ReadinessFirstInterleavedZeroBubble`` (interleaved). The V-shape ones
  (``ReadinessFirstZBVZeroBubble``, ``ReadinessFirstDualPipeV``) are refused, saying why (see
  the design note).
* ``ReadinessFirst<our hint>`` / ``InterleavedReadinessFirst<our hint>``: one of
  ``rr.HINTS`` (or an alias), e.g. ``ReadinessFirstBFW``,
  ``InterleavedReadinessFirstBreadthFirstWeighted``, ``ReadinessFirstZBH1``; a hint that
  cannot order that kind of schedule is not a name (``schedule_names()`` lists them all).

Design note
-----------
torchtitan 0.3 resolves ``parallelism.pipeline_parallel_schedule`` with torch's closed
``get_schedule_class``, imported by name into ``torchtitan.distributed.pipeline_parallel``,
and its documented hook for user code is the override mechanism: ``--override.imports
module.function`` imports ``module`` in ``Trainer.__init__`` before the pipeline is built and
calls the ``@override`` factory ``function`` on the config node it targets, with the entry's
keyword arguments. So importing ``rrfp_async.torchtitan`` (``install``) does the work, and
the factory carries the options:

* the module's ``get_schedule_class`` is replaced by a resolver that knows our names and
  hands every other name to torch's; each of our names resolves to a cached subclass of
  ``ScheduleReadinessFirst`` / ``ScheduleInterleavedReadinessFirst`` with its hint bound
  (``_default_hint``), so torchtitan's ``issubclass`` checks and constructor calls take it
  as they take torch's classes;
* V-shape is not offered through torchtitan. torchtitan places a rank's stages V-shape only
  for torch's own two classes (by identity, in ``_get_pp_rank_to_stage_indices_mapping``; the
  loss rank in ``components.metrics`` by the name ``"ZBVZeroBubble"``), and, decisively, it
  wraps every stage in FSDP (``fully_shard``, also on a data-parallel mesh of size 1), while
  the V orders need the split backward, which the runtime refuses on FSDP-wrapped stages
  (its ``W`` would run past FSDP's unshard and reduce-scatter: ZBV fails at the first ``W``
  on torchtitan's llama3). Patching the placement would only move the failure,
  so the names raise ``PlanError`` that says so and points to the torch API (V-shape trains
  through ``rrfp_async.pipelining`` on stages without FSDP). The other orders that split the
  backward (``InterleavedZeroBubble``, our ``zb_h1``, ``split_backward: true``) resolve, and
  are refused at construction on FSDP-wrapped stages by the same check;
* ``readiness_first`` is registered with ``@override`` on the trainer's ``profiler`` node
  (``Profiler.Config``: present in every ``Trainer.Config``, once; rarely overridden) and
  returns it unchanged: it only records the options, which every schedule resolved by name
  afterwards is built with. A name of ours resolved before the factory ran is refused (the
  options the user gave would silently not apply).

What is patched must exist with the expected shape, checked by feature, not by version: a
torchtitan without it raises ``PlanError`` naming its version. torchtitan is imported by
``install`` only (``import rrfp_async`` never imports it).

torchtitan never closes its schedule (``Trainer.close()`` does not know it has one to close);
our schedule's stage holds an event-loop thread and a channel on process groups, so
``Trainer.close`` is wrapped to close it first (schedules of ours only).
"""

from __future__ import annotations

import importlib
import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._check import check_bool, check_real, describe
from .._errors import ExtraMissingError, PlanError, RRFPError
from .._memory import parse_memory_budgets
from .._tasks import StepPlan, Topology
from ._torch_pipelining import ScheduleInterleavedReadinessFirst, ScheduleReadinessFirst

__all__ = [
    "OPTIONS",
    "install",
    "readiness_first",
    "schedule_class",
    "schedule_names",
    "schedule_options",
]

FACE = "rrfp_async.torchtitan"
"""The module a torchtitan user names in ``--override.imports`` (the factory's path)."""

OPTIONS = ("hint", "memory_budget", "memory_factor", "policy", "split_backward", "step_timeout")
"""The keyword arguments ``readiness_first`` takes from its override entry."""

# torchtitan's first step may compile the model (torch.compile) and run its first
# collectives; torchtitan itself allows it comm.init_timeout_seconds (300 s by default). Our
# per-step watchdog gets the same default here.
TITAN_STEP_TIMEOUT = 300.0

_SINGLE = "ReadinessFirst"
_MULTI = "InterleavedReadinessFirst"
# torch's orders offered as hints, by the names torch's get_schedule_class knows; those the
# installed torch lacks are left out.
_TORCH_ORDERS = (
    "1F1B",
    "GPipe",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)


def _key(name: str) -> str:
    return name.strip().lower().replace("_", "").replace("-", "")


def _display(hint: str) -> str:
    """A hint's name in a schedule name: ``breadth_first_weighted`` -> BreadthFirstWeighted,
    ``bfw`` -> BFW, ``zb_h1`` -> ZBH1 (short parts upper-case; lookup ignores case)."""
    return "".join(
        p.upper() if len(p) <= 3 or not p.isalpha() else p.capitalize() for p in hint.split("_")
    )


@dataclass(frozen=True)
class _Entry:
    """One schedule name: the class kind, the hint bound to it, what the hint needs."""

    name: str
    base: type
    hint: Any  # a torch schedule class, one of our hint names, or None (the default)
    vshape: bool = False
    split: bool | None = None  # True: the hint needs split_backward=True


_lock = threading.Lock()
_table_cache: dict[str, _Entry] | None = None
_classes: dict[str, type] = {}


def _probe_hint(hint: str, chunks: int) -> bool | None:
    """None when our hint ``hint`` cannot order ``chunks`` stages per rank, else whether it
    needs the split backward (``zb_h1``). Probed on a small plan, so a name exists exactly
    when its schedule can be built."""
    from ..policies import make_hint

    for split in (False, True):
        plan = StepPlan(
            topology=Topology(stages=2, chunks=chunks),
            microbatches=4,
            split_backward=split,
            ordered_weights=split,
        )
        try:
            make_hint(hint, plan)
        except RRFPError:
            continue
        return split
    return None


def _table() -> dict[str, _Entry]:
    """Every name of ours, by ``_key``: built once, from torch's classes and ``HINTS``."""
    global _table_cache
    with _lock:
        if _table_cache is not None:
            return _table_cache
        from torch.distributed.pipelining import schedules

        from ..policies import HINT_ALIASES as _ALIASES
        from ..policies import HINTS, hint_from_torch

        table: dict[str, _Entry] = {
            _key(_SINGLE): _Entry(_SINGLE, ScheduleReadinessFirst, None),
            _key(_MULTI): _Entry(_MULTI, ScheduleInterleavedReadinessFirst, None),
        }
        # Ours first: torch's orders take a shared name (ReadinessFirst1F1B is torch's
        # Schedule1F1B order, task for task, whatever our generator of that name gives).
        # The short aliases (bf, bfw) are names too; the spelled-out ones are not.
        for hint in [*HINTS, *(a for a in _ALIASES if len(a) <= 4)]:
            for prefix, base, chunks in (
                (_SINGLE, ScheduleReadinessFirst, 1),
                (_MULTI, ScheduleInterleavedReadinessFirst, 2),
            ):
                name = prefix + _display(hint)
                split = None if _key(name) in table else _probe_hint(hint, chunks)
                if split is not None:
                    table[_key(name)] = _Entry(name, base, hint, split=split or None)
        # get_schedule_class exists only in torch versions with a name registry of schedules.
        lookup: Any = getattr(schedules, "get_schedule_class", None)
        for order in _TORCH_ORDERS if lookup is not None else ():
            try:
                cls = lookup(order)
            except ValueError:
                continue  # this torch has no such schedule
            plan, _ = hint_from_torch(cls, stages=2, microbatches=8)
            single = issubclass(cls, schedules.PipelineScheduleSingle)
            name = _SINGLE + order
            table[_key(name)] = _Entry(
                name,
                ScheduleReadinessFirst if single else ScheduleInterleavedReadinessFirst,
                cls,
                vshape=plan.topology.placement == "vshape",
            )
        _table_cache = table
        return table


def schedule_names() -> list[str]:
    """Every schedule name of ours that ``parallelism.pipeline_parallel_schedule`` takes
    (after ``import rrfp_async.torchtitan``), sorted (the refused V-shape ones left out)."""
    return sorted(e.name for e in _table().values() if not e.vshape)


def _entry(name: Any) -> _Entry | None:
    """Our entry for ``name``; None for a name that is not ours (torch's, or unknown);
    PlanError for a name in our grammar (``ReadinessFirst...``) that names nothing."""
    if not isinstance(name, str):
        return None
    key = _key(name)
    got = _table().get(key)
    if got is None and (key.startswith(_key(_SINGLE)) or key.startswith(_key(_MULTI))):
        raise PlanError(
            f"pipeline schedule {name!r}: rrfp_async has no schedule of that name (a hint"
            " that cannot order that kind of schedule is not one either); choose one of"
            f" {schedule_names()}"
        )
    return got


def schedule_class(name: str, fallback: Callable[[str], Any] | None = None) -> Any:
    """The schedule class of a ``pipeline_parallel_schedule`` name.

    Args:
        name: One of ``schedule_names()`` (case-insensitive), or any other name.
        fallback: How a name that is not ours is resolved (default: torch's
            ``get_schedule_class``).

    Returns:
        For our names, a subclass of ``ScheduleReadinessFirst`` (one stage per rank) or
        ``ScheduleInterleavedReadinessFirst`` with the name's hint bound (the same class each
        time); otherwise what ``fallback`` returns.

    Raises:
        PlanError: A name of our form (``ReadinessFirst...``) that names no schedule, or a
            V-shape one (refused; see the module's design note).
        ValueError: From torch, for a name neither of us knows.
    """
    entry = _entry(name)
    if entry is not None and entry.vshape:
        raise PlanError(
            f"pipeline schedule {name!r}: V-shape placement is not offered through torchtitan:"
            " torchtitan wraps every pipeline stage in FSDP, and the V orders need the split"
            " backward (input and weight gradients as separate tasks), which rrfp_async refuses"
            " on FSDP-wrapped stages (it would run past FSDP's unshard and reduce-scatter)."
            " Use torchtitan's own ZBVZeroBubble / DualPipeV, or rrfp_async.pipelining's"
            " ScheduleInterleavedReadinessFirst through torch's API on stages without FSDP"
        )
    if entry is None:
        if fallback is None:
            from torch.distributed.pipelining import schedules

            fallback = schedules.get_schedule_class
        return fallback(name)
    with _lock:
        cls = _classes.get(entry.name)
        if cls is None:
            cls = _classes[entry.name] = _bound_class(entry)
    return cls


def _bound_class(entry: _Entry) -> type:
    base: Any = entry.base
    bound_hint = entry.hint

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        opts = schedule_options()
        if "hint" in opts and bound_hint is not None:
            raise PlanError(
                f"pipeline schedule {entry.name!r} has its hint in its name; the override's"
                f" hint={opts['hint']!r} would contradict it: use the plain name"
                f" {_MULTI if entry.base is ScheduleInterleavedReadinessFirst else _SINGLE!r}"
                " with that hint, or drop it"
            )
        if entry.split:
            kwargs.setdefault("split_backward", True)
        kwargs.setdefault("step_timeout", TITAN_STEP_TIMEOUT)
        for k, v in opts.items():
            kwargs[k] = v
        base.__init__(self, *args, **kwargs)

    hint = getattr(bound_hint, "__name__", bound_hint)
    return type(
        f"Schedule{entry.name}",
        (base,),
        {
            "__init__": __init__,
            "__module__": FACE,
            "__qualname__": f"Schedule{entry.name}",
            "__doc__": (
                f"``{entry.name}``: ``{base.__name__}`` with hint {hint or 'the default'}"
                " (made by name for torchtitan; built with the override's options)."
            ),
            "_default_hint": bound_hint,
            "rrfp_schedule_name": entry.name,
        },
    )


# ---------------------------------------------------------------------------- the factory

_options: dict[str, Any] = {}
_applied = False


def _check_options(options: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise PlanError(
            f"{FACE}.readiness_first: unknown option(s) {unknown}; it takes {list(OPTIONS)}"
        )
    # JSON null is the default, except for step_timeout, where it means no watchdog.
    out = {k: v for k, v in options.items() if v is not None or k == "step_timeout"}
    if out.get("policy") is not None:
        from ..policies import get_policy

        if not isinstance(out["policy"], str):
            raise PlanError(f"policy must be a policy name, got {describe(out['policy'])}")
        get_policy(out["policy"])
    if out.get("memory_factor") is not None:
        check_real("memory_factor", out["memory_factor"], minimum=0, strict_minimum=True)
    if out.get("memory_budget") is not None:
        # The torch drop-in's own check (the per-rank count is checked there, at the
        # schedule's construction, where the pipeline's ranks are known).
        parse_memory_budgets(out["memory_budget"])
        if out.get("memory_factor") is not None:
            raise PlanError(
                f"{FACE}.readiness_first: give memory_budget (bytes, or a float factor of what"
                " the fixed order holds in bytes) or memory_factor (a count of activations),"
                " not both"
            )
    if out.get("split_backward") is not None:
        check_bool("split_backward", out["split_backward"])
    if out.get("step_timeout") is not None:
        check_real("step_timeout", out["step_timeout"], minimum=0, strict_minimum=True)
    if "hint" in out:
        hint = out["hint"]
        if not isinstance(hint, str):
            raise PlanError(f"hint must be a hint or torch schedule name, got {describe(hint)}")
        from ..policies import canonical_hint_name, hint_from_torch

        try:
            canonical_hint_name(hint)
        except RRFPError:
            try:
                hint_from_torch(hint, stages=2, microbatches=8)
            except RRFPError as e:
                raise PlanError(
                    f"hint {hint!r} is neither an rrfp_async hint nor a torch schedule: {e}"
                ) from None
    return out


def readiness_first(config: Any, **options: Any) -> Any:
    """torchtitan's override factory for rrfp_async's schedules (``--override.imports
    rrfp_async.torchtitan.readiness_first``): records the options every schedule resolved by
    name (``parallelism.pipeline_parallel_schedule ReadinessFirst...``) is then built with,
    and returns the config node it is applied to unchanged.

    Args:
        config: The node torchtitan applies it to (the trainer's ``profiler`` config).
        **options: From the override entry (``'rrfp_async.torchtitan.readiness_first=
            {"policy": "strict", "memory_factor": 2}'``): ``policy`` (default
            ``readiness_first``; ``strict`` runs the hint's order as torch does),
            ``memory_factor`` (scale of the admission bound, a count of activations),
            ``memory_budget`` (the admission bound in bytes, learned from the run as the
            torch drop-in learns it: a float factor of what the fixed order holds, ``2.0``
            (a JSON ``2`` is 2 bytes), an int of bytes, a string with a unit, ``"24GiB"``, or
            a list of those, one per pipeline rank; not with ``memory_factor``; needs a job
            of one pipeline, pipeline parallelism alone), ``split_backward``,
            ``step_timeout`` (seconds; default 300, torchtitan's first-step timeout; null:
            none) and ``hint`` (an ``rr.HINTS`` name or a torch schedule name, with the
            plain names ``ReadinessFirst`` / ``InterleavedReadinessFirst`` only). A null
            value is the default (for ``step_timeout``: no watchdog).

    Returns:
        ``config``, unchanged.

    Raises:
        PlanError: An option it does not take (named), or a bad value.
        PolicyError: An unknown policy name.
    """
    global _applied
    checked = _check_options(options)
    with _lock:
        _options.clear()
        _options.update(checked)
        _applied = True
    return config


def schedule_options() -> dict[str, Any]:
    """The options the last ``readiness_first`` call recorded (a copy)."""
    with _lock:
        return dict(_options)


# ---------------------------------------------------------------------------- install

_installed = False


def _version(tt: Any) -> str:
    # An editable or source install of torchtitan may report no (or a 0.0.0) __version__.
    v = getattr(tt, "__version__", None)
    if v in (None, "", "0.0.0"):
        try:
            from importlib.metadata import version

            v = version("torchtitan")
        except Exception:
            v = "unknown"
    return str(v)


def _need(module: Any, attr: str, params: tuple[str, ...] | None, version: str) -> Any:
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise PlanError(
            f"torchtitan {version} has no {module.__name__}.{attr}, which rrfp_async.torchtitan"
            " needs to select its schedules by name; use rrfp_async.pipelining's classes"
            " through torch's API instead"
        )
    fn = getattr(fn, "rrfp_original", fn)
    if params is not None:
        got = tuple(inspect.signature(fn).parameters)
        if got[: len(params)] != params:
            raise PlanError(
                f"torchtitan {version}'s {module.__name__}.{attr}{got} is not the"
                f" {params} rrfp_async.torchtitan knows; use rrfp_async.pipelining's classes"
                " through torch's API instead"
            )
    return fn


def install() -> None:
    """Teach torchtitan our schedule names and register ``readiness_first`` with its
    override mechanism (see the module's design note). Idempotent; ``import
    rrfp_async.torchtitan`` calls it.

    Raises:
        ExtraMissingError: torchtitan is not installed (an ImportError).
        PlanError: torchtitan lacks (by feature) what is patched; the message names its
            version.
    """
    global _installed
    if _installed:
        return
    try:
        tt = importlib.import_module("torchtitan")
    except ImportError as e:
        raise ExtraMissingError(
            f"rrfp_async.torchtitan needs torchtitan installed (pip install torchtitan): {e}"
        ) from e
    version = _version(tt)
    pp = importlib.import_module("torchtitan.distributed.pipeline_parallel")
    overrides = importlib.import_module("torchtitan.config.override")
    profiler = importlib.import_module("torchtitan.tools.profiler")
    trainer = importlib.import_module("torchtitan.trainer")

    torch_lookup = _need(pp, "get_schedule_class", ("schedule_name",), version)
    register = _need(overrides, "override", None, version)
    # torchtitan 0.3's config tree (Trainer.Config.profiler); other versions may lack it.
    Profiler = getattr(profiler, "Profiler", None)
    fields = getattr(getattr(trainer, "Trainer", None), "Config", None)
    if Profiler is None or "profiler" not in getattr(fields, "__dataclass_fields__", {}):
        raise PlanError(
            f"torchtitan {version} has no Trainer.Config.profiler (Profiler.Config), the node"
            " rrfp_async.torchtitan.readiness_first is applied to; use rrfp_async.pipelining's"
            " classes through torch's API instead"
        )
    close = _need(trainer.Trainer, "close", ("self",), version)

    def get_schedule_class(schedule_name: str) -> Any:
        if _entry(schedule_name) is not None and not _applied:
            raise PlanError(
                f"pipeline schedule {schedule_name!r}: rrfp_async.torchtitan was imported,"
                f" but torchtitan never applied {FACE}.readiness_first (so its options would"
                f" not reach the schedule): list it in --override.imports {FACE}.readiness_first"
                " (and keep the trainer's profiler config)"
            )
        return schedule_class(schedule_name, fallback=torch_lookup)

    get_schedule_class.rrfp_original = torch_lookup  # type: ignore[attr-defined]
    setattr(pp, "get_schedule_class", get_schedule_class)  # noqa: B010 (a module attribute)

    def close_schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        # torchtitan's Trainer sets pp_schedule only when pipeline parallelism is on.
        sched = getattr(self, "pp_schedule", None)
        if isinstance(sched, (ScheduleReadinessFirst, ScheduleInterleavedReadinessFirst)):
            sched.close()
        return close(self, *args, **kwargs)

    close_schedule.rrfp_original = close  # type: ignore[attr-defined]
    trainer.Trainer.close = close_schedule

    # torchtitan's private override registry (0.3); absent, the override is registered anew.
    if f"{FACE}.readiness_first" not in getattr(overrides, "_REGISTRY", {}):
        # torchtitan keys an override by its factory's module.function, the path the user
        # lists: the public face's, not this private module's.
        readiness_first.__module__ = FACE
        register(
            target=Profiler.Config,
            fqns=["profiler"],
            description="rrfp_async's readiness-first pipeline schedules (options only)",
        )(readiness_first)
    _installed = True
