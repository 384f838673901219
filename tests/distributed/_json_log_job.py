"""A 4-process job whose ranks all write debug-level JSON logs to the one stderr they inherit
(run as ``python -m tests.distributed._json_log_job ROUNDS``; see test_json_logs.py)."""

from __future__ import annotations

import sys

import torch.distributed as dist

import rrfp_async as rr


def log_worker(rank: int, world: int, rounds: int) -> int:
    """Configure JSON logs at debug level on stderr (as the CLI does), wait for every rank,
    then log every transition of ``rounds`` simulated 4 x 16 steps as global rank ``rank``."""
    rr.configure_logging(format="json", level="debug")
    dist.barrier()  # all ranks write at the same time
    for i in range(rounds):
        rr.simulate(stages=4, microbatches=16, seed=i, observer=rr.LogObserver(rank=rank))
    return rank


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    assert rr.spawn(log_worker, 4, rounds, timeout=240) == [0, 1, 2, 3]


if __name__ == "__main__":
    main()
