"""The GPU checks, as one prepared script: run it once whenever a GPU machine is lent.

    python scripts/gpu_check.py                # five parts on one GPU, at most 8 minutes
    python scripts/gpu_check.py --cpu-dry-run  # the parts that run on a CPU (tested in CI)
    python scripts/gpu_check.py --part race    # one part (repeatable)

Each part runs in a process of its own with a timeout; a part that runs over has every
thread's stack dumped (faulthandler) before it is stopped, and the next part runs. What
each part shows (PASS/FAIL lines, figures in ms or µs):

1. ``poison`` -- default-stream poisoning: a 2 s kernel on an unrelated stream (a comm
   stream of the device path) does not delay a task on the compute side stream
   (``ComputeWorker``): the task ends while the kernel still runs.
2. ``nccl`` -- a single-rank NCCL group with the device path's discipline: a send and a
   receive to itself issued on a comm stream after the producer's event, ``wait()``
   returns without the host waiting (the producer's 1 s kernel still runs), the default
   stream is not made to wait, the consumer's stream waits on the receive's event, and the
   bytes match. (NCCL refuses two ranks on one GPU, so a 2-rank NCCL channel needs 2 GPUs.)
3. ``race`` -- the side-stream race: two ranks on one GPU; a 50 ms kernel on the compute
   side stream writes an output into one reused buffer that is sent the moment the task
   ends (from the compute thread, as ``DistributedStage`` sends); every message must carry
   the bytes its kernel wrote (a tensor and a pytree per task).
4. ``reference`` -- losses and gradients of a 2-rank pipeline (tuple/dict boundary, 2
   steps, 1F1B hint under ``readiness_first``) against a one-process reference on the same
   device, TF32 off, within 1e-5. On the GPU the payloads travel on gloo (staged through
   pinned memory); the dry run repeats it under the NCCL-rules checker (device path).
5. ``idle`` -- GPU idle time per task: one stage, 16 microbatches, our stage against
   torch's ``Schedule1F1B`` on the same module: (step time - the same kernels back to
   back) / tasks, and the losses of both must agree.

Exit status: 0 every part passed, 1 a part failed or ran over, 2 no CUDA device (nothing
checked; ``--cpu-dry-run`` runs parts 3-5 on the CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import rrfp_async as rr
from rrfp_async._bridges import ComputeWorker

HANG_ENV = "RRFP_GPU_CHECK_HANG"
"""Set to a part's name, that part hangs (tests the timeout and the dump)."""
BUDGET_S = 480
"""The parts' timeouts together: at most 8 minutes on a GPU."""


@dataclass(frozen=True)
class Part:
    """One part: what it checks, its body, its timeout, whether it runs on a CPU."""

    title: str
    body: Callable[[bool], None]
    timeout_s: int
    on_cpu: bool


def _say(ok: bool, what: str) -> None:
    print(f"  {'PASS' if ok else 'FAIL'} {what}", flush=True)
    if not ok:
        raise AssertionError(what)


def _cycles_per_s() -> float:
    """Clock cycles per second of ``torch.cuda._sleep`` on this GPU (measured)."""
    n = 50_000_000
    a = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    b = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    torch.cuda._sleep(1000)
    a.record()
    torch.cuda._sleep(n)
    b.record()
    b.synchronize()
    return n / (a.elapsed_time(b) / 1e3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ----------------------------------------------------------------------------- 1. poison


def part_poison(cpu: bool) -> None:
    from rrfp_async._streams import Device

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    cps = _cycles_per_s()
    comm = Device(dev).new_stream("comm")  # as the device path makes them
    x = torch.randn(512, 512, device=dev)

    async def main() -> tuple[float, bool]:
        async with ComputeWorker(device=dev) as worker:
            await worker.run(lambda: x @ x)  # warm
            with torch.cuda.stream(comm):
                torch.cuda._sleep(int(2.0 * cps))  # 2 s on the comm stream
            t0 = time.perf_counter()
            await worker.run(lambda: x @ x)
            dt = time.perf_counter() - t0
            still = not comm.query()
        return dt, still

    dt, still = asyncio.run(main())
    print(f"  task on the compute side stream: {dt * 1e3:.2f} ms beside a 2 s kernel")
    _say(still and dt < 0.5, "a long kernel on another stream does not delay a task")
    torch.cuda.synchronize()


# ----------------------------------------------------------------------------- 2. nccl


def part_nccl(cpu: bool) -> None:
    import torch.distributed as dist

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(_free_port())
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=dev)
    try:
        cps = _cycles_per_s()
        producer, comm, consumer = (torch.cuda.Stream() for _ in range(3))
        n = 1 << 20
        x = torch.empty(n, device=dev)
        buf = torch.empty(n, device=dev)
        with torch.cuda.stream(producer):
            torch.cuda._sleep(int(1.0 * cps))  # the producer is slow
            x.fill_(3.0)
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ready.record()
        how = "send and receive to itself (batch_isend_irecv)"
        with torch.cuda.stream(comm):
            comm.wait_event(ready)
            t0 = time.perf_counter()
            try:
                ops = [dist.P2POp(dist.isend, x, 0), dist.P2POp(dist.irecv, buf, 0)]
                works = dist.batch_isend_irecv(ops)
            except (RuntimeError, ValueError) as e:
                print(f"  p2p to itself refused here ({e}); all_reduce on the comm stream instead")
                how = "all_reduce on the comm stream"
                buf.copy_(x)
                works = [dist.all_reduce(buf, async_op=True)]
            for w in works:
                w.wait()
            host_s = time.perf_counter() - t0
            got = torch.cuda.Event()  # type: ignore[no-untyped-call]
            got.record(comm)
        default_idle = torch.cuda.default_stream(dev).query()
        busy = not producer.query()
        print(f"  {how}: issue + wait() took {host_s * 1e3:.2f} ms on the host")
        _say(busy and host_s < 0.25, "wait() orders the comm stream, the host does not wait")
        _say(default_idle, "the default stream was not made to wait")
        with torch.cuda.stream(consumer):
            consumer.wait_event(got)
            total = buf.sum()
        torch.cuda.synchronize()
        _say(float(total) == 3.0 * n, "the consumer, after the receive's event, reads the bytes")
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- 3. race

_RACE_N = 12


def _race_rank(rank: int, world: int, device: str) -> list[str]:
    from rrfp_async.channels import P2PChannel

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    cps = _cycles_per_s() if dev.type == "cuda" else 0.0
    ch = P2PChannel(
        rank,
        global_ranks={0: 0, 1: 1},
        inbound=[0] if rank else [],
        outbound=[1] if rank == 0 else [],
        device=dev,
    )
    got: list[tuple[int, Any]] = []
    done = asyncio.Event()

    class Sink:
        def deliver(self, step: int, task: rr.Task, payload: Any, src: int) -> None:
            got.append((task.mb, payload))
            if len(got) == 2 * _RACE_N:
                done.set()

        def fail(self, exc: BaseException) -> None:
            got.append((-1, exc))
            done.set()

    ch.bind(Sink())
    out = torch.empty(256 * 1024, device=dev)  # one output buffer, reused by every task

    def task(i: int) -> None:  # on the compute thread (the side stream current on CUDA)
        if dev.type == "cuda":
            torch.cuda._sleep(int(0.05 * cps))  # the kernel before the write is slow
        else:
            time.sleep(0.05)
        out.fill_(float(i))
        ch.send(1, 0, rr.Task(1, "F", 2 * i), out)  # sent the moment the output exists
        ch.send(1, 0, rr.Task(1, "F", 2 * i + 1), (out, {"twice": out * 2}))

    async def main() -> list[str]:
        async with ch, ComputeWorker(device=dev if dev.type == "cuda" else None) as w:
            if rank == 0:
                for i in range(_RACE_N):
                    await w.run(task, i)
                return []
            await asyncio.wait_for(done.wait(), 120)
        bad = []
        for mb, p in sorted(got, key=lambda g: g[0]):
            if mb < 0:
                return [repr(p)]
            i = mb // 2
            t, twice = (p, None) if mb % 2 == 0 else (p[0], p[1]["twice"])
            if not bool((t == float(i)).all()):
                bad.append(f"message {mb}: not the bytes of task {i}")
            if twice is not None and not bool((twice == 2.0 * i).all()):
                bad.append(f"message {mb}: the pytree leaf is not 2 x {i}")
        return bad

    return asyncio.run(main())


def part_race(cpu: bool) -> None:
    device = "cpu" if cpu else "cuda:0"
    res = rr.spawn(_race_rank, 2, device, backend="gloo", timeout=150)
    bad = res[1]
    for b in bad[:5]:
        print(f"    {b}")
    _say(not bad, f"{2 * _RACE_N} messages sent from the compute thread carry their kernel's bytes")


# ----------------------------------------------------------------------------- 4. reference


class _First(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> Any:
        h = torch.tanh(self.lin(x))
        return h, {"skip": h * 0.5}


class _Second(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.lin = nn.Linear(64, 64)

    def forward(self, h: torch.Tensor, extra: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.lin(h) + extra["skip"]


def _loss(out: torch.Tensor, mb: Any) -> torch.Tensor:
    return out.float().pow(2).mean()


def _mbs(dev: torch.device, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(10 + step)
    return [torch.randn(4 + i, 64, generator=g).to(dev) for i in range(6)]


def _reference_rank(rank: int, world: int, device: str) -> dict[str, Any]:
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        torch.backends.cuda.matmul.allow_tf32 = False
    mod = (_First() if rank == 0 else _Second()).to(dev)
    layout = rr.ProcessLayout.from_world(pp=2)
    groups = rr.build_groups(layout)
    plan = rr.StepPlan(topology=rr.Topology(stages=2), microbatches=6)
    sched = rr.StepSchedule.build(plan, "1f1b")
    worker = ComputeWorker(device=dev if dev.type == "cuda" else None)
    ex = rr.TorchStageExecutor({rank: mod}, _loss if rank else None, worker=worker, rank=rank)
    losses: list[dict[int, float]] = []
    grads: list[dict[str, torch.Tensor]] = []

    async def main() -> bool:
        async with rr.DistributedStage(layout, sched, ex, groups=groups, device=dev) as stage:
            for s in range(2):
                await stage.run_step(_mbs(dev, s), step=s)
                losses.append(dict(ex.losses))
                grads.append({k: p.grad.cpu().clone() for k, p in mod.named_parameters()})
                mod.zero_grad(set_to_none=True)
            return stage.channel.on_device

    try:
        on_device = rr.run(main())
    finally:
        ex.close()
    return {"losses": losses, "grads": grads, "on_device": on_device}


def part_reference(cpu: bool) -> None:

    from rrfp_async.testing import nccl_logs
    from rrfp_async.testing import nccl_rules as rules

    dev = torch.device("cpu" if cpu else "cuda:0")
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    a, b = _First().to(dev), _Second().to(dev)
    want_losses, want_grads = [], []
    for s in range(2):
        ls = {}
        for i, mb in enumerate(_mbs(dev, s)):
            h, extra = a(mb)
            loss = _loss(b(h, extra), mb)
            ls[i] = float(loss)
            (loss / 6).backward()
        want_losses.append(ls)
        want_grads.append(
            [{k: p.grad.cpu().clone() for k, p in m.named_parameters()} for m in (a, b)]
        )
        a.zero_grad(set_to_none=True)
        b.zero_grad(set_to_none=True)
    logs = tempfile.mkdtemp(prefix="rrfp-gpu-check-rules-")
    runs = [("gloo" + (" (staged through pinned memory)" if dev.type == "cuda" else ""), {})]
    if cpu:  # the device path, under the NCCL-rules checker
        runs.append(("device path under the NCCL-rules checker", {rules.RULES_ENV: logs}))
    for name, env in runs:
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            res = rr.spawn(_reference_rank, 2, str(dev), backend="gloo", timeout=150)
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        ok = True
        for s in range(2):
            got_l = res[1]["losses"][s]
            ok &= all(abs(got_l[i] - want_losses[s][i]) <= 1e-5 for i in want_losses[s])
            for rank in (0, 1):
                for k, g in res[rank]["grads"][s].items():
                    ok &= torch.allclose(g, want_grads[s][rank][k], rtol=1e-5, atol=1e-6)
        if env:
            problems = nccl_logs.check_logs(logs)
            for p in problems[:5]:
                print(f"    {p}")
            ok &= all(r["on_device"] for r in res) and not problems
        _say(ok, f"{name}: losses and gradients of 2 steps equal a one-process run (1e-5)")


# ----------------------------------------------------------------------------- 5. idle


def part_idle(cpu: bool) -> None:
    import torch.distributed as dist

    from rrfp_lab._overhead_task import task_overhead

    dev = "cpu" if cpu else "cuda:0"
    if cpu:
        torch.set_num_threads(1)  # like a rank: the compute thread does not fight a pool
    else:
        torch.cuda.set_device(0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(_free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        r = task_overhead(dev, microbatches=16, width=1024 if not cpu else 256)
    finally:
        dist.destroy_process_group()
    print(
        f"  compute alone {r['compute_ms']:.2f} ms; step: ours {r['ours_ms']:.2f} ms,"
        f" Schedule1F1B {r['torch_ms']:.2f} ms"
    )
    ratio = r["idle_ours_us"] / max(r["idle_torch_us"], 1e-9)
    print(
        f"  idle per task: ours {r['idle_ours_us']:.1f} µs, Schedule1F1B"
        f" {r['idle_torch_us']:.1f} µs ({ratio:.2f}x); {r['handoffs_per_task']:.2f} thread"
        " hand-offs per task"
    )
    _say(r["losses_agree"], "the losses of both schedules agree")


PARTS: dict[str, Part] = {
    "poison": Part("default-stream poisoning", part_poison, 60, False),
    "nccl": Part("single-rank NCCL group, the device path's discipline", part_nccl, 75, False),
    "race": Part("the side-stream race (2 ranks, one GPU)", part_race, 105, True),
    "reference": Part("losses and gradients vs a one-process run", part_reference, 150, True),
    "idle": Part("GPU idle time per task vs torch Schedule1F1B", part_idle, 90, True),
}
assert sum(p.timeout_s for p in PARTS.values()) <= BUDGET_S


def _run_part(name: str, cpu: bool, timeout_s: float) -> None:
    """Body of a part's process: a dump of every thread if it runs over, then the part."""
    faulthandler.dump_traceback_later(max(1.0, timeout_s - 3.0), exit=True)
    if os.environ.get(HANG_ENV) == name:
        time.sleep(3600)
    PARTS[name].body(cpu)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-dry-run", action="store_true", help="run the parts a CPU can run")
    ap.add_argument("--part", action="append", choices=sorted(PARTS), help="only this part")
    ap.add_argument("--timeout", type=float, help="one timeout for every part (seconds)")
    ap.add_argument("--run-part", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run_part:
        _run_part(args.run_part, args.cpu_dry_run, args.timeout or PARTS[args.run_part].timeout_s)
        return 0
    print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}", flush=True)
    if not args.cpu_dry_run and not torch.cuda.is_available():
        print("no CUDA device: nothing checked (use --cpu-dry-run for the CPU parts)")
        return 2
    if torch.cuda.is_available() and not args.cpu_dry_run:
        print(f"{torch.cuda.device_count()} GPU(s): {torch.cuda.get_device_name(0)}")
    names = args.part or list(PARTS)
    failed = ran = 0
    t_all = time.monotonic()
    for name in names:
        part = PARTS[name]
        if args.cpu_dry_run and not part.on_cpu:
            print(f"== {name}: {part.title}: needs a GPU, skipped in the dry run")
            continue
        limit = args.timeout or part.timeout_s
        ran += 1
        print(f"== {name}: {part.title} (timeout {limit:g} s)", flush=True)
        cmd = [sys.executable, __file__, "--run-part", name, "--timeout", str(limit)]
        if args.cpu_dry_run:
            cmd.append("--cpu-dry-run")
        t0 = time.monotonic()
        try:
            done = subprocess.run(cmd, timeout=limit + 5, check=False)
            rc = done.returncode
        except subprocess.TimeoutExpired:
            rc = -1
        took = time.monotonic() - t0
        if rc == 0:
            print(f"   {name}: passed in {took:.1f} s", flush=True)
            continue
        failed += 1
        why = "ran over its timeout (stacks dumped above)" if took >= limit - 4 else f"rc {rc}"
        print(f"   {name}: FAILED after {took:.1f} s: {why}", flush=True)
    took_all = time.monotonic() - t_all
    print(f"== {ran - failed} of {ran} parts passed in {took_all:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
