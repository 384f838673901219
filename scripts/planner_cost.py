"""What planning a step costs, inline and built ahead (``rr.policies.PlanAhead``).

    PYTHONPATH=. python scripts/planner_cost.py                  # P=16 x M=64 multimodal
    PYTHONPATH=. python scripts/planner_cost.py --stages 8 --microbatches 32

Each step draws new microbatch sizes (seeded) and derives its schedule from the previous
one, as a training loop does: ``schedule.with_durations(durations, activation_bytes)``.

* ``inline``: that call's wall time, median (and largest) over steps: what a loop pays
  between two steps when it plans on the critical path. Byte budget (the default of
  ``simulate`` and the drop-ins with bytes) and count bound. Then its CPU time (the
  thread's): on a shared host, the wall time less the waits for a core.
* ``ahead``: the same build submitted to ``PlanAhead`` (a worker process, and a worker
  thread) when step N starts; step N is
  emulated by ``--step-ms`` of waiting with the interpreter's lock free (a host waiting on
  the device); the figure is how long ``result()`` then blocks: what planning costs the step.
* ``wake lateness``: while a build runs, the main thread waits 1 ms at a time; how late it
  wakes (median, largest): with a thread, the cost of sharing the interpreter's lock with
  the planner; with a process, only the result's unpickling and the host's other load.

Wall time on this machine's CPU; not a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

import rrfp_async as rr
from rrfp_async.policies import PlanAhead


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--stages", type=int, default=16)
    ap.add_argument("--microbatches", type=int, default=64)
    ap.add_argument("--chunks", type=int, default=1, help="model chunks per rank (interleaved)")
    ap.add_argument("--workload", default="multimodal")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--step-ms", type=float, default=100.0)
    a = ap.parse_args()
    p, m = a.stages, a.microbatches
    plan = rr.StepPlan(topology=rr.Topology(stages=p, chunks=a.chunks), microbatches=m)

    def sizes(seed: int) -> tuple[rr.Durations, rr.ActivationBytes]:
        wl = rr.make_workload(a.workload, m, virtual_stages=plan.num_virtual, seed=seed)
        nb = rr.ActivationBytes.from_sizes(plan, [mb.tokens for mb in wl.microbatches])
        return wl.cost.declared(plan, wl.microbatches), nb

    steps = [sizes(s) for s in range(a.steps + 1)]
    d0, b0 = steps[0]
    by_bytes = rr.StepSchedule.build(plan, "bfw", durations=d0, activation_bytes=b0)
    counted = rr.StepSchedule.build(plan, "bfw", durations=d0)
    print(
        f"P={p} x {a.chunks} chunk(s) M={m} {a.workload}, bfw hint, {a.steps} steps of new"
        f" sizes; wall ms on this CPU (switch interval {sys.getswitchinterval() * 1e3:g} ms)"
    )

    inline_b, inline_c, cpu_b, cpu_c = [], [], [], []
    for d, nb in steps[1:]:
        t, c = time.perf_counter(), time.thread_time()
        by_bytes.with_durations(d, nb)
        inline_b.append(time.perf_counter() - t)
        cpu_b.append(time.thread_time() - c)
        t, c = time.perf_counter(), time.thread_time()
        counted.with_durations(d)
        inline_c.append(time.perf_counter() - t)
        cpu_c.append(time.thread_time() - c)

    ahead: dict[str, tuple[list[float], list[float]]] = {}
    for worker in ("process", "thread"):
        blocked, late = [], []
        with PlanAhead(worker=worker) as planner:  # type: ignore[arg-type]
            planner.submit(by_bytes, d0, b0).result()  # the worker started and has it
            sched = by_bytes
            for d, nb in steps[1:]:
                pending = planner.submit(sched, d, nb)
                end = time.perf_counter() + a.step_ms / 1e3
                while (now := time.perf_counter()) < end:  # step N: 1 ms waits on the "device"
                    want = min(end, now + 1e-3)
                    threading.Event().wait(want - now)
                    if not pending.done():
                        late.append(max(0.0, time.perf_counter() - want))
                t = time.perf_counter()
                sched = pending.result()
                blocked.append(time.perf_counter() - t)
        ahead[worker] = (blocked, late)

    def ms(xs: list[float]) -> str:
        return f"{statistics.median(xs) * 1e3:.2f} ms (max {max(xs) * 1e3:.2f})"

    print(f"inline, byte budget:     {ms(inline_b)}; CPU {ms(cpu_b)}")
    print(f"inline, count bound:     {ms(inline_c)}; CPU {ms(cpu_c)}")
    for worker, (blocked, late) in ahead.items():
        print(
            f"ahead ({worker}), byte budget: {ms(blocked)} blocked after a {a.step_ms:g} ms"
            f" step; wake lateness while it built: {ms(late or [0.0])} over {len(late)} 1 ms"
            " waits"
        )


if __name__ == "__main__":
    main()
