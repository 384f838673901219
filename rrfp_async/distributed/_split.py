"""Split a sequential model into pipeline stage modules, and find the parameters stages share.

Design note. A stage module holds the user's *original* block objects, never copies: the
parameters and buffers of a stage are the model's own (BatchNorm running statistics update
in place, an optimizer built on the model sees the same tensors, a checkpoint loaded into
the model is loaded into the stages), and a parameter tied across stages (an embedding and
an LM head) stays one ``Parameter`` object seen by two stages. That identity is how ties are
found: a parameter object held by two stage modules is a tie, and only that (a parameter
shared inside one stage is the stage's own business; buffers are never ties). A Hugging
Face model with ``config.tie_word_embeddings`` ties its input and output embeddings this
way (one object), so wrapping its parts in a list is enough for the tie to be found. Once the
stages live on different ranks each rank holds its own copy of such a parameter, and
``StageSplit.shared`` is what says whose gradients must be summed across stages. Every
rank builds the same model, so every rank computes the same ``shared``.

A stage registers each block under its name in the model, nested as in the model: the
blocks ``layers.3`` .. ``layers.5`` sit in the stage at ``layers.3`` .. ``layers.5``, so a
stage's parameter and ``state_dict`` names are the model's (torch's pipeline tracer names
them the same way).

Between blocks a stage follows torch pipelining's convention: a tuple output becomes the
next block's positional arguments, a mapping its keyword arguments, anything else its one
argument. The model's own ``forward`` is never called: its direct children are run in order.

torch's tracer (``torch.distributed.pipelining.pipeline``) does not keep tied parameters
tied: it deep-copies each stage's replica and lists the tie in ``pipe.replicated_params``
instead. ``from_pipe`` reads that list; ``from_stage_modules`` takes such groups as ``ties``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from .._errors import PlanError

if TYPE_CHECKING:
    from torch.distributed.pipelining import Pipe

__all__ = [
    "StageModule",
    "StageSplit",
    "from_pipe",
    "from_stage_modules",
    "register_block",
    "split_model",
]


def _call(block: nn.Module, value: Any) -> Any:
    """Call ``block`` with the previous block's output (torch pipelining's convention)."""
    if isinstance(value, tuple):
        return block(*value)
    if isinstance(value, Mapping):
        return block(**value)
    return block(value)


class _Blocks(nn.Module):
    """A stage's share of one of the model's containers (``layers``): it only holds blocks,
    under their names in the container, so parameter names stay the model's. Never called."""


def register_block(root: nn.Module, name: str, block: nn.Module) -> None:
    """Register ``block`` in ``root`` under its dotted name in the model (``layers.3``,
    ``model.layers.3``), creating the containers on the way as ``_Blocks``: the stage's
    parameter and ``state_dict`` names are then the model's."""
    *path, leaf = name.split(".")
    holder = root
    for part in path:
        nxt = holder._modules.get(part)
        if nxt is None:
            nxt = _Blocks()
            holder.add_module(part, nxt)
        holder = nxt
    holder.add_module(leaf, block)


class StageModule(nn.Module):
    """A pipeline stage: some of a model's blocks, run in order like ``nn.Sequential``.

    The first block is called with the stage's arguments; each next block with the previous
    block's output: a tuple as positional arguments, a mapping as keyword arguments, anything
    else as the one argument. The last block's output is the stage's output.

    The blocks are the model's own module objects, registered under their names in the model
    (``embed``, ``layers.3``), so the stage's parameter names and ``state_dict`` keys are the
    model's. Iterating a stage yields its blocks; ``len`` counts them.

    Args:
        blocks: ``(name in the model, block)`` in running order; a name has at most one dot
            (a block inside one of the model's ``ModuleList``/``Sequential`` children).

    Raises:
        PlanError: ``blocks`` is empty.
    """

    def __init__(self, blocks: Sequence[tuple[str, nn.Module]]) -> None:
        super().__init__()
        if not blocks:
            raise PlanError("blocks: a stage needs at least one block, got none")
        self._block_names = tuple(name for name, _ in blocks)
        self._blocks = tuple(block for _, block in blocks)
        for name, block in blocks:
            register_block(self, name, block)

    @property
    def block_names(self) -> tuple[str, ...]:
        """The blocks' names in the model, in running order."""
        return self._block_names

    def __len__(self) -> int:
        return len(self._blocks)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._blocks)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the blocks in order.

        Args:
            *args: The first block's positional arguments.
            **kwargs: The first block's keyword arguments.

        Returns:
            The last block's output.
        """
        out = self._blocks[0](*args, **kwargs)
        for block in self._blocks[1:]:
            out = _call(block, out)
        return out


@dataclass(frozen=True)
class StageSplit:
    """A model split into pipeline stages, with the parameters the stages share.

    Attributes:
        modules: Virtual stage -> its module, in pipeline order.
        shared: Tied-parameter groups that span two or more stages: group name ->
            ``((virtual stage, parameter name in that stage's module), ...)``, stages
            increasing. A group is named ``"<stage>:<name>"`` after its first entry (e.g.
            ``"0:wte.weight"``); groups are ordered by that stage, then by the parameter's
            place in the stage's ``named_parameters()``. The same on every rank: a function
            of the model and the split alone.

    Raises:
        PlanError: no module, an entry that is not a module, or a ``shared`` group with
            fewer than two stages, stages not increasing or out of range, or a name that is
            no parameter of its stage's module.
    """

    modules: tuple[nn.Module, ...]
    shared: dict[str, tuple[tuple[int, str], ...]]

    def __post_init__(self) -> None:
        object.__setattr__(self, "modules", tuple(self.modules))
        if not self.modules:
            raise PlanError("modules: a split needs at least one stage module, got none")
        for v, m in enumerate(self.modules):
            if not isinstance(m, nn.Module):
                raise PlanError(f"modules: stage {v} is a {type(m).__name__}, not an nn.Module")
        for group, entries in self.shared.items():
            stages = [v for v, _ in entries]
            if len(stages) < 2 or stages != sorted(set(stages)):
                raise PlanError(
                    f"shared: group {group!r} must list two or more stages in increasing "
                    f"order, got {entries!r}"
                )
            for v, name in entries:
                if not 0 <= v < len(self.modules):
                    raise PlanError(
                        f"shared: group {group!r} names stage {v}, outside the "
                        f"{len(self.modules)} stages"
                    )
                if name not in dict(self.modules[v].named_parameters()):
                    raise PlanError(
                        f"shared: group {group!r} names {name!r}, which is no parameter of "
                        f"stage {v}'s module"
                    )

    def modules_of(self, stages: Iterable[int]) -> dict[int, nn.Module]:
        """The modules of some virtual stages (those a rank holds).

        Args:
            stages: Virtual stage indices.

        Returns:
            ``{virtual stage: module}``, in the order given.

        Raises:
            PlanError: a stage outside ``0 .. len(modules) - 1``.
        """
        out: dict[int, nn.Module] = {}
        for v in stages:
            if not isinstance(v, int) or not 0 <= v < len(self.modules):
                raise PlanError(
                    f"stages: {v!r} is no virtual stage of this split "
                    f"(0 .. {len(self.modules) - 1})"
                )
            out[v] = self.modules[v]
        return out


# ------------------------------------------------------------------------------ the blocks


def _is_container(m: nn.Module) -> bool:
    """A ``ModuleList``/``Sequential`` that only runs its children: split_model looks into
    it. One that overrides ``forward`` does more than that, so it is a block of its own."""
    return (isinstance(m, nn.ModuleList) and type(m).forward is nn.ModuleList.forward) or (
        isinstance(m, nn.Sequential) and type(m).forward is nn.Sequential.forward
    )


def _children(m: nn.Module) -> list[tuple[str, nn.Module]]:
    # ``_modules``, not ``named_children()``: the latter drops a module repeated under a
    # second name (a block run twice), which must run twice here too.
    return [(n, c) for n, c in m._modules.items() if c is not None]


def _refuse_hf(model: nn.Module) -> None:
    """A Hugging Face model is never its children in sequence: its forward builds what its
    layers need (masks, position ids, rotary tables) and returns a ``ModelOutput``. Only a
    process that imported transformers can hold one, so nothing is imported here."""
    tf = sys.modules.get("transformers")
    base = getattr(tf, "PreTrainedModel", None) if tf is not None else None
    if not (isinstance(base, type) and isinstance(model, base)):
        return
    raise PlanError(
        f"model: the {type(model).__name__} is a Hugging Face model, whose forward builds what "
        "its layers need (the causal mask, position ids, rotary tables) between its "
        "children, which split_model only runs in sequence; split a causal LM with "
        "rr.split_causal_lm(<the *ForCausalLM model>, n_stages) (docs/hf_models.md), other "
        "models by hand"
    )


def _blocks(
    model: nn.Module | Sequence[nn.Module],
) -> tuple[list[tuple[str, nn.Module]], dict[str, int]]:
    """The model's leaf blocks ``(name, module)`` in running order, and the split points:
    ``{name: index of the block a stage beginning there starts with}``."""
    if isinstance(model, nn.Module):
        _refuse_hf(model)
        top = _children(model)
        what = f"the {type(model).__name__}"
    elif isinstance(model, Sequence):
        top = [(str(i), m) for i, m in enumerate(model)]
        what = "the list"
        for name, m in top:
            if not isinstance(m, nn.Module):
                raise PlanError(
                    f"model: item {name} of the list is a {type(m).__name__}, not an nn.Module"
                )
    else:
        raise PlanError(
            f"model: expected an nn.Module whose children run in sequence or a sequence of "
            f"modules, got a {type(model).__name__}"
        )
    blocks: list[tuple[str, nn.Module]] = []
    points: dict[str, int] = {}
    for name, child in top:
        if isinstance(child, nn.ModuleDict):
            raise PlanError(
                f"model: child {name!r} of {what} is a ModuleDict, whose entries have no "
                f"running order"
            )
        if _is_container(child):
            subs = [(f"{name}.{s}", c) for s, c in _children(child)]
            if subs:  # an empty container is no split point: no stage can begin there
                points[name] = len(blocks)
        else:
            subs = [(name, child)]
        for sub_name, block in subs:
            if isinstance(block, nn.ModuleList | nn.ModuleDict):
                raise PlanError(
                    f"model: block {sub_name!r} is a {type(block).__name__}, which cannot be "
                    f"called (split_model looks one level into a child container)"
                )
            points[sub_name] = len(blocks)
            blocks.append((sub_name, block))
    if not blocks:
        raise PlanError(f"model: {what} has no blocks to split (no child modules)")
    if isinstance(model, nn.Module):
        # A parameter or buffer no block holds is used by the model's own forward, which a
        # split does not run: the model is not just its children in sequence.
        held = {id(t) for _, b in blocks for t in (*b.parameters(), *b.buffers())}
        stray = [
            n for n, t in (*model.named_parameters(), *model.named_buffers()) if id(t) not in held
        ]
        if stray:
            raise PlanError(
                f"model: {what} holds {', '.join(stray[:4])}{' ...' if len(stray) > 4 else ''} "
                f"outside its blocks, so its forward is not just its children in sequence"
            )
    return blocks, points


def _starts(
    split_spec: Sequence[str] | int, blocks: list[tuple[str, nn.Module]], points: dict[str, int]
) -> list[int]:
    """The index of each stage's first block, from the spec."""
    n_blocks = len(blocks)
    if (
        isinstance(split_spec, bool)
        or not isinstance(split_spec, int | Sequence)
        or isinstance(split_spec, str | bytes)
    ):
        raise PlanError(
            f"split_spec: expected a list of the names where stages begin or a number of "
            f"stages, got {split_spec!r}"
        )
    if isinstance(split_spec, int):
        if not 1 <= split_spec <= n_blocks:
            raise PlanError(
                f"split_spec: {split_spec} stages; the model has {n_blocks} blocks, so 1 to "
                f"{n_blocks} stages"
            )
        # Even by blocks: each stage gets n_blocks // n, the first n_blocks % n one more.
        size, extra = divmod(n_blocks, split_spec)
        return [v * size + min(v, extra) for v in range(split_spec)]
    starts = [0]
    prev = "the model's start"
    for name in split_spec:
        if not isinstance(name, str):
            raise PlanError(f"split_spec: split names are str, got {name!r}")
        if name not in points:
            names = list(points)
            shown = names if len(names) <= 12 else [*names[:8], "...", *names[-3:]]
            raise PlanError(
                f"split_spec: unknown split name {name!r}; the split points are {', '.join(shown)}"
            )
        at = points[name]
        if at < starts[-1]:
            raise PlanError(
                f"split_spec: split names must be in increasing order, but {name!r} comes "
                f"before {prev} in the model"
            )
        if at == starts[-1]:
            raise PlanError(
                f"split_spec: stage {len(starts) - 1} would be empty: {name!r} begins at the "
                f"same block ({blocks[at][0]!r}) as {prev}"
            )
        starts.append(at)
        prev = repr(name)
    return starts


def split_model(
    model: nn.Module | Sequence[nn.Module], split_spec: Sequence[str] | int
) -> StageSplit:
    """Split a sequential model into pipeline stage modules.

    The model's *blocks* are its direct children in order, except that a child which is an
    ``nn.ModuleList`` or ``nn.Sequential`` (one that does not override ``forward``) counts
    as its own children: ``[embed, layers (6 blocks), head]`` has 8 blocks, ``embed``,
    ``layers.0`` .. ``layers.5``, ``head``. The model's own ``forward`` is not used.

    Args:
        model: An ``nn.Sequential``, an ``nn.ModuleList`` or a list of modules, or a module
            whose direct children run in sequence.
        split_spec: The names where a stage *begins*, in increasing order, like torch
            pipelining's ``split_spec`` (``["layers.2", "layers.4"]``: three stages); a
            name is a child's (``layers``: the stage begins with its first block) or a
            block's (``layers.3``). Or a number of stages ``n``: the blocks split evenly by
            count, each stage getting ``blocks // n`` and the first ``blocks % n`` stages one
            more (8 blocks in 3 stages: 3, 3, 2).

    Returns:
        The stages, each a :class:`StageModule` of the model's own block objects, and the
        parameters shared across stages.

    Raises:
        PlanError: the model is not a sequential container (no children, a ``ModuleDict``,
            parameters or buffers outside its blocks, a Hugging Face model: see
            ``split_causal_lm``); an unknown split name; names not in
            increasing order; a stage that would be empty; a number of stages below 1 or
            above the number of blocks.
    """
    blocks, points = _blocks(model)
    starts = _starts(split_spec, blocks, points)
    ends = [*starts[1:], len(blocks)]
    return from_stage_modules([StageModule(blocks[a:b]) for a, b in zip(starts, ends, strict=True)])


# ------------------------------------------------------------------------------ the ties


def from_stage_modules(
    modules: Sequence[nn.Module], *, ties: Iterable[Mapping[int, str]] = ()
) -> StageSplit:
    """A split from ready stage modules (hand-built, or from torch's pipeline tracer).

    A parameter object held by two or more of the modules is a shared group. ``ties``
    declares more groups, for replicas that are different objects (torch's tracer copies a
    tied parameter into each stage: see :func:`from_pipe`); a declared group and an
    identity group that meet become one.

    Args:
        modules: Virtual stage -> module, in pipeline order.
        ties: Declared groups, each ``{virtual stage: parameter name in its module}``.

    Returns:
        The split, its ``shared`` groups named and ordered as :class:`StageSplit` says
        (each parameter under its first name in its stage's ``named_parameters()``).

    Raises:
        PlanError: no module, an entry that is not a module, or a declared group with a
            stage out of range, a name that is no parameter, or two different parameters
            of one stage.
    """
    modules = tuple(modules)
    if not modules:
        raise PlanError("modules: a split needs at least one stage module, got none")
    for v, m in enumerate(modules):
        if not isinstance(m, nn.Module):
            raise PlanError(f"modules: stage {v} is a {type(m).__name__}, not an nn.Module")
    # Every parameter object, with where it first appears in each stage holding it.
    where: dict[int, dict[int, tuple[int, str]]] = {}  # id -> {stage: (position, name)}
    for v, m in enumerate(modules):
        for pos, (name, p) in enumerate(m.named_parameters()):
            where.setdefault(id(p), {})[v] = (pos, name)
    # Union-find over parameter objects: declared ties join replicas that are not one object.
    parent = {k: k for k in where}

    def root(k: int) -> int:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    for group in ties:
        ids: list[int] = []
        for v, name in dict(group).items():
            if not isinstance(v, int) or not 0 <= v < len(modules):
                raise PlanError(
                    f"ties: {dict(group)!r} names stage {v!r}, outside 0 .. {len(modules) - 1}"
                )
            try:
                p = modules[v].get_parameter(name)
            except AttributeError:
                raise PlanError(
                    f"ties: {dict(group)!r} names {name!r}, which is no parameter of stage "
                    f"{v}'s module"
                ) from None
            ids.append(id(p))
        for k in ids[1:]:
            parent[root(k)] = root(ids[0])
    members: dict[int, dict[int, tuple[int, str]]] = {}
    for k, stages in where.items():
        into = members.setdefault(root(k), {})
        for v, at in stages.items():
            if v in into:
                raise PlanError(
                    f"ties: stage {v}'s parameters {into[v][1]!r} and {at[1]!r} are declared "
                    f"tied but are different objects in one stage"
                )
            into[v] = at
    groups = [
        tuple((v, stages[v]) for v in sorted(stages))
        for stages in members.values()
        if len(stages) >= 2
    ]
    groups.sort(key=lambda g: (g[0][0], g[0][1][0]))
    shared = {f"{g[0][0]}:{g[0][1][1]}": tuple((v, name) for v, (_, name) in g) for g in groups}
    return StageSplit(modules, shared)


def from_pipe(pipe: Pipe) -> StageSplit:
    """A split from torch's pipeline tracer (``torch.distributed.pipelining.pipeline``).

    The stages are ``pipe.get_stage_module(i)``; the tracer's ``pipe.replicated_params``
    (its tied parameters, which it copies into each stage) become ``shared`` groups.

    Args:
        pipe: What ``pipeline(model, mb_args=..., split_spec=...)`` returned.

    Returns:
        The split.

    Raises:
        PlanError: ``pipe.replicated_params`` names a stage module the pipe does not have.
    """
    modules = [pipe.get_stage_module(i) for i in range(pipe.num_stages)]
    index = {
        name: next((v for v, m in enumerate(modules) if m is child), -1)
        for name, child in pipe.split_gm.named_children()
    }
    ties: list[dict[int, str]] = []
    for group in pipe.replicated_params:
        unknown = [name for name in group if index.get(name, -1) < 0]
        if unknown:
            raise PlanError(f"pipe: replicated_params names {unknown!r}, no stage of the pipe")
        ties.append({index[name]: param for name, param in group.items()})
    return from_stage_modules(modules, ties=ties)
