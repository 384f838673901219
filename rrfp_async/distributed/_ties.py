"""Tied parameters across ranks: the reduction of declared ties, the search for undeclared ones.

Design note
-----------
A parameter that lives on several pipeline ranks (GPT-2's ``wte`` on the first stage and its
``lm_head`` on the last) exists once per rank. Each copy only sees the gradient of its own
use, so unless the copies' gradients are summed before the optimizer, they drift apart and
nothing warns (the model trains silently wrong). Two parts:

* **Declared ties** (``TorchStageExecutor(shared={name: [(virtual stage, parameter name),
  ...]})``, or found by ``rr.split_model``): every rank knows every tie's places, and the
  plan's topology says which pipeline rank holds each place, so every process can build the
  same list of gloo groups (one per tie and per pipeline, i.e. per TP and DP index) in the
  same order without talking (``tie_groups``). After a training step, each rank sums its
  local copies, all-reduces (sum) over the tie's group and writes the sum into every copy.
  What is summed is this step's contribution alone: ``DistributedStage`` sets each copy's
  accumulated gradient aside while the step runs and adds it back afterwards, so steps that
  accumulate (no ``zero_grad`` between them) do not sum the earlier steps again (see
  ``rrfp_async.loop._accumulate``).
  The plan check covers the declarations (a digest of them is part of the plan), so ranks
  that declare differently fail at the first step, before any group is built.
* **Undeclared ties** are found at a stage's first training step: each rank fingerprints its
  trainable parameters (shape + a hash of 128 sampled values; constant-valued ones such as a
  LayerNorm's initial ones are skipped), the ranks all-gather the fingerprints as a small
  JSON document in a uint8 tensor (never pickled), and two parameters of one pipeline with
  the same fingerprint on different ranks that no tie declares are a ``PlanError`` on every
  rank naming both. The rule that tells a tie from equal initial values: a weight shared by
  two *different* uses has different names in its two stage modules (GPT-2's ``wte.weight``
  and ``lm_head.weight``), while stages that the same code built from the same seed (every
  rank seeds alike, then builds its stage) hold look-alikes under the *same* name
  (``0.weight`` on both). A match under different names is refused; a match under one name
  is logged as a warning (logger ``rrfp_async.distributed._ties``) and trains untied. A tie
  whose two places carry the same name must be declared. ``check_ties=False`` switches the
  search off.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._bridges import work_future
from .._errors import PeerError, PlanError, StepTimeoutError
from .._tasks import Topology
from ._layout import ProcessLayout

_log = logging.getLogger(__name__)

__all__ = ["find_undeclared_ties", "fingerprint", "reduce_ties", "tie_groups", "ties_digest"]

TieSpec = Mapping[str, Sequence[tuple[int, str]]]
_SAMPLE = 64


def ties_digest(spec: TieSpec) -> str:
    """A canonical text of the declared ties (what the plan check compares)."""
    return json.dumps(sorted((k, sorted(map(list, v))) for k, v in spec.items()))


def _local_values(p: torch.Tensor) -> torch.Tensor:
    """The values of ``p`` this rank holds: a DTensor's local shard, else ``p`` itself.

    A sharded parameter's fingerprint is its local shard's: the check compares the ranks of
    one pipeline, which sit at the same data- and tensor-parallel coordinate, so two tied
    copies sharded alike hold the same shard there (and every pipeline checks its own
    coordinate); a tie between differently sharded copies is not seen as one (their local
    values differ), nor is a coincidence in one shard taken for a tie by every pipeline.
    DTensor is looked up in ``sys.modules``: a DTensor exists only once its module is
    imported, and importing it here would cost seconds for nothing.
    """
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and isinstance(p, dtensor.DTensor):
        local: torch.Tensor = p.detach().to_local()
        return local
    return p.detach()


def fingerprint(p: torch.Tensor) -> int | None:
    """A 63-bit fingerprint of a parameter's shape and the values this rank holds of it (a
    DTensor's local shard, with its global and local shapes), or None when it cannot tell a
    tie from a coincidence (fewer than 2 local elements, or every sampled value equal)."""
    local = _local_values(p)
    n = local.numel()
    if n < 2:
        return None
    flat = local.reshape(-1)
    sample = flat[:_SAMPLE] if n <= 2 * _SAMPLE else torch.cat([flat[:_SAMPLE], flat[-_SAMPLE:]])
    sample = sample.to("cpu", copy=True)
    if bool((sample == sample[0]).all()):
        return None
    h = hashlib.blake2b(digest_size=8)
    shapes: tuple[object, ...] = (tuple(p.shape), str(p.dtype))
    if local.shape != p.shape:  # a shard: its own shape counts too
        shapes += (tuple(local.shape),)
    h.update(repr(shapes).encode())
    h.update(bytes(sample.contiguous().view(torch.uint8).tolist()))
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


def tie_groups(
    spec: TieSpec, layout: ProcessLayout, topology: Topology
) -> dict[str, tuple[Any, list[int]]]:
    """Create the gloo group of every declared tie that spans ranks. Collective: every
    process of the job calls it with the same ``spec`` (checked by the plan check) and
    builds the same groups in the same order.

    Returns:
        Tie name -> (this process's group for it, its global ranks), for the ties that
        this process holds on more than one rank.
    """
    mine: dict[str, tuple[Any, list[int]]] = {}
    for d in range(layout.dp):
        for t in range(layout.tp):
            for name in sorted(spec):
                pps = sorted({topology.rank_of(v) for v, _ in spec[name]})
                if len(pps) < 2:
                    continue
                ranks = [layout.grid[d][p][t] for p in pps]
                g = dist.new_group(ranks, backend="gloo")
                if layout.rank in ranks:
                    mine[name] = (g, ranks)
    return mine


async def reduce_ties(
    shared: Mapping[str, list[nn.Parameter]],
    groups: Mapping[str, tuple[Any, list[int]]],
    *,
    timeout: float | None,
    who: str,
    step: int,
) -> None:
    """Sum each tie's gradient over its local copies and over the ranks holding it, and
    write the sum into every copy that requires grad (a copy without a gradient counts as
    zero; a frozen copy keeps ``.grad`` None). The caller makes ``.grad`` hold this step's
    contribution only (``stash_grads``) and adds the accumulated rest back after."""
    for name in sorted(shared):
        params = shared[name]
        grads = [p.grad for p in params if p.grad is not None]
        total = torch.zeros_like(params[0]) if not grads else grads[0].detach().clone()
        for g in grads[1:]:
            total += g
        got = groups.get(name)
        if got is not None:
            group, ranks = got
            buf = total if total.device.type == "cpu" else total.cpu()
            try:
                async with asyncio.timeout(timeout):
                    await work_future(dist.all_reduce(buf, group=group, async_op=True))
            except TimeoutError:
                raise StepTimeoutError(
                    f"{who} step {step}: the gradient reduction of tied parameter {name!r}"
                    f" over global ranks {ranks} did not complete within {timeout} s (a rank"
                    " holding it failed its step or is hung)",
                    collective="the tied gradients' all-reduce",
                ) from None
            except RuntimeError as e:
                raise PeerError(
                    f"{who} step {step}: the gradient reduction of tied parameter {name!r}"
                    f" over global ranks {ranks} failed: {e}"
                ) from e
            if buf is not total:
                total.copy_(buf)
        # A frozen copy keeps .grad None, as autograd leaves it: a zero gradient would let
        # an optimizer given every parameter (weight decay, momentum) move a frozen weight.
        trainable = [p for p in params if p.requires_grad]
        for p in trainable:
            p.grad = total.clone() if len(trainable) > 1 else total


async def find_undeclared_ties(
    modules: Mapping[int, nn.Module],
    spec: TieSpec,
    layout: ProcessLayout,
    group: Any,
    *,
    timeout: float | None,
    who: str,
) -> None:
    """Raise ``PlanError`` (on every rank) when two trainable parameters of this process's
    pipeline, on different ranks, have the same fingerprint and no declared tie holds both.
    Collective over ``group`` (every rank of the job; see the design note).
    """
    rows = []
    for v in sorted(modules):
        for name, p in modules[v].named_parameters():
            if p.requires_grad:
                fp = fingerprint(p)
                if fp is not None:
                    rows.append([v, name, fp])
    doc = json.dumps(rows).encode()
    n = dist.get_world_size(group)
    try:
        async with asyncio.timeout(timeout):
            size = torch.tensor([len(doc)], dtype=torch.int64)
            sizes = [torch.empty_like(size) for _ in range(n)]
            await work_future(dist.all_gather(sizes, size, group=group, async_op=True))
            top = max(int(s.item()) for s in sizes)
            buf = torch.zeros(top, dtype=torch.uint8)
            if doc:
                buf[: len(doc)] = torch.frombuffer(bytearray(doc), dtype=torch.uint8)
            bufs = [torch.empty_like(buf) for _ in range(n)]
            await work_future(dist.all_gather(bufs, buf, group=group, async_op=True))
    except TimeoutError:
        raise StepTimeoutError(
            f"{who}: the tied-parameter check (an all-gather over {n} ranks) did not complete"
            f" within {timeout} s",
            collective="the tied-parameter check",
        ) from None
    except RuntimeError as e:
        raise PeerError(f"{who}: the tied-parameter check failed: {e}") from e
    group_ranks = dist.get_process_group_ranks(group) if group is not None else list(range(n))
    mine = set(layout.pipeline_peers().values())
    tied = {(v, pname): name for name, places in spec.items() for v, pname in places}
    seen: dict[int, tuple[int, int, str]] = {}
    clashes: list[str] = []
    lookalikes: list[str] = []
    for i, (s, b) in enumerate(zip(sizes, bufs, strict=True)):
        grank = group_ranks[i]
        if grank not in mine:
            continue
        try:
            got = json.loads(bytes(b[: int(s.item())].tolist()) or b"[]")
        except ValueError:
            raise PlanError(f"{who}: global rank {grank} sent a corrupt parameter list") from None
        for row in got:
            if not (isinstance(row, list) and len(row) == 3):
                raise PlanError(f"{who}: global rank {grank} sent a corrupt parameter list")
            v, name, fp = row
            prev = seen.get(fp)
            if prev is None:
                seen[fp] = (grank, v, name)
                continue
            pr, pv, pname = prev
            if pr == grank:
                continue
            t1, t2 = tied.get((pv, pname)), tied.get((v, name))
            if t1 is not None and t1 == t2:
                continue
            if name == pname:
                # The same name in both stage modules: the same code built both from the same
                # seed (every rank seeds alike and builds its stage), not a weight shared
                # between two different uses (wte / lm_head). Said, not refused.
                lookalikes.append(
                    f"{name!r} of virtual stages {pv} (global rank {pr}) and {v} (global rank"
                    f" {grank})"
                )
                continue
            clashes.append(
                f"{pname!r} of virtual stage {pv} on global rank {pr} and {name!r} of virtual"
                f" stage {v} on global rank {grank}"
            )
    if clashes:
        raise PlanError(
            f"{who}: parameters on different ranks have the same shape and values, as tied"
            f" weights do: {'; '.join(clashes[:4])}"
            + (f" (and {len(clashes) - 4} more)" if len(clashes) > 4 else "")
            + ". Undeclared, each rank would train its own copy and they would silently drift"
            " apart: declare the tie (TorchStageExecutor(shared={name: [(stage, param name),"
            " ...]}), or let rr.split_model find it; stages of torch's pipeline() through"
            " rr.pipelining: ScheduleReadinessFirst(..., shared=rr.from_pipe(pipe).shared))."
            " If they are only initialised alike, pass check_ties=False to"
            " DistributedStage"
        )
    if lookalikes:
        _log.warning(
            "%s: parameters of the same name on different ranks start with the same values:"
            " %s%s. Taken for stages built by the same code from the same seed (not tied);"
            " if they are one shared weight, declare the tie (TorchStageExecutor(shared=...)),"
            " else seed each rank's stage differently or pass check_ties=False",
            who,
            "; ".join(lookalikes[:4]),
            f" (and {len(lookalikes) - 4} more)" if len(lookalikes) > 4 else "",
        )
