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

The fault campaign (``tests/faults/``) adds: ``--task`` (``F1``, ``B0``: the victim's task
of ``--step`` that KILL, STOP and RAISE strike; default ``F1``); ``--trace-dir`` (each stage
writes its traces there); three modes that fail the step and exit 1 like KILL's survivors:
``MODRAISE`` (every rank runs ``nn.Linear`` modules through ``TorchStageExecutor``; the
victim's module raises in its forward of ``--task``'s microbatch), ``LOSSRAISE`` (the same,
the loss raises; the victim must hold the last stage) and ``POLICYRAISE`` (a policy that
raises on the victim at ``--step``). ``rank{r}.err`` then also holds ``step``: the step it
was running when it failed (None: before the first).

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
from torch import nn

import rrfp_async as rr

MICROBATCHES = 4


class _TinyExecutor:
    """A few ms per task and a small tensor out; the victim signals itself in one task."""

    def __init__(
        self,
        victim: bool,
        sig: signal.Signals | None,
        at_step: int,
        out: Path,
        at_task: tuple[str, int] = ("F", 1),
    ) -> None:
        self.victim = victim
        self.sig = sig
        self.at_step = at_step
        self.out = out
        self.at_task = at_task

    async def execute(self, task: rr.Task, data: Any, ctx: rr.TaskContext, /) -> Any:
        await asyncio.sleep(0.003)
        if self.victim and ctx.step == self.at_step and (task.kind, task.mb) == self.at_task:
            # Mid-step: earlier microbatches are in flight, later ones not started.
            (self.out / "signal.json").write_text(json.dumps({"time": time.time()}))
            if self.sig is None:
                raise RuntimeError("boom")
            os.kill(os.getpid(), self.sig)
        return torch.full((4,), float(task.mb))


class _Boom(RuntimeError):
    """What a faulty module or loss raises (the campaign looks for its name)."""


class _RaisingLinear(nn.Module):
    """``nn.Linear(4, 4)`` whose forward raises at one microbatch of one step. The module
    cannot see the step: it counts its forwards (one per microbatch per step; the order of
    the microbatches within a step may vary, so it strikes the ``mb``-th forward of the
    step, the count that names a task in the campaign)."""

    def __init__(self, at: int | None, out: Path) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.at = at  # the forward's index over the job, None: never
        self.calls = 0
        self.out = out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, self.calls = self.calls, self.calls + 1
        if k == self.at:
            (self.out / "signal.json").write_text(json.dumps({"time": time.time()}))
            raise _Boom("boom in the module's forward")
        return torch.as_tensor(self.lin(x))


class _RaisingLoss:
    """A squared error that raises at one call over the job (as ``_RaisingLinear``)."""

    def __init__(self, at: int | None, out: Path) -> None:
        self.at = at
        self.calls = 0
        self.out = out

    def __call__(self, y: torch.Tensor, mb: torch.Tensor) -> torch.Tensor:
        k, self.calls = self.calls, self.calls + 1
        if k == self.at:
            (self.out / "signal.json").write_text(json.dumps({"time": time.time()}))
            raise _Boom("boom in the loss")
        return (y - mb).pow(2).mean()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--victim", type=int, required=True)
    p.add_argument(
        "--kill-or-stop",
        choices=[
            "KILL",
            "STOP",
            "RAISE",
            "OPENKILL",
            "LEAVE",
            "HANG",
            "MODRAISE",
            "LOSSRAISE",
            "POLICYRAISE",
        ],
        required=True,
    )
    p.add_argument("--task", default="F1", help="the victim's task of --step: F1, B0, ...")
    p.add_argument("--trace-dir", type=Path, default=None)
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
    try:
        groups = rr.build_groups(layout)
    except Exception as e:  # a peer lost while the groups connect (OPENKILL)
        err = {"time": time.time(), "type": type(e).__name__, "message": str(e), "step": None}
        (out / f"rank{rank}.err").write_text(json.dumps(err))
        raise
    plan = rr.StepPlan(topology=rr.Topology(stages=world), microbatches=MICROBATCHES)
    schedule = rr.StepSchedule.build(plan, "1f1b")
    how = args.kill_or_stop
    victim = rank == args.victim
    sig = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP}.get(how)
    at_task = (args.task[0], int(args.task[1:]))
    executor: Any = _TinyExecutor(
        victim and how in ("KILL", "STOP", "RAISE"), sig, args.step, out, at_task
    )
    batch: list[Any] = list(range(MICROBATCHES))
    if how in ("MODRAISE", "LOSSRAISE"):  # real modules, on every rank (one data flow)
        at = args.step * MICROBATCHES + at_task[1] if victim else None
        torch.manual_seed(rank)
        module = _RaisingLinear(at if how == "MODRAISE" else None, out)
        last = rank == world - 1
        loss = _RaisingLoss(at if how == "LOSSRAISE" else None, out) if last else None
        # The process's first backward pays torch's one-time costs (~60 ms of a core; over
        # 2 s seen on a 2-core machine under load, which made step 0 outlast the 5 s
        # watchdog before any fault struck): paid here, before the job's first step.
        module.lin(torch.ones(1, 4)).sum().backward()  # (not forward: it counts its calls)
        module.zero_grad(set_to_none=True)
        executor = rr.TorchStageExecutor({rank: module}, loss, rank=rank)
        g = torch.Generator().manual_seed(0)
        batch = [torch.randn(3, 4, generator=g) for _ in range(MICROBATCHES)]
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
    if how == "POLICYRAISE":

        async def raising(view: rr.ReadyView) -> rr.Task:
            if view.rank == args.victim and view.step == args.step:
                (out / "signal.json").write_text(json.dumps({"time": time.time()}))
                raise _Boom("boom in the policy")
            return view.ready[0]

        policy = raising
    current: list[int | None] = [None]  # the step being run, for the error record

    async def steps() -> None:
        async with rr.DistributedStage(
            layout,
            schedule,
            executor,
            groups=groups,
            step_timeout=args.step_timeout,
            policy=policy,
            trace_dir=args.trace_dir,
        ) as stage:
            if victim and how == "OPENKILL":
                (out / "signal.json").write_text(json.dumps({"time": time.time()}))
                os.kill(os.getpid(), signal.SIGKILL)
            if victim and how == "LEAVE":
                (out / "signal.json").write_text(json.dumps({"time": time.time()}))
            for k in range(steps_here):
                current[0] = k
                t0 = time.monotonic()
                try:
                    stats = await stage.run_step(batch)
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
                    _record(e)
                    raise
                except BaseException as e:  # the moment the step failed: before the close
                    _record(e)
                    raise

    def _record(e: BaseException) -> None:
        err = {
            "time": time.time(),
            "type": type(e).__name__,
            "message": str(e),
            "step": current[0],
        }
        (out / f"rank{rank}.err").write_text(json.dumps(err))

    async def checked() -> None:
        # A failure outside run_step (opening the stage: the plan check) is recorded too.
        try:
            await steps()
        except BaseException as e:
            if not (out / f"rank{rank}.err").exists():
                _record(e)
            raise

    rr.run(checked())  # a failure propagates: the process exits non-zero by itself
    (out / f"rank{rank}.steps.json").write_text(json.dumps(records))
    (out / f"rank{rank}.ok").write_text("ok")
    if victim and how == "LEAVE":
        return  # its peers fail: no barrier with them
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
