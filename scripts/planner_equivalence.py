"""Whether the step planner still builds exactly the schedules it built before a change.

    PYTHONPATH=<old checkout> python scripts/planner_equivalence.py --dump /tmp/plans.json.gz
    PYTHONPATH=.              python scripts/planner_equivalence.py --check /tmp/plans.json.gz

A refactoring or a speed-up of the planner (``StepSchedule.build`` / ``with_durations``,
the list scheduler, the hints) must not change a single schedule. This script builds many:
P 1..16, M 1..64, chunks 1 and 2 (interleaved and V-shape), split backward, uniform / text
/ multimodal sizes with and without message latencies, each as a first ``build`` and then
``with_durations`` over a few steps of new sizes, under a byte budget (the default, factors
from tight to loose, bytes) and a count bound (default, ``memory_factor``,
``max_inflight``), for the byte-aware hints and a few fixed orders. Each result is recorded
as text: every rank's order, the bounds, budgets, reference bytes, hint name, the plan key
the plan tag hashes, each rank's position bytes and planned times; or the error's type and
message when the build is refused. ``--dump`` writes the records, ``--check`` builds them
again and names every case that differs (exit status 1).

``--quick`` takes about one case in four (a smoke run). ``--digests`` writes the digests
of about one case in 40, which ``tests/policies/test_plan_recorded.py`` holds the planner to.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import itertools
import json
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import rrfp_async as rr

SHAPES = [  # (P, M)
    (1, 1),
    (1, 5),
    (2, 1),
    (2, 2),
    (2, 7),
    (3, 3),
    (3, 10),
    (4, 4),
    (4, 8),
    (4, 16),
    (5, 12),
    (6, 24),
    (8, 8),
    (8, 13),
    (8, 32),
    (12, 36),
    (16, 16),
    (16, 64),
]
LAYOUTS = [  # (chunks, placement, split_backward)
    (1, "interleaved", False),
    (2, "interleaved", False),
    (2, "vshape", False),
    (1, "interleaved", True),
]
WORKLOADS = ["uniform", "text", "multimodal"]
BYTE_MODES: list[tuple[str, Any]] = [
    ("default", None),
    ("factor", 0.5),
    ("factor", 0.9),
    ("factor", 1.25),
    ("factor", 2.0),
    ("bytes", 3_000_000),
]
COUNT_MODES: list[tuple[str, Any]] = [
    ("default", None),
    ("memory_factor", 1.5),
    ("max_inflight", 3),
]
HINTS = ["bfw", "backward_first", "1f1b", "interleaved_1f1b", "gpipe"]
STEPS = 3  # one build, then with_durations on the sizes of two more steps


def sizes(
    plan: rr.StepPlan, workload: str, seed: int, latency: float
) -> tuple[rr.Durations, rr.ActivationBytes]:
    """One step's declared durations and activation bytes."""
    m = plan.microbatches
    wl = rr.make_workload(workload, m, virtual_stages=plan.num_virtual, seed=seed, latency=latency)
    per_stage = [1.0 + 0.25 * (v % 3) for v in range(plan.num_virtual)]
    nb = rr.ActivationBytes.from_sizes(plan, [mb.tokens for mb in wl.microbatches], per_stage)
    return wl.cost.declared(plan, wl.microbatches), nb


def record(s: rr.StepSchedule) -> dict[str, Any]:
    """Everything a rank takes from a schedule, as text."""
    p = s.plan
    planned = [s.planned(r) for r in range(p.stages)]
    return {
        "hint_name": s.hint_name,
        "plan_key": repr(
            (
                p.topology,
                p.microbatches,
                p.split_backward,
                p.ordered_weights,
                p.forward_only,
                s.hint_name,
            )
        ),
        "hint": [" ".join(map(str, s.hint[r])) for r in range(p.stages)],
        "bounds": list(s.bounds),
        "budgets": None if s.budgets is None else list(s.budgets),
        "reference_bytes": None if s.reference_bytes is None else list(s.reference_bytes),
        "memory_budget": repr(s.memory_budget),
        "memory_factor": repr(s.memory_factor),
        "max_inflight": repr(s.max_inflight),
        "source": s.source if isinstance(s.source, str) or s.source is None else "fn",
        "position_bytes": [s.position_bytes(r) for r in range(p.stages)],
        "planned": hashlib.blake2b(repr(planned).encode(), digest_size=16).hexdigest(),
    }


def attempt(fn: Any, *args: Any, **kw: Any) -> tuple[rr.StepSchedule | None, dict[str, Any]]:
    """``fn(*args, **kw)``'s schedule and its record, or None and the refusal's."""
    try:
        s = fn(*args, **kw)
    except rr.RRFPError as e:
        return None, {"error": type(e).__name__, "message": str(e)}
    return s, record(s)


def cases() -> Iterator[tuple[str, Callable[[], list[dict[str, Any]]]]]:
    """Every case: its name, and what builds its records."""
    for (p, m), (chunks, placement, split), workload in itertools.product(
        SHAPES, LAYOUTS, WORKLOADS
    ):
        if chunks > 1 and p == 1 and placement == "vshape":
            continue
        plan = rr.StepPlan(
            topology=rr.Topology(stages=p, chunks=chunks, placement=placement),  # type: ignore[arg-type]
            microbatches=m,
            split_backward=split,
        )
        big = p * m * chunks >= 512
        seed = (p * 1000 + m * 10 + chunks) * 7
        for hint in HINTS if not big else HINTS[:2]:
            for latency in (0.0, 0.002) if not big else (0.0,):
                modes = [("bytes", *x) for x in BYTE_MODES] + [("count", *x) for x in COUNT_MODES]
                for mode in modes:
                    name = f"P{p} M{m} V{chunks} {placement} split={split} {workload}"
                    name += f" hint={hint} latency={latency} {mode}"
                    yield name, partial(run_case, plan, hint, workload, seed, latency, mode)


def run_case(
    plan: rr.StepPlan,
    hint: str,
    workload: str,
    seed: int,
    latency: float,
    mode: tuple[str, str, Any],
) -> list[dict[str, Any]]:
    """The first build and each later step's ``with_durations``, as records."""
    steps = [sizes(plan, workload, seed + i, latency) for i in range(STEPS)]
    kind, arg, value = mode
    d0, b0 = steps[0]
    kw: dict[str, Any] = {}
    if kind == "bytes":
        kw["activation_bytes"] = b0
        if arg != "default":
            kw["memory_budget"] = value
    elif arg != "default":
        kw[arg] = value
    first, rec = attempt(rr.StepSchedule.build, plan, hint, durations=d0, **kw)
    out = [rec]
    if first is None:
        return out
    prev = first
    for d, nb in steps[1:]:
        if kind == "bytes":
            nxt, rec = attempt(prev.with_durations, d, nb)
        else:
            nxt, rec = attempt(prev.with_durations, d)
        out.append(rec)
        if nxt is None:
            break
        prev = nxt
    return out


def in_subset(name: str, every: int) -> bool:
    """Whether a case is one of about one in ``every`` (by a hash of its name)."""
    return int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) % every == 0


def digest(records: list[dict[str, Any]]) -> str:
    """sha256[:16] of a case's records."""
    return hashlib.sha256(json.dumps(records, sort_keys=True).encode()).hexdigest()[:16]


RECORDED_EVERY = 40
"""``--digests`` records about one case in this many (``tests/data/plans_recorded.json``)."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--dump", metavar="FILE")
    g.add_argument("--check", metavar="FILE")
    g.add_argument("--digests", metavar="FILE", help="write the digests of a subset (JSON)")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    t0 = time.perf_counter()
    if a.digests:
        picked = {n: digest(build()) for n, build in cases() if in_subset(n, RECORDED_EVERY)}
        note = (
            f"StepSchedule.build / with_durations records ({len(picked)} cases, about one in"
            f" {RECORDED_EVERY} of scripts/planner_equivalence.py's) as built by rrfp_async"
            f" {rr.__version__}: sha256[:16] of each case's records"
        )
        with open(a.digests, "w") as f:
            json.dump({"note": note, "digests": picked}, f, indent=0)
            f.write("\n")
        print(f"wrote {len(picked)} digests to {a.digests} ({time.perf_counter() - t0:.1f} s)")
        return
    every = 4 if a.quick else 1
    got = {n: build() for n, build in cases() if in_subset(n, every)}
    elapsed = time.perf_counter() - t0
    steps = sum(len(v) for v in got.values())
    errors = sum(1 for v in got.values() for r in v if "error" in r)
    print(f"{len(got)} cases, {steps} schedules or refusals ({errors} refused), {elapsed:.1f} s")
    if a.dump:
        with gzip.open(a.dump, "wt") as f:
            json.dump(got, f)
        print(f"wrote {a.dump}")
        return
    with gzip.open(a.check, "rt") as f:
        want = json.load(f)
    bad = 0
    for name, recs in want.items():
        if name not in got:
            if not a.quick:
                print(f"MISSING {name}")
                bad += 1
            continue
        if got[name] != recs:
            bad += 1
            for i, (x, y) in enumerate(zip(recs, got[name], strict=False)):
                if x != y:
                    keys = sorted(k for k in set(x) | set(y) if x.get(k) != y.get(k))
                    print(f"DIFFERS {name} step {i}: {keys}")
                    break
            else:
                print(f"DIFFERS {name}: {len(recs)} records before, {len(got[name])} now")
    extra = [k for k in got if k not in want]
    for k in extra:
        print(f"NEW {k}")
    compared = sum(1 for k in want if k in got)
    print(f"compared {compared} cases: {bad} differ, {len(extra)} not in the file")
    sys.exit(1 if bad or extra else 0)


if __name__ == "__main__":
    main()
