"""How fast can a step get at equal bytes at all? A slow, offline search against the planner.

    PYTHONPATH=. python scripts/planner_bound.py                   # P=8 x M=32 multimodal
    PYTHONPATH=. python scripts/planner_bound.py --stages 4 --iters 4000 --seeds 5

For each seed, the same step (sizes and realized noise fixed by the seed, jitter 0.3) as
``simulate(stages=P, microbatches=M, workload=..., seed=seed)``; each rank's byte budget is
what strict 1F1B holds on that step's microbatches (the default, never exceeded). Columns,
speedup over strict 1F1B:

* ``planned: default`` and ``search``: on the declared durations (what the planner sees),
  the default hint's and the search's orders run strictly, over strict 1F1B's;
* then on the realized durations (the simulator, seeded noise):
* ``default``: ``simulate()`` with no memory argument (the planner's hint, readiness-first).
* ``search``: simulated annealing over the per-rank task *orders* themselves (not priority
  keys: a move takes one task of one rank to another place in that rank's order), started
  from the better of the default hint and 1F1B, keeping every order within the rank's byte
  budget and the ranks free of waiting cycles, minimising the makespan of the orders run
  strictly on the *declared* durations: what a planner that knows what the default planner
  knows could reach with far more time. Run readiness-first (``rf``) and strictly.
* ``oracle``: the same search on the *realized* durations (a planner that knew the noise in
  advance), run strictly: a ceiling no planner can pass on this step's orders by much.
* ``no-memory LB``: strict 1F1B over ``lower_bound`` on the realized durations (any order,
  any memory): the ceiling without the byte budget.

Simulated time, not a GPU. Slow by design (seconds per seed).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from collections.abc import Sequence

from rrfp_async import ActivationBytes, Durations, StepPlan, Task, Topology
from rrfp_async._memory import weighted_peak
from rrfp_async._tasks import TaskGraph
from rrfp_async._workloads import make_workload
from rrfp_async.policies._hints import _remaining_work
from rrfp_async.policies._listsched import list_schedule_keys
from rrfp_async.policies._schedule import reference_orders
from rrfp_async.sim import simulate


def strict_makespan(plan: StepPlan, orders: Sequence[Sequence[int]], dur: Sequence[float]) -> float:
    """Makespan of numbered per-rank orders run strictly; inf when the ranks wait in a cycle."""
    g = plan.graph
    producers = g.producers
    p = plan.stages
    n = len(g.tasks)
    end = [0.0] * n
    done = bytearray(n)
    heads = [0] * p
    free = [0.0] * p
    waiting: dict[int, list[int]] = {}
    todo = list(range(p))
    ran = 0
    while todo:
        r = todo.pop()
        order = orders[r]
        h = heads[r]
        fr = free[r]
        while h < len(order):
            t = order[h]
            ready = fr
            for pr in producers[t]:
                if not done[pr]:
                    waiting.setdefault(pr, []).append(r)
                    break
                if end[pr] > ready:
                    ready = end[pr]
            else:
                fr = end[t] = ready + dur[t]
                done[t] = 1
                ran += 1
                h += 1
                w = waiting.pop(t, None)
                if w is not None:
                    todo.extend(w)
                continue
            break
        heads[r] = h
        free[r] = fr
    return max(free) if ran == n else math.inf


def anneal_keys(
    plan: StepPlan,
    starts: Sequence[Sequence[float]],
    durations: Durations,
    nbytes: ActivationBytes,
    budgets: Sequence[int],
    iters: int,
    rng: random.Random,
) -> tuple[list[list[int]], float]:
    """Simulated annealing over the list schedule's priority keys (every hint it yields is
    within the budgets and free of waiting cycles by construction); the objective is the
    makespan of the resulting orders run strictly on ``durations``."""
    g = plan.graph
    p, m = plan.stages, plan.microbatches
    nf = g.num_forward
    dur, _ = durations.by_number(plan)

    def evaluate(keys: Sequence[float]) -> tuple[list[list[int]], float]:
        h = list_schedule_keys(plan, durations, keys, budgets, nbytes)
        orders = [[g.index[t] for t in h[r]] for r in range(p)]
        return orders, strict_makespan(plan, orders, dur)

    best_o: list[list[int]] = []
    best = math.inf
    for start in starts:
        keys = list(start)
        orders, cur = evaluate(keys)
        if cur < best:
            best, best_o = cur, orders
        spread = (max(keys) - min(keys)) or 1.0
        t0, t1 = 0.01 * cur, 0.0002 * cur
        for it in range(iters):
            temp = t0 * (t1 / t0) ** (it / max(1, iters - 1))
            new_keys = list(keys)
            move = rng.randrange(4)
            if move == 0:  # one task
                t = rng.randrange(len(keys))
                new_keys[t] += rng.gauss(0.0, 0.1 * spread)
            elif move in (1, 2):  # every forward (1) or backward (2) of one microbatch
                i = rng.randrange(m)
                dx = rng.gauss(0.0, 0.1 * spread)
                lo = 0 if move == 1 else nf
                for t in range(lo + i, lo + nf, m):
                    new_keys[t] += dx
            else:  # two microbatches trade places (their forwards' and backwards' keys)
                i, j = rng.randrange(m), rng.randrange(m)
                for t in range(0, len(keys) // m * m, m):
                    new_keys[t + i], new_keys[t + j] = new_keys[t + j], new_keys[t + i]
            orders, new = evaluate(new_keys)
            if new <= cur or rng.random() < math.exp((cur - new) / temp):
                keys, cur = new_keys, new
                if cur < best:
                    best, best_o = cur, orders
    return best_o, best


def as_hint(g: TaskGraph, orders: list[list[int]]) -> dict[int, list[Task]]:
    return {r: [g.tasks[t] for t in o] for r, o in enumerate(orders)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--stages", type=int, default=8)
    ap.add_argument("--microbatches", type=int)
    ap.add_argument("--workload", default="multimodal")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--jitter", type=float, default=0.3)
    ap.add_argument("--iters", type=int, default=3000, help="moves per start, declared search")
    ap.add_argument(
        "--oracle-iters", type=int, help="moves per start, oracle (default: --iters; 0: none)"
    )
    a = ap.parse_args()
    p = a.stages
    oracle_iters = a.iters if a.oracle_iters is None else a.oracle_iters
    m = a.microbatches or 4 * p
    print(
        f"P={p} M={m} {a.workload}, jitter {a.jitter}, budget = strict 1F1B's bytes per rank;"
        f" simulated; speedup over strict 1F1B; search: {a.iters} moves from each of 2"
        f" starts, oracle {oracle_iters}"
    )
    cols: dict[str, list[float]] = {
        k: []
        for k in (
            "planned: default",
            "search",
            "default",
            "search rf",
            "search strict",
            "oracle",
            "no-memory LB",
        )
    }
    plan = StepPlan(topology=Topology(stages=p), microbatches=m)
    g = plan.graph
    for seed in range(a.seeds):
        t_start = time.perf_counter()
        kw = {"stages": p, "microbatches": m, "workload": a.workload, "jitter": a.jitter}
        base = simulate(hint="1f1b", policy="strict", seed=seed, **kw)
        dflt = simulate(seed=seed, **kw)
        wl = make_workload(a.workload, m, virtual_stages=plan.num_virtual, seed=seed)
        tokens = [mb.tokens for mb in wl.microbatches]
        nbytes = ActivationBytes.from_sizes(plan, tokens)
        ref = reference_orders(plan)
        budgets = [weighted_peak(ref[r], nbytes) for r in range(p)]
        assert dflt.schedule is not None and dflt.schedule.budgets == tuple(budgets)
        declared: Durations = dflt.schedule.declared  # type: ignore[assignment]
        realized = wl.cost.declared(plan, wl.microbatches).perturbed(seed=seed, jitter=a.jitter)
        work = _remaining_work(plan, declared)
        big = 2 * max(work)
        # The default planner's two key sets (most remaining work first; ready backwards
        # first): the search starts from each.
        starts = [
            [-w for w in work],
            [
                -w + (0.0 if t.kind in ("B", "I") else big)
                for w, t in zip(work, g.tasks, strict=True)
            ],
        ]
        rng = random.Random(seed)

        ref_o = [[g.index[t] for t in ref[r]] for r in range(p)]
        # The realized durations are the simulator's: strict 1F1B on them is its makespan.
        assert math.isclose(
            strict_makespan(plan, ref_o, realized.by_number(plan)[0]), base.makespan
        )
        found_o = anneal_keys(plan, starts, declared, nbytes, budgets, a.iters, rng)[0]
        found = as_hint(g, found_o)
        d_dur = declared.by_number(plan)[0]
        planned_1f1b = strict_makespan(plan, ref_o, d_dur)
        dflt_o = [[g.index[t] for t in dflt.schedule.hint[r]] for r in range(p)]
        oracle = found
        if oracle_iters:
            oracle = as_hint(
                g, anneal_keys(plan, starts, realized, nbytes, budgets, oracle_iters, rng)[0]
            )
        budget_kw = {"memory_budget": budgets}
        s_rf = simulate(seed=seed, hint=found, **budget_kw, **kw)  # type: ignore[arg-type]
        s_st = simulate(seed=seed, hint=found, policy="strict", **budget_kw, **kw)  # type: ignore[arg-type]
        o_st = simulate(seed=seed, hint=oracle, policy="strict", **budget_kw, **kw)  # type: ignore[arg-type]
        for res in (s_rf, s_st, o_st):
            assert max(res.memory_ratio, 0) <= 1.0 + 1e-9, res.memory_ratio
        row = {
            "planned: default": planned_1f1b / strict_makespan(plan, dflt_o, d_dur),
            "search": planned_1f1b / strict_makespan(plan, found_o, d_dur),
            "default": base.makespan / dflt.makespan,
            "search rf": base.makespan / s_rf.makespan,
            "search strict": base.makespan / s_st.makespan,
            "oracle": base.makespan / o_st.makespan if oracle_iters else math.nan,
            "no-memory LB": base.makespan / base.lower_bound,
        }
        for k, v in row.items():
            cols[k].append(v)
        print(
            f"seed {seed}: "
            + "  ".join(f"{k} {v:.3f}" for k, v in row.items())
            + f"  ({time.perf_counter() - t_start:.0f} s)",
            flush=True,
        )
    print(
        "median (min): "
        + "  ".join(f"{k} {statistics.median(v):.3f} ({min(v):.3f})" for k, v in cols.items())
    )


if __name__ == "__main__":
    main()
