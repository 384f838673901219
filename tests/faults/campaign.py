"""A randomized fault campaign: many short torchrun jobs, one fault each, invariants on all.

Each run draws, from ``random.Random(seed)`` alone (so ``--replay SEED`` repeats it), a
pipeline of 3 or 4 gloo ranks on 127.0.0.1 (``tests/distributed/_dead_rank_worker.py``, one
small stage per rank, 4 microbatches, 1F1B, ``step_timeout`` 5 s), the channel's receive
mode, and a fault: its kind (:data:`KINDS`), the victim rank, the step, and the task where
the kind strikes one. Then it checks, on every run:

* ``hang``: every rank that should fail by itself (every survivor, and the victim when it
  raises or hangs) wrote its error within ``step_timeout`` + :data:`MARGIN` of the fault;
* ``typed``: a survivor's error is one of the library's (``rrfp_async.errors``);
* ``names``: its first line names the victim, ``rank V (global V)`` (or ``rank V (global V;``
  followed by what was missing from it);
* ``kind``: its first line says what happened to the victim where it can know it
  (:data:`KIND_WORDS`: lost, left, timed out, the raised error's type, the policy);
* ``exit``: it exited by itself with status 1 (a -6 is an abort at exit); the victim with
  what its fault implies (-9 killed, 0 left, 1 raised);
* ``trace``: a rank that failed in step k wrote ``failed-rank{r}.json`` whose
  ``otherData.rrfp.failures`` records (r, k), and kept step k - 1 in ``rank{r}.json``.

Why a campaign: the fault tests each pin one case (``tests/distributed/test_dead_rank.py``,
``tests/distributed/test_blame.py``); the combinations (a kill two hops away in a 4-rank
pipeline during a backward, a loss that raises on the first microbatch of step 0) are many,
and the bugs in this area were found in such corners.

    python -m tests.faults.campaign --runs 40 --seed 1
    python -m tests.faults.campaign --replay 1000017   # one run, by the seed it printed
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import rrfp_async.errors as rr_errors
from rrfp_async.channels._p2p import IO_ENV
from tests.distributed import _torchrun

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "distributed" / "_dead_rank_worker.py"
STEP_TIMEOUT = 5.0
STEPS = 5
MICROBATCHES = 4  # the worker's
MARGIN = 15.0
"""Seconds past ``step_timeout`` a rank may take to fail after the fault (2 shared cores)."""
START_ALLOWANCE = 90.0
"""Seconds torchrun and the ranks may take to start (importing torch on 2 cores)."""

KINDS = ("KILL", "STOP", "OPENKILL", "LEAVE", "HANG", "MODRAISE", "LOSSRAISE", "POLICYRAISE")
"""The worker's fault modes the campaign draws from (uniformly)."""

KIND_WORDS: dict[str, tuple[str, ...]] = {
    "KILL": ("lost",),
    "OPENKILL": ("lost",),
    "STOP": ("timed out",),
    "LEAVE": ("left",),
    "HANG": ("policy",),
    "MODRAISE": ("_Boom",),
    "LOSSRAISE": ("_Boom",),
    "POLICYRAISE": ("policy", "Policy"),
}
"""What a survivor's first line must say of the fault (any one of the words)."""

VICTIM_FAILS = {"HANG", "MODRAISE", "LOSSRAISE", "POLICYRAISE"}
"""Kinds whose victim fails by itself too (and writes its error)."""

VICTIM_EXIT = {"KILL": -9, "OPENKILL": -9, "LEAVE": 0, "HANG": 1}
VICTIM_EXIT.update({k: 1 for k in ("MODRAISE", "LOSSRAISE", "POLICYRAISE")})

LIBRARY_ERRORS = {n for n in rr_errors.__all__ if isinstance(getattr(rr_errors, n), type)} | {
    "VirtualTimeLimit",
    "VirtualClockStall",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fault:
    """One run's draw: everything the job depends on."""

    seed: int
    world: int
    kind: str
    victim: int
    step: int
    task: str  # "F1", "B0": the victim's task that KILL, STOP, MODRAISE, LOSSRAISE strike
    io: str  # the channel's receive mode

    @classmethod
    def draw(cls, seed: int) -> Fault:
        """The fault of run ``seed``: a pure function of it."""
        rng = random.Random(seed)
        world = rng.choice((3, 4))
        kind = rng.choice(KINDS)
        victim = world - 1 if kind == "LOSSRAISE" else rng.randrange(world)
        step = 0 if kind == "OPENKILL" else rng.randrange(1 if kind == "LEAVE" else 0, STEPS - 1)
        fb = rng.choice("FB") if kind in ("KILL", "STOP") else "F"
        task = f"{fb}{rng.randrange(MICROBATCHES)}"
        io = rng.choice(("per_edge", "shared"))
        return cls(seed=seed, world=world, kind=kind, victim=victim, step=step, task=task, io=io)

    def __str__(self) -> str:
        where = "at open" if self.kind == "OPENKILL" else f"step {self.step}"
        if self.kind in ("KILL", "STOP", "MODRAISE", "LOSSRAISE"):
            where += f" task {self.task}"
        return f"{self.kind} rank {self.victim} of {self.world}, {where} ({self.io})"

    def fails_by_itself(self) -> list[int]:
        """The ranks that must fail and exit by themselves."""
        return [r for r in range(self.world) if r != self.victim or self.kind in VICTIM_FAILS]

    def ends(self) -> list[int]:
        """The ranks whose process must end (all but a stopped victim): the run waits for
        them, a leaving victim's exit too (it exits by itself, after its peers may have)."""
        return [r for r in range(self.world) if r != self.victim or self.kind != "STOP"]


@dataclasses.dataclass(kw_only=True)
class Outcome:
    """What one run did and which invariants it broke (``violations``: name -> detail)."""

    fault: Fault
    errors: dict[int, dict[str, Any]]
    exits: dict[int, int]
    seconds: float
    violations: dict[str, str]
    log_tail: str


def run_one(fault: Fault, workdir: Path) -> Outcome:
    """Launch the job of ``fault`` under torchrun, wait for it, check the invariants."""
    out, traces = workdir / "out", workdir / "traces"
    out.mkdir(parents=True)
    log_path = workdir / "torchrun.log"
    steps = fault.step + 1 if fault.kind == "LEAVE" else STEPS
    args = [str(WORKER), "--victim", str(fault.victim), "--kill-or-stop", fault.kind]
    args += ["--task", fault.task, "--step", str(fault.step), "--steps", str(steps)]
    args += ["--out", str(out), "--step-timeout", str(STEP_TIMEOUT), "--trace-dir", str(traces)]
    expected = fault.ends()
    t0 = time.monotonic()

    def done(pids: dict[int, int]) -> bool:
        # Each writes its error before it exits: all exited is the end. (A killed victim
        # may die before it wrote its pid: it is not waited for then.)
        killed = fault.kind in ("KILL", "OPENKILL")
        return all(
            (r in pids and _torchrun.state(pids[r]) == "Z") or (killed and r == fault.victim)
            for r in expected
        )

    exits = _torchrun.run_job(
        workdir,
        args,
        world=fault.world,
        out=out,
        env=_torchrun.worker_env(**{IO_ENV: fault.io}),
        done=done,
        seconds=START_ALLOWANCE + STEPS * 2 + STEP_TIMEOUT + MARGIN,
        settle=0.3,  # a killed or leaving victim's exit
    )
    seconds = time.monotonic() - t0
    errors = {
        r: json.loads((out / f"rank{r}.err").read_text())
        for r in range(fault.world)
        if (out / f"rank{r}.err").exists()
    }
    sig = out / "signal.json"
    t_fault = json.loads(sig.read_text())["time"] if sig.exists() else None
    violations = check(fault, errors, exits, t_fault, traces)
    tail = log_path.read_text()[-3000:]
    return Outcome(
        fault=fault,
        errors=errors,
        exits=exits,
        seconds=seconds,
        violations=violations,
        log_tail=tail,
    )


def check(
    fault: Fault,
    errors: dict[int, dict[str, Any]],
    exits: dict[int, int],
    t_fault: float | None,
    traces: Path,
) -> dict[str, str]:
    """The invariants of one run (see the module's docstring): name -> what broke."""
    bad: dict[str, list[str]] = {}

    def fail(name: str, what: str) -> None:
        bad.setdefault(name, []).append(what)

    v = fault.victim
    if t_fault is None:
        fail("fault", "the victim never struck (no signal.json)")
    for r in fault.fails_by_itself():
        err = errors.get(r)
        if err is None:
            fail("hang", f"rank {r} wrote no error")
            continue
        if t_fault is not None and err["time"] - t_fault > STEP_TIMEOUT + MARGIN:
            fail("hang", f"rank {r} failed {err['time'] - t_fault:.1f} s after the fault")
        if exits.get(r) != (VICTIM_EXIT[fault.kind] if r == v else 1):
            fail("exit", f"rank {r} exit {exits.get(r, 'none (still running)')}")
        first = err["message"].splitlines()[0] if err["message"] else ""
        if r != v:
            if err["type"] not in LIBRARY_ERRORS:
                fail("typed", f"rank {r} raised {err['type']}: {first}")
            # "rank 1 (global 1)", or "rank 1 (global 1; 3 of its 4 messages ... missing)"
            if not re.search(rf"\brank {v} \(global {v}[);]", first):
                fail("names", f"rank {r}: {err['type']}: {first}")
            if not any(w in first for w in KIND_WORDS[fault.kind]):
                fail("kind", f"rank {r}: {err['type']}: {first}")
        step = err.get("step")
        if step is not None:
            _check_traces(r, step, traces, fail)
    victim_exits = fault.kind in VICTIM_EXIT and fault.kind not in VICTIM_FAILS
    if victim_exits and exits.get(v) != VICTIM_EXIT[fault.kind]:
        fail("exit", f"victim rank {v} exit {exits.get(v, 'none')}")
    return {k: "; ".join(w) for k, w in bad.items()}


def _check_traces(r: int, step: int, traces: Path, fail: Callable[[str, str], None]) -> None:
    failed = traces / f"failed-rank{r}.json"
    if not failed.exists():
        fail("trace", f"rank {r}: no failed-rank{r}.json for step {step}")
    else:
        meta = json.loads(failed.read_text())["otherData"]["rrfp"]
        marks = [tuple(f[:2]) for f in meta.get("failures", [])]
        if (r, step) not in marks:
            fail("trace", f"rank {r}: failed-rank{r}.json's failures {marks}, not ({r}, {step})")
    if step > 0:
        good = traces / f"rank{r}.json"
        if not good.exists():
            fail("trace", f"rank {r}: no rank{r}.json (step {step - 1} ended well)")
            return
        evs = json.loads(good.read_text())["traceEvents"]
        steps = {e["args"]["step"] for e in evs if e["ph"] == "X"}
        if steps != {step - 1}:
            fail("trace", f"rank {r}: rank{r}.json holds steps {sorted(steps)}, not {step - 1}")


def line(o: Outcome) -> str:
    """One run's line: its seed, fault, time, and the invariants it broke."""
    verdict = "ok" if not o.violations else "VIOLATED " + ", ".join(sorted(o.violations))
    return f"seed {o.fault.seed}: {o.fault} -> {verdict} ({o.seconds:.1f} s)"


def campaign(
    seeds: list[int], jobs: int = 1, echo: bool = True, show_log: bool = False
) -> list[Outcome]:
    """Run one job per seed (``jobs`` at once); print a line per run when ``echo`` (and the
    end of torchrun's log of a run that broke an invariant, when ``show_log``)."""

    def one(seed: int) -> Outcome:
        keep = os.environ.get("RRFP_CAMPAIGN_KEEP")  # debugging: keep each run's directory
        if keep:
            d = tempfile.mkdtemp(prefix=f"rrfp-fault-{seed}-", dir=keep)
            o = run_one(Fault.draw(seed), Path(d))
        else:
            with tempfile.TemporaryDirectory(prefix=f"rrfp-fault-{seed}-") as d:
                o = run_one(Fault.draw(seed), Path(d))
                failed_dir = os.environ.get("RRFP_CAMPAIGN_KEEP_FAILED")
                if failed_dir and o.violations:  # (a core dump, under ulimit -c, too)
                    shutil.copytree(d, Path(failed_dir) / f"seed-{seed}", dirs_exist_ok=True)
        if echo:
            print(line(o), flush=True)
            for name, what in sorted(o.violations.items()):
                print(f"    {name}: {what}", flush=True)
            if o.violations:
                for r, e in sorted(o.errors.items()):
                    print(f"    rank {r} said: {e['type']}: {e['message'][:400]!r}", flush=True)
                print(f"    exits: {o.exits}", flush=True)
                if show_log:
                    print("    torchrun's log, its end:", flush=True)
                    print("      " + o.log_tail.replace("\n", "\n      "), flush=True)
        return o

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(one, seeds))


def summary(outcomes: list[Outcome]) -> str:
    """Runs, faults by kind, invariants held or violated (with the violating seeds)."""
    kinds = Counter(o.fault.kind for o in outcomes)
    broken = [o for o in outcomes if o.violations]
    by_inv: dict[str, list[int]] = {}
    for o in broken:
        for name in o.violations:
            by_inv.setdefault(name, []).append(o.fault.seed)
    lines = [
        f"runs: {len(outcomes)}, held: {len(outcomes) - len(broken)}, violated: {len(broken)}",
        "faults by kind: " + ", ".join(f"{k} {kinds[k]}" for k in KINDS if kinds[k]),
    ]
    for name, seeds in sorted(by_inv.items()):
        lines.append(f"violated {name}: seeds {seeds} (replay: --replay SEED)")
    return "\n".join(lines)


def seeds_of(seed: int, runs: int, first: int = 0) -> list[int]:
    """The runs' seeds: each run's own, so a run replays alone (``first``: the campaign's
    runs from that one on, to split one campaign over several processes or machines)."""
    return [seed * 1_000_000 + k for k in range(first, first + runs)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--runs", type=int, default=12)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--jobs", type=int, default=1, help="runs at once (default 1)")
    p.add_argument("--replay", type=int, default=None, help="run this one seed only")
    p.add_argument(
        "--first", type=int, default=0, help="start at this run of the campaign (default 0)"
    )
    p.add_argument(
        "--show-log", action="store_true", help="print the end of a violating run's torchrun log"
    )
    args = p.parse_args(argv)
    seeds = [args.replay] if args.replay is not None else seeds_of(args.seed, args.runs, args.first)
    outcomes = campaign(seeds, jobs=args.jobs, show_log=args.show_log)
    print(summary(outcomes))
    return 1 if any(o.violations for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
