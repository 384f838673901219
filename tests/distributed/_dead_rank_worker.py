"""Worker of ``test_dead_rank.py``, run under torchrun: a pipeline of one small stage per
process; the victim rank SIGKILLs or SIGSTOPs itself in the middle of a step.

Every rank writes, into ``--out``:

* ``rank{r}.pid``: its pid (the test cleans up a stopped process);
* ``signal.json`` (victim only): the wall time right before it signals itself;
* ``rank{r}.err``: ``{"time": ..., "type": ..., "message": ...}`` when its step fails (then
  it re-raises: the process exits non-zero by itself);
* ``rank{r}.ok``: when every step succeeded.

``--kill-or-stop OPENKILL`` SIGKILLs the victim right after it opened its stage, before step
0 (its peers fail in the plan check's all-gather); ``LEAVE`` makes the victim leave its
``async with`` block cleanly one step early (it runs ``--steps`` - 1 steps); ``HANG`` gives
the victim a policy that never returns at ``--step`` (its peers and itself time out).

With ``--kill-or-stop RAISE`` the victim's executor raises instead, and every rank goes on
after a failed step (as a training loop that zeroes its gradients would): it writes
``rank{r}.steps.json``, one record per step (``{"step": ..., "ok": ...}`` or the error's
``type``, ``message``, ``took`` seconds), then ``rank{r}.ok`` and exits 0.

    python -m torch.distributed.run --standalone --nproc-per-node 3 _dead_rank_worker.py \\
        --victim 1 --kill-or-stop STOP --step 2 --out DIR --step-timeout 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import rrfp_async as rr

MICROBATCHES = 4


class _TinyExecutor:
    """A few ms per task and a small tensor out; the victim signals itself in one task."""

    def __init__(self, victim: bool, sig: signal.Signals | None, at_step: int, out: Path) -> None:
        self.victim = victim
        self.sig = sig
        self.at_step = at_step
        self.out = out

    async def execute(self, task: rr.Task, data: Any, ctx: rr.TaskContext, /) -> Any:
        await asyncio.sleep(0.003)
        if self.victim and ctx.step == self.at_step and task.kind == "F" and task.mb == 1:
            # Mid-step: earlier microbatches are in flight, later ones not started.
            (self.out / "signal.json").write_text(json.dumps({"time": time.time()}))
            if self.sig is None:
                raise RuntimeError("boom")
            os.kill(os.getpid(), self.sig)
        return torch.full((4,), float(task.mb))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--victim", type=int, required=True)
    p.add_argument(
        "--kill-or-stop",
        choices=["KILL", "STOP", "RAISE", "OPENKILL", "LEAVE", "HANG"],
        required=True,
    )
    p.add_argument("--step", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--step-timeout", type=float, default=5.0)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out: Path = args.out
    (out / f"rank{rank}.pid").write_text(str(os.getpid()))
    layout = rr.ProcessLayout.from_world(pp=world)
    groups = rr.build_groups(layout)
    plan = rr.StepPlan(topology=rr.Topology(stages=world), microbatches=MICROBATCHES)
    schedule = rr.StepSchedule.build(plan, "1f1b")
    how = args.kill_or_stop
    victim = rank == args.victim
    sig = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP}.get(how)
    executor = _TinyExecutor(victim and how in ("KILL", "STOP", "RAISE"), sig, args.step, out)
    records: list[dict[str, Any]] = []
    steps_here = args.steps - 1 if victim and how == "LEAVE" else args.steps
    policy: Any = "readiness_first"
    if how == "HANG":  # the same policy on every rank (the plan check compares it)

        async def hang(view: rr.ReadyView) -> rr.Task:
            if view.rank == args.victim and view.step == args.step:
                (out / "signal.json").write_text(json.dumps({"time": time.time()}))
                await asyncio.Event().wait()  # a policy that never returns
            return view.ready[0]

        policy = hang

    async def steps() -> None:
        async with rr.DistributedStage(
            layout,
            schedule,
            executor,
            groups=groups,
            step_timeout=args.step_timeout,
            policy=policy,
        ) as stage:
            if victim and how == "OPENKILL":
                (out / "signal.json").write_text(json.dumps({"time": time.time()}))
                os.kill(os.getpid(), signal.SIGKILL)
            if victim and how == "LEAVE":
                (out / "signal.json").write_text(json.dumps({"time": time.time()}))
            for _ in range(steps_here):
                t0 = time.monotonic()
                try:
                    stats = await stage.run_step(list(range(MICROBATCHES)))
                    records.append({"step": stats.step, "ok": True})
                except Exception as e:
                    if how == "RAISE":  # go on with the next step
                        records.append(
                            {
                                "ok": False,
                                "type": type(e).__name__,
                                "message": str(e),
                                "took": time.monotonic() - t0,
                            }
                        )
                        continue
                    err = {"time": time.time(), "type": type(e).__name__, "message": str(e)}
                    (out / f"rank{rank}.err").write_text(json.dumps(err))
                    raise
                except BaseException as e:  # the moment the step failed: before the close
                    err = {"time": time.time(), "type": type(e).__name__, "message": str(e)}
                    (out / f"rank{rank}.err").write_text(json.dumps(err))
                    raise

    rr.run(steps())  # a failure propagates: the process exits non-zero by itself
    (out / f"rank{rank}.steps.json").write_text(json.dumps(records))
    (out / f"rank{rank}.ok").write_text("ok")
    if victim and how == "LEAVE":
        return  # its peers fail: no barrier with them
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
