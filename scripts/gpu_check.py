"""The GPU checks, as one prepared script (run it when a GPU machine is lent).

    python scripts/gpu_check.py              # CUDA checks; about a minute
    python scripts/gpu_check.py --cpu-dry-run  # the pipeline part on CPU/gloo (tested in CI)

What it runs and prints (medians, µs or ms):

1. **CUDA-event awaitables** (``cuda_event_future``, modes ``thread`` and ``poll``): a short
   kernel, an event recorded behind it, then ``await`` on the event, against the same
   kernel + a blocking ``event.synchronize()`` on the calling thread.
2. **CUDA-stream compute** (``ComputeWorker(device="cuda")``): ``await worker.run(matmul)``
   on the worker's side stream against the same matmul + ``synchronize`` on the caller.
3. **A 2-rank pipeline step with CUDA compute**: two processes, a ``DistributedStage`` each,
   ``TorchStageExecutor`` on a CUDA ``ComputeWorker``, the 1F1B hint under ``strict`` and
   ``readiness_first``; NCCL when the machine has 2 or more GPUs (NCCL refuses two ranks on
   one device), else gloo carrying the CUDA tensors (staged through host memory). Step
   time and the losses, which must agree between the policies.
4. **Decision latency** (``rrfp-async bench overhead --section decision``) on this host.

Exit status: 0 every check ran, 1 one failed (its traceback is printed, the others still
run), 2 no CUDA device (nothing checked; ``--cpu-dry-run`` still runs part 3 on the CPU).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

import torch
from torch import nn

import rrfp_async as rr
from rrfp_async._bridges import ComputeWorker, cuda_event_future


def _us(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e6:8.1f} µs"


async def _event_latency(n: int) -> None:
    x = torch.zeros(1 << 16, device="cuda")
    for mode in ("thread", "poll"):
        base: list[float] = []
        awaited: list[float] = []
        for _ in range(n):
            t = time.perf_counter()
            x.add_(1.0)
            ev = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
            ev.record()
            ev.synchronize()
            base.append(time.perf_counter() - t)
            t = time.perf_counter()
            x.add_(1.0)
            ev = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
            ev.record()
            await cuda_event_future(ev, mode=mode)
            awaited.append(time.perf_counter() - t)
        ratio = statistics.median(awaited) / statistics.median(base)
        print(
            f"  cuda_event_future[{mode:6s}]: {_us(awaited)}   blocking synchronize:"
            f" {_us(base)}   ratio {ratio:.2f}x"
        )


async def _stream_compute(n: int) -> None:
    a = torch.randn(1024, 1024, device="cuda")
    b = torch.randn(1024, 1024, device="cuda")

    def mm() -> torch.Tensor:
        return a @ b

    for mode in ("thread", "poll"):
        base: list[float] = []
        awaited: list[float] = []
        async with ComputeWorker(device="cuda", event_mode=mode) as worker:
            for _ in range(n):
                t = time.perf_counter()
                mm()
                torch.cuda.current_stream().synchronize()
                base.append(time.perf_counter() - t)
                t = time.perf_counter()
                await worker.run(mm)
                awaited.append(time.perf_counter() - t)
        over = (statistics.median(awaited) - statistics.median(base)) * 1e6
        print(
            f"  ComputeWorker.run[{mode:6s}] 1024^2 matmul: {_us(awaited)}   direct +"
            f" synchronize: {_us(base)}   overhead {over:.1f} µs"
        )


class _Loss:
    def __call__(self, out: torch.Tensor, mb: Any) -> torch.Tensor:
        return out.float().pow(2).mean()


def _pipeline_rank(rank: int, world: int, device: str, steps: int) -> dict[str, Any]:
    """One rank of a 2-stage pipeline (a Linear + tanh per stage) with compute on ``device``."""
    import torch.distributed as dist

    dev = torch.device(device if device == "cpu" else f"cuda:{rank % torch.cuda.device_count()}")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    torch.manual_seed(rank)
    module = nn.Sequential(nn.Linear(512, 512), nn.Tanh()).to(dev)
    layout = rr.ProcessLayout(pp=world, rank=rank)
    groups = rr.build_groups(layout)
    plan = rr.StepPlan(topology=rr.Topology(stages=world), microbatches=8)
    sched = rr.StepSchedule.build(plan, "1f1b")
    gen = torch.Generator().manual_seed(0)
    mbs = [torch.randn(64 + 16 * i, 512, generator=gen).to(dev) for i in range(8)]
    out: dict[str, Any] = {}
    for policy in ("strict", "readiness_first"):
        worker = ComputeWorker(device=dev if dev.type == "cuda" else None)
        executor = rr.TorchStageExecutor({rank: module}, _Loss(), worker=worker, rank=rank)

        async def run(policy: str = policy, executor: rr.TorchStageExecutor = executor) -> None:
            times = []
            async with rr.DistributedStage(
                layout, sched, executor, groups=groups, policy=policy, device=dev
            ) as stage:
                for s in range(steps):
                    dist.barrier()
                    t = time.perf_counter()
                    await stage.run_step(mbs, step=s)
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - t)
                    module.zero_grad(set_to_none=True)
            out[policy] = {
                "step_ms": statistics.median(times[1:]) * 1e3,
                "losses": {k: round(v, 6) for k, v in executor.losses.items()},
            }

        try:
            rr.run(run())
        finally:
            executor.close()
    return out


def _pipeline(device: str, backend: str, steps: int) -> None:
    res = rr.spawn(_pipeline_rank, 2, device, steps, backend=backend, timeout=300)
    last = res[-1]
    for policy, r in last.items():
        print(f"  pipeline step [{device}, {backend}, {policy:15s}]: {r['step_ms']:.2f} ms")
    if last["strict"]["losses"] != last["readiness_first"]["losses"]:
        raise AssertionError(f"losses differ between policies: {last}")
    print(f"  losses equal under both policies ({len(last['strict']['losses'])} microbatches)")


def _decision() -> None:
    cmd = [sys.executable, "-m", "rrfp_async", "bench", "overhead", "--section", "decision"]
    cmd += ["--loop", "uvloop", "--policy", "readiness_first"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
    print(done.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-dry-run", action="store_true", help="run the pipeline part on CPU")
    ap.add_argument("--n", type=int, default=200, help="iterations per latency figure")
    ap.add_argument("--steps", type=int, default=5, help="pipeline steps per policy")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
    if args.cpu_dry_run:
        _pipeline("cpu", "gloo", args.steps)
        return 0
    if not torch.cuda.is_available():
        print("no CUDA device: nothing checked (use --cpu-dry-run for the CPU part)")
        return 2
    n_gpu = torch.cuda.device_count()
    print(f"{n_gpu} GPU(s): {torch.cuda.get_device_name(0)}")
    checks: list[tuple[str, Callable[[], Awaitable[None] | None]]] = [
        ("CUDA-event awaitables", lambda: _event_latency(args.n)),
        ("CUDA-stream compute", lambda: _stream_compute(args.n)),
        (
            "2-rank pipeline step",
            lambda: _pipeline("cuda", "nccl" if n_gpu >= 2 else "gloo", args.steps),
        ),
        ("decision latency", _decision),
    ]
    failed = 0
    for name, check in checks:
        print(f"== {name}")
        try:
            res = check()
            if res is not None:
                rr.run(res)  # type: ignore[arg-type]
        except Exception:
            failed += 1
            traceback.print_exc()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
