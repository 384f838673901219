"""torch's step call styles, as the torch drop-in takes them: one microbatch per ``Chunk``.

torch's ``step`` takes the whole batch (``step(x)``, ``step(target=y, losses=losses)``;
2.13) and chunks it with its own ``split_args_kwargs_into_chunks``, or microbatches already
split (``step(arg_mbs=, kwarg_mbs=, target_mbs=, loss_kwargs=)``, 2.14's pre-split call, as
torchtitan's trainer makes it), never both; 2.15 adds ``finalize_gradients``
(``_torch_fsdp``). The checks and their messages are torch's (``_get_microbatch_inputs``,
``_check_inputs``), so a script torch refuses is refused alike. Constructor keywords some
versions lack (``use_full_backward``, ``backward_requires_autograd``) are passed where the
installed torch's signature has them (``supported``: chosen by the signature, not the
version string).

torch's rule for the inputs (``forward_one_chunk``): positional inputs feed the first stage
only, each microbatch's keyword inputs feed every stage (``first_input``,
``stage_side_inputs``).

A batch that does not split into ``n_microbatches`` (fewer rows than microbatches) is known
only to the ranks that hold it: the first stage's (its inputs), the last stage's (its
targets), every rank given keyword inputs. Refusing the call there alone would leave the
other ranks waiting in the step for the watchdog, so the step runs with the refused
microbatches (``refused_chunks``: empty, as a middle rank's, carrying the ``PlanError``),
and the first forward of this rank raises it: the step fails on every rank at once, each
with a ``PlanError`` (the others' ``PeerPlanError`` carries this rank's message).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from .._errors import PlanError
from .._pytree import Args

__all__ = [
    "Chunk",
    "check_mbs",
    "first_input",
    "listed_chunks",
    "refused_chunks",
    "split_step_inputs",
    "stage_side_inputs",
    "supported",
]


class Chunk:
    """One microbatch as torch's ``step`` splits it (what ``durations`` callables see).

    ``error``: the ``PlanError`` that refused the step's batch on this rank (a refused
    microbatch is empty, like a middle rank's: see the module's note), else None."""

    __slots__ = ("args", "error", "kwargs", "loss", "loss_kwargs", "target")

    def __init__(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        target: Any,
        loss_kwargs: Any,
        error: PlanError | None = None,
    ) -> None:
        self.args = args
        self.kwargs = kwargs
        self.target = target
        self.loss_kwargs = loss_kwargs or {}
        self.loss: torch.Tensor | None = None  # the last stage's loss, detached
        self.error = error


def first_input(mb: Chunk) -> Args:
    """The first stage's input of microbatch ``mb``: its positional and keyword inputs."""
    return Args(*mb.args, **mb.kwargs)


def stage_side_inputs(stage: int, mb: Chunk) -> dict[str, Any]:
    """torch's rule (``forward_one_chunk``): positional inputs feed the first stage only, the
    microbatch's keyword inputs feed every stage (torchtitan sends ``positions`` and
    ``attention_masks`` that way). The first stage has them in its input already.

    Raises:
        PlanError: The step's batch was refused on this rank (``refused_chunks``): every
            forward here raises it, the first fails the step on every rank.
    """
    if mb.error is not None:
        raise mb.error
    return {} if stage == 0 else mb.kwargs


def check_mbs(mbs: Any, name: str, n: int) -> None:
    """torch's ``_check_inputs``: a list of one entry per microbatch."""
    if not isinstance(mbs, list):
        raise TypeError(f"{name} must be a list but got a {type(mbs)}")
    if len(mbs) != n:
        raise ValueError(f"Expecting {n} {name} but got {len(mbs)}")


def supported(fn: Callable[..., Any], kwargs: dict[str, tuple[Any, Any]]) -> dict[str, Any]:
    """The keywords of ``kwargs`` (name -> (value, default)) that ``fn`` accepts in the
    installed torch: one a version lacks is left out when it has its default, else PlanError
    (chosen by the signature, not the version string)."""
    params = inspect.signature(fn).parameters
    out = {}
    for k, (v, default) in kwargs.items():
        if k in params:
            out[k] = v
        elif v != default:
            raise PlanError(
                f"{k}={v!r}: torch {torch.__version__}'s {fn.__qualname__} has no such argument"
            )
    return out


def split_step_inputs(
    n: int,
    args_chunk_spec: Any,
    kwargs_chunk_spec: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    target: Any,
    loss_kwargs: Any,
    arg_mbs: Any,
    kwarg_mbs: Any,
    target_mbs: Any,
    *,
    rank: int,
) -> list[Chunk]:
    """The step's ``n`` microbatches, as torch makes them (``_get_microbatch_inputs``):
    whole-batch inputs chunked, or the caller's pre-split lists (never both). A batch that
    does not split into ``n`` gives ``refused_chunks`` (``rank`` names this rank in their
    error)."""
    if loss_kwargs is not None and not isinstance(loss_kwargs, dict):
        raise TypeError(f"loss_kwargs must be a dict, got {type(loss_kwargs)}")
    if any(m is not None for m in (arg_mbs, kwarg_mbs, target_mbs)):
        if args:
            raise ValueError(
                "When using pre-split inputs, pass pre-split positional inputs through"
                " arg_mbs=... instead of positional args."
            )
        if kwargs:
            raise ValueError(
                "Unexpected keyword arguments with pre-split inputs:"
                f" {', '.join(sorted(kwargs))}."
                " Pass pre-split keyword inputs through kwarg_mbs=..."
            )
        if target is not None:
            raise ValueError(
                "When using pre-split inputs, pass pre-split targets through target_mbs=..."
                " instead of target=..."
            )
        for name, mbs in (("arg_mbs", arg_mbs), ("kwarg_mbs", kwarg_mbs)):
            if mbs is not None:
                check_mbs(mbs, name, n)
        if target_mbs is not None:
            check_mbs(target_mbs, "target_mbs", n)
        a = arg_mbs if arg_mbs is not None else [()] * n
        k = kwarg_mbs if kwarg_mbs is not None else [{}] * n
        for i in range(n):
            if not isinstance(a[i], tuple):
                raise TypeError(
                    f"arg_mbs must be a list of tuples, but arg_mbs[{i}] is a {type(a[i])}"
                )
            if not isinstance(k[i], dict):
                raise TypeError(
                    f"kwarg_mbs must be a list of dicts, but kwarg_mbs[{i}] is a {type(k[i])}"
                )
        t = target_mbs if target_mbs is not None else [None] * n
        return [Chunk(a[i], dict(k[i]), t[i], loss_kwargs) for i in range(n)]
    from torch.distributed.pipelining.microbatch import (
        TensorChunkSpec,
        _split_tensor,
        split_args_kwargs_into_chunks,
    )

    try:  # torch asserts when a tensor has fewer rows than chunks (or makes fewer chunks)
        if args or kwargs:
            a, k = split_args_kwargs_into_chunks(
                args, kwargs, n, args_chunk_spec, kwargs_chunk_spec
            )
        else:
            a, k = [()] * n, [{}] * n
        spec = TensorChunkSpec(0)  # type: ignore[no-untyped-call]
        t = list(_split_tensor(target, spec, n)) if target is not None else [None] * n
    except AssertionError as e:
        return refused_chunks(n, loss_kwargs, _unsplit(n, rank, (args, kwargs, target), e))
    if len(a) != n or len(t) != n:
        return refused_chunks(n, loss_kwargs, _unsplit(n, rank, (args, kwargs, target), None))
    return [Chunk(tuple(a[i]), dict(k[i]), t[i], loss_kwargs) for i in range(n)]


def _unsplit(n: int, rank: int, batch: Any, cause: AssertionError | None) -> PlanError:
    """The ``PlanError`` of a batch (``(args, kwargs, target)``) that does not split into
    ``n`` microbatches: its rows (the fewest along dimension 0, where torch's default chunk
    spec splits), ``n`` and the fix."""
    rows = [t.shape[0] for t in tree_leaves(batch) if isinstance(t, torch.Tensor) and t.dim()]
    few = min(rows, default=None)
    what = f"a batch of {few} row{'s' * (few != 1)}" if few is not None else "the batch"
    why = f" (torch: {cause})" if cause is not None and str(cause) else ""
    return PlanError(
        f"rank {rank}: step() got {what}, which does not split into n_microbatches={n}"
        f" microbatches{why}: each microbatch takes at least one row of dimension 0. Pass a"
        f" batch of at least {n} rows (a multiple of {n} for microbatches of one size), or"
        f" build the schedule with n_microbatches <= {few if few else 'the batch size'}"
        " (every rank alike)"
    )


def refused_chunks(n: int, loss_kwargs: Any, error: PlanError) -> list[Chunk]:
    """``n`` empty microbatches (as a middle rank's: ``durations`` and ``sizes`` callables
    see them so) that carry ``error``: the step runs and this rank's first forward raises it
    (``stage_side_inputs``), so that every rank fails it at once (see the module's note)."""
    return [Chunk((), {}, None, loss_kwargs, error) for _ in range(n)]


def listed_chunks(
    arg_mbs: Sequence[tuple[Any, ...]] | None,
    kwarg_mbs: Sequence[dict[str, Any]] | None,
    target_mbs: Sequence[Any] | None,
    loss_kwargs: dict[str, Any] | None,
    n_default: int,
) -> list[Chunk]:
    """``step_microbatches``' microbatches: lists of any length (one entry per microbatch,
    all of one length), or ``n_default`` empty ones on a rank that passes no list."""
    n = next((len(x) for x in (arg_mbs, kwarg_mbs, target_mbs) if x is not None), n_default)
    for name, x in (("arg_mbs", arg_mbs), ("kwarg_mbs", kwarg_mbs), ("target_mbs", target_mbs)):
        if x is not None and len(x) != n:
            raise PlanError(f"{name} has {len(x)} microbatches, the others {n}")
    return [
        Chunk(
            tuple(arg_mbs[i]) if arg_mbs is not None else (),
            dict(kwarg_mbs[i]) if kwarg_mbs is not None else {},
            target_mbs[i] if target_mbs is not None else None,
            loss_kwargs,
        )
        for i in range(n)
    ]
