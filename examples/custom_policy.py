"""A policy plug-in written as a coroutine: prefer backwards, then the hint.

Run:  python examples/custom_policy.py

A policy is any ``async def policy(view) -> Task`` returning one of ``view.ready``. Register
it by name (or ship it in a package under the entry-point group ``rrfp_async.policies``):

    [project.entry-points."rrfp_async.policies"]
    backward_eager = "mypkg.policies:backward_eager"
"""

from __future__ import annotations

import rrfp_async as rr


async def backward_eager(view: rr.ReadyView) -> rr.Task:
    """Run a ready backward if there is one (frees memory, unblocks upstream), else the
    highest-ranked ready task."""
    for task in view.ready:  # best hint rank first
        if task.kind in ("B", "I"):
            return task
    return view.ready[0]


def main() -> None:
    rr.register_policy("backward_eager", backward_eager, replace=True)
    runs = rr.compare(
        ("strict", "readiness_first", "backward_eager"),
        stages=8,
        microbatches=32,
        workload="multimodal",
        jitter=0.3,
        memory_factor=2.0,
    )
    base = runs["strict"].makespan
    for name, r in runs.items():
        print(
            f"{name:16} makespan {r.makespan:.3f} s  speedup {base / r.makespan:.3f}x"
            f"  efficiency {r.efficiency:.3f}  (simulated, virtual time)"
        )


if __name__ == "__main__":
    main()
