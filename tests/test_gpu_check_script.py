"""``scripts/gpu_check.py``, the prepared GPU checks: its structure and time bounds, and the
parts that run on a CPU, so that it does not rot between the sessions that have a GPU."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (its dataclass looks its module up)
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules[spec.name]
    return mod


def test_the_parts_fit_a_short_loan_and_each_has_a_timeout() -> None:
    mod = _script()
    parts = mod.PARTS
    # The five parts the GPU loan is for, in order, the two CUDA-only ones marked so.
    assert list(parts) == ["poison", "nccl", "race", "reference", "idle"]
    assert [p.on_cpu for p in parts.values()] == [False, False, True, True, True]
    assert all(0 < p.timeout_s <= 150 for p in parts.values())
    # At most 8 minutes in all, with the margin each process gets beyond its timeout.
    assert sum(p.timeout_s + 5 for p in parts.values()) <= 8 * 60 + 5 * len(parts)
    assert mod.BUDGET_S <= 8 * 60


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_cpu_dry_run_runs_the_cpu_parts_and_they_pass() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu-dry-run"],
        capture_output=True,
        text=True,
        timeout=560,
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "poison: default-stream poisoning: needs a GPU, skipped" in out
    assert "nccl: single-rank NCCL group" in out and "needs a GPU" in out
    assert "PASS 24 messages sent from the compute thread carry their kernel's bytes" in out
    assert "PASS gloo: losses and gradients of 2 steps equal a one-process run" in out
    assert (
        "PASS device path under the NCCL-rules checker: losses and gradients of 2 steps"
        " equal a one-process run" in out
    )
    assert "idle per task: ours" in out and "PASS the losses of both schedules agree" in out
    assert "== 3 of 3 parts passed" in out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_part_that_hangs_is_stopped_at_its_timeout_with_every_stack_dumped() -> None:
    env = {**os.environ, "RRFP_GPU_CHECK_HANG": "idle"}
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu-dry-run", "--part", "idle", "--timeout", "8"],
        capture_output=True,
        text=True,
        timeout=100,
        env=env,
    )
    took = time.monotonic() - t0
    assert done.returncode == 1, done.stdout + done.stderr
    assert "idle: FAILED after" in done.stdout and "ran over its timeout" in done.stdout
    # faulthandler's dump of the hung part: its threads and the line it hangs on.
    assert "Thread 0x" in done.stderr or "Current thread 0x" in done.stderr, done.stderr
    assert "_run_part" in done.stderr
    assert took < 8 + 60  # the part's timeout, and the interpreter's start and import


@pytest.mark.timeout(60)
def test_without_cuda_it_says_so_and_exits_2() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=50)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no CUDA device: nothing checked" in done.stdout
