"""The plan digest: what every rank of a job must agree on, as a fixed-size int64 row.

Every process builds its own ``StepSchedule``; nothing forces them to be equal, and ranks
that disagree (8 microbatches on one, 6 on another; another hint or policy) used to fail late and
obscurely: one rank finished, its peer reported a closed channel. So before a stage's first
step, every rank all-gathers a fixed-size int64 *plan digest* (no pickle) over the control
group (a gloo group of every rank, ``StageGroups.control``) and compares the rows: any
difference is a ``PlanError`` on every rank, naming each differing field with the ranks on
each side ("rank 0 has microbatches=8; rank 1 has microbatches=6"). A row holds the raw
fields, strings as 32 bytes of UTF-8 (longer names are truncated for display; a hash of the
full values catches a difference there too), and two scopes:

* every rank of the job must agree on the layout, the plan (stages, chunks, placement,
  microbatches, split backward, forward-only), the declared tied parameters (a digest), the
  hint's name, the policy and ``max_message_bytes``;
* the ranks of one DP replica must also agree on the hint order and the admission bounds
  (replicas may see other data, so a cost-aware hint may order them differently);
* the ranks of one TP group must also agree on the seed of the tasks' random streams
  (``TorchStageExecutor.rng_seed``): they compute the same replicated activations, and a
  dropout mask drawn differently on one of them would make them silently differ. Other
  ranks may differ (a pipeline stays independent of the dispatch order with a seed per
  rank; DP replicas may want masks of their own). A seed not given to the executor is the
  *job's*: every such rank takes that of the lowest global rank among them
  (``adopt_default_seed``), so unseeded processes agree.

The check costs one small all-gather (BENCHMARKS.md#plan-check-cost), once per *plan*: it runs at
the stage's first step and again only when a step's schedule changes the plan's key (the
plan, the hint's name). A per-step schedule regenerated from this step's sizes
(``with_durations``) keeps the key and is not re-checked. Whether to check is decided
locally, so a rank whose schedule changes at a step where its peers' does not waits in the
all-gather alone: the step watchdog ends that wait with a ``StepTimeoutError`` that says so.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .._errors import PlanError
from ..policies import StepSchedule
from ._layout import ProcessLayout

__all__ = ["PlanDigest", "adopt_default_seed", "plan_disagreement"]

_MAGIC = 0x504C414E  # "PLAN"
_VERSION = 4
_STR_BYTES = 32
_STR_WORDS = _STR_BYTES // 8
_WORLD = (
    "pp",
    "tp",
    "dp",
    "stages",
    "chunks",
    "placement",
    "microbatches",
    "split_backward",
    "ordered_weights",
    "forward_only",
    "ties",
    "hint",
    "policy",
    "max_message_bytes",
)
_REPLICA = ("hint_order", "bounds")
_TP = ("task_rng", "rng_seed")
_STRINGS = frozenset({"placement", "hint", "policy", "bounds"})
_IDS = ("rank", "pp_rank", "tp_rank", "dp_rank", "seed_default")
_ROW_LEN = 4 + len(_IDS) + sum(_STR_WORDS if f in _STRINGS else 1 for f in _WORLD + _REPLICA + _TP)


def _h63(text: str) -> int:
    """A 63-bit digest of ``text`` (the same in every process, unlike ``hash``)."""
    h = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def _pack(text: str) -> list[int]:
    raw = text.encode()
    if len(raw) > _STR_BYTES:
        raw = raw[: _STR_BYTES - 3] + b"..."
    return list(struct.unpack(f"<{_STR_WORDS}q", raw.ljust(_STR_BYTES, b"\0")))


def _signed64(x: int) -> int:
    """``x`` modulo 2**64 as a signed int64 (what an int64 tensor holds)."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


def _unpack(words: Sequence[int]) -> str:
    raw = struct.pack(f"<{_STR_WORDS}q", *words)
    return raw.rstrip(b"\0").decode(errors="ignore")


@dataclass(frozen=True, kw_only=True)
class PlanDigest:
    """What one rank runs, as the plan check compares it (one fixed-size int64 row).

    Every rank of the job must agree on the fields in ``_WORLD`` (layout, plan, hint name,
    policy, ``max_message_bytes``); the ranks of one DP replica also on ``hint_order`` (a
    digest of every rank's hint order) and ``bounds``; the ranks of one TP group also on
    ``task_rng`` and ``rng_seed`` (the executor's seed as a signed int64). Strings travel
    as 32 bytes of UTF-8 (truncated with ``...``); ``world_hash`` and ``replica_hash``
    cover the full values.
    """

    rank: int
    pp_rank: int
    tp_rank: int
    dp_rank: int
    pp: int
    tp: int
    dp: int
    stages: int
    chunks: int
    placement: str
    microbatches: int
    split_backward: int
    ordered_weights: int
    forward_only: int
    ties: int
    hint: str
    policy: str
    max_message_bytes: int
    hint_order: int
    bounds: str
    task_rng: int
    rng_seed: int
    seed_default: int
    world_hash: int
    replica_hash: int

    @classmethod
    def of(
        cls,
        schedule: StepSchedule,
        *,
        policy: str,
        layout: ProcessLayout,
        max_message_bytes: int,
        ties: str = "",
        rng_seed: int | None = None,
        seed_default: bool = False,
    ) -> PlanDigest:
        """The digest of this rank's ``schedule`` run with ``policy`` at ``layout``, its
        executor's seed ``rng_seed`` (None: no per-task streams; ``seed_default``: not
        given, so the job's seed replaces it, see ``adopt_default_seed``)."""
        plan = schedule.plan
        topo = plan.topology
        order = ";".join(f"{r}:" + " ".join(map(str, schedule.hint[r])) for r in range(plan.stages))
        bounds = "(" + ", ".join(map(str, schedule.bounds)) + ")"
        if schedule.budgets is not None:  # a byte budget: every rank's bytes, too
            bounds += " bytes (" + ", ".join(map(str, schedule.budgets)) + ")"
        world: dict[str, int | str] = {
            "pp": layout.pp,
            "tp": layout.tp,
            "dp": layout.dp,
            "stages": topo.stages,
            "chunks": topo.chunks,
            "placement": topo.placement,
            "microbatches": plan.microbatches,
            "split_backward": int(plan.split_backward),
            "ordered_weights": int(plan.ordered_weights),
            "forward_only": int(plan.forward_only),
            "ties": _h63(ties) if ties else 0,
            "hint": schedule.hint_name,
            "policy": policy,
            "max_message_bytes": max_message_bytes,
        }
        hint_order = _h63(order)
        return cls(
            rank=layout.rank,
            pp_rank=layout.pp_rank,
            tp_rank=layout.tp_rank,
            dp_rank=layout.dp_rank,
            hint_order=hint_order,
            bounds=bounds,
            task_rng=int(rng_seed is not None),
            rng_seed=_signed64(rng_seed or 0),
            seed_default=int(seed_default and rng_seed is not None),
            world_hash=_h63(repr(sorted(world.items()))),
            replica_hash=_h63(f"{hint_order}|{bounds}"),
            **world,  # type: ignore[arg-type]
        )

    def encode(self) -> list[int]:
        """The row: ``_ROW_LEN`` int64 values."""
        row = [_MAGIC, _VERSION, self.world_hash, self.replica_hash]
        row += [getattr(self, f) for f in _IDS]
        for f in _WORLD + _REPLICA + _TP:
            v = getattr(self, f)
            row += _pack(v) if f in _STRINGS else [v]
        return row

    @classmethod
    def decode(cls, row: Sequence[int], *, rank: int) -> PlanDigest:
        """Read a row that global rank ``rank`` sent.

        Raises:
            PlanError: Not a plan digest of this version (another rrfp_async on that rank).
        """
        if len(row) != _ROW_LEN or row[0] != _MAGIC or row[1] != _VERSION:
            raise PlanError(
                f"global rank {rank} sent no plan digest of this version ({list(row[:2])}):"
                " every rank must run the same rrfp_async"
            )
        values: dict[str, Any] = {"world_hash": row[2], "replica_hash": row[3]}
        i = 4
        for f in _IDS:
            values[f] = row[i]
            i += 1
        for f in _WORLD + _REPLICA + _TP:
            if f in _STRINGS:
                values[f] = _unpack(row[i : i + _STR_WORDS])
                i += _STR_WORDS
            else:
                values[f] = row[i]
                i += 1
        return cls(**values)


def adopt_default_seed(rows: Sequence[PlanDigest]) -> tuple[list[PlanDigest], int | None]:
    """Give every row whose seed is the default (``seed_default``) the job's seed: that of
    the lowest global rank whose seed is the default too. Returns the rows (in order) and
    that seed as an unsigned 64-bit int (None when no row has a default seed).

    Every rank computes the same from the same gathered rows, so no further message is
    needed: ranks that did not seed torch (a fresh process's default seed is random) or
    seeded it each with its own number draw from one seed, as the TP check needs; a seed
    given to the executor is kept and still compared."""
    defaults = [r for r in rows if r.seed_default]
    if not defaults:
        return list(rows), None
    job = min(defaults, key=lambda r: r.rank).rng_seed
    out = [dataclasses.replace(r, rng_seed=job) if r.seed_default else r for r in rows]
    return out, job & ((1 << 64) - 1)


def _show(field: str, value: object) -> str:
    if field == "hint_order":
        return f"hint order #{value:016x}"
    if field == "bounds":
        return f"bounds={value}"
    if field == "ties":
        return "no tied parameters" if not value else f"tied parameters #{value:016x}"
    if field == "task_rng":
        return "per-task random streams" if value else "no per-task random streams (task_rng=False)"
    if field == "rng_seed":
        assert isinstance(value, int)
        return f"seed {value & ((1 << 64) - 1)}"
    return f"{field}={value!r}" if field in _STRINGS else f"{field}={value}"


def _ranks(ranks: Sequence[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]} has"
    shown = ", ".join(map(str, ranks[:6]))
    more = f" and {len(ranks) - 6} more" if len(ranks) > 6 else ""
    return f"ranks {shown}{more} have"


def _differences(rows: Sequence[PlanDigest], fields: Iterable[str]) -> list[str]:
    out = []
    for f in fields:
        sides: dict[object, list[int]] = {}
        for d in rows:
            sides.setdefault(getattr(d, f), []).append(d.rank)
        if len(sides) > 1:
            ordered = sorted(sides.items(), key=lambda kv: kv[1][0])
            out.append(f"{f}: " + "; ".join(f"{_ranks(rs)} {_show(f, v)}" for v, rs in ordered))
    return out


def plan_disagreement(rows: Sequence[PlanDigest]) -> str | None:
    """What the ranks disagree on, in words (global ranks), or None when they agree.

    Differences every rank must agree on come first and alone (a different plan orders
    the hint differently anyway); only when there are none, the hint orders and bounds of
    each DP replica are compared.
    """
    if len({d.world_hash for d in rows}) > 1:
        lines = _differences(rows, _WORLD) or [
            "a name longer than 32 bytes differs (hint or policy; see each rank's own)"
        ]
        return "; ".join(lines)
    lines = []
    replicas = sorted({d.dp_rank for d in rows})
    for dp in replicas:
        rep = [d for d in rows if d.dp_rank == dp]
        if len({d.replica_hash for d in rep}) > 1:
            where = f"in DP replica {dp}, " if len(replicas) > 1 else ""
            diff = _differences(rep, _REPLICA) or ["bounds: they differ past the 32 bytes shown"]
            lines += [where + d for d in diff]
    if lines:
        # Same plan and hint name, other orders: say what usually causes it.
        return "; ".join(lines) + (
            " (a cost-aware hint is generated from declared durations: do these ranks see the"
            " same microbatch sizes?)"
        )
    for key in sorted({(d.dp_rank, d.pp_rank) for d in rows}):
        group = [d for d in rows if (d.dp_rank, d.pp_rank) == key]
        diff = _differences(group, _TP)
        if diff:
            lines.append(
                f"in the TP group of pipeline rank {key[1]} (DP replica {key[0]}), "
                + "; ".join(diff)
            )
    if not lines:
        return None
    return "; ".join(lines) + (
        ": the ranks of a TP group compute the same replicated activations and must draw the"
        " same dropout masks; build their TorchStageExecutor with the same seed=... (the"
        " default, torch.initial_seed(), differs when each rank seeds torch with its own"
        " number)"
    )


# ---------------------------------------------------------------------- the stage
