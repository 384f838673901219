"""A killed rank, a restarted job, the same result: torchrun restarts, the job resumes from
its last checkpoint (torch.distributed.checkpoint) and ends where an uninterrupted run ends.

    python examples/resume_after_kill.py --ckpt out/resume/ckpt --out out/resume/out --kill-at 3

Run so (not under torchrun: no ``RANK`` / ``WORLD_SIZE`` in the environment), the script
starts torchrun itself, as below but on a free port, and prints each step's loss when the
job is over. Under torchrun, by hand::

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node 2 --max-restarts 1 \\
        --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29531 examples/resume_after_kill.py \\
        --ckpt /tmp/resume/ckpt --out /tmp/resume/out --steps 6 --kill-at 3

``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: with torchrun's default (the workers share the
rendezvous store), a restarted gloo group reads the previous attempt's addresses and fails
to connect ("Gloo connectFullMesh failed ... Connection refused", torch 2.13 here;
pytorch/pytorch#135712); with the variable, each attempt gets a store of its own.

Two pipeline stages (gloo, CPU), SGD with momentum (optimizer state that a resume must
keep), readiness-first dispatch with ordered weight gradients (so the result is the same
bitwise whatever order the tasks ran in). After every optimizer step each rank checkpoints
its stage, its optimizer and the step number with ``torch.distributed.checkpoint`` (one
collective save; each rank's entries under ``stage{r}.``, since the stages hold different
tensors of the same names), and rank 0 then records that step as the latest. With
``--kill-at K``, rank 1 SIGKILLs itself as step K begins on the first attempt; rank 0's
step fails with a ``PeerError`` naming rank 1 (never a hang), torchrun's agent stops the
job and starts it again (``--max-restarts 1``), and both ranks load the latest checkpoint
and go on from step K. Each step's loss and the final parameters go to ``--out``: run it
with and without ``--kill-at`` and they are equal (``tests/distributed/test_resume.py``
checks it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import rrfp_async as rr

D, BATCH, M = 16, 8, 4


def batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Step ``step``'s microbatches (the same on every rank, on every attempt)."""
    g = torch.Generator().manual_seed(1000 + step)
    return [
        (torch.randn(BATCH, D, generator=g), torch.randn(BATCH, D, generator=g)) for _ in range(M)
    ]


def _write_json(path: Path, value: object) -> None:
    """Atomically: a killed process leaves the old file or the new one, never half of one."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def launch(argv: list[str], args: argparse.Namespace) -> int:
    """Not under torchrun: run this script under torchrun (the module's command, on a free
    port), then print each step's loss from ``--out``. Returns the job's exit status."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",  # torchrun
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{rr.testing.free_port()}",
        __file__,
        *argv,
    ]
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    code = subprocess.run(cmd, env=env, check=False).returncode
    if code == 0:
        losses = [json.loads((args.out / f"loss-{s}.json").read_text()) for s in range(args.steps)]
        print("loss by step: " + " ".join(f"{x:.6f}" for x in losses), flush=True)
    return code


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", type=Path, required=True, help="checkpoint directory")
    ap.add_argument("--out", type=Path, required=True, help="losses and final parameters")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--kill-at", type=int, default=-1, help="rank 1 SIGKILLs itself at this step")
    args = ap.parse_args()
    if not {"RANK", "WORLD_SIZE"} <= os.environ.keys():  # not under torchrun: start it here
        sys.exit(launch(sys.argv[1:], args))

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and attempt == 0:
        print(
            "warning: set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, or a restart fails to connect",
            flush=True,
        )
    dist.init_process_group("gloo")  # torchrun's env:// rendezvous
    rank, world = dist.get_rank(), dist.get_world_size()
    args.out.mkdir(parents=True, exist_ok=True)
    args.ckpt.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(100 + rank)
    mod = nn.Sequential(nn.Linear(D, D), nn.Tanh())
    opt = torch.optim.SGD(mod.parameters(), lr=0.05, momentum=0.9)
    start = 0
    latest = args.ckpt / "latest.json"
    if latest.exists():  # a restart: everything as it was after the latest checkpointed step
        start = json.loads(latest.read_text())["step"]
        model_sd, optim_sd = get_state_dict(mod, opt)  # optimizer state laid out to load into
        state = {f"stage{rank}": {"model": model_sd, "optim": optim_sd}}
        dcp.load(state, checkpoint_id=str(args.ckpt / f"step-{start}"))
        set_state_dict(
            mod,
            opt,
            model_state_dict=state[f"stage{rank}"]["model"],
            optim_state_dict=state[f"stage{rank}"]["optim"],
        )
        # One write per line (print writes the text and the newline apart): the ranks share
        # torchrun's stdout, and two lines must not interleave.
        line = f"rank {rank} attempt {attempt}: resumed after step {start - 1}\n"
        print(line, end="", flush=True)

    def loss_fn(out: torch.Tensor, mb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.mse_loss(out, mb[1])

    layout = rr.ProcessLayout.from_world(pp=world)
    executor = rr.TorchStageExecutor({rank: mod}, loss_fn, input_fn=lambda mb: mb[0], rank=rank)
    plan = rr.StepPlan(
        topology=rr.Topology(stages=world),
        microbatches=M,
        split_backward=True,
        ordered_weights=True,
    )
    schedule = rr.StepSchedule.build(plan, "1f1b")
    with rr.DistributedStage(layout, schedule, executor, step_timeout=60) as stage:
        for step in range(start, args.steps):
            if step == args.kill_at and attempt == 0 and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)  # a lost machine: no cleanup, no message
            stats = stage.run_step_sync(batches(step), step=step)  # the step numbers go on
            opt.step()
            opt.zero_grad()
            if stats.losses is not None:
                _write_json(args.out / f"loss-{step}.json", sum(stats.losses) / M)
            model_sd, optim_sd = get_state_dict(mod, opt)
            state = {f"stage{rank}": {"model": model_sd, "optim": optim_sd}}
            dcp.save(state, checkpoint_id=str(args.ckpt / f"step-{step + 1}"))
            dist.barrier()  # every rank's part is written before it counts as the latest
            if rank == 0:
                _write_json(latest, {"step": step + 1})
    params = {k: v.tolist() for k, v in mod.state_dict().items()}
    _write_json(args.out / f"params-rank{rank}.json", params)
    executor.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
