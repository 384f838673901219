"""``scripts/gpu_check.py``, the prepared GPU checks: its CPU part runs here so it does not
rot between the sessions that have a GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_cpu_dry_run_runs_a_two_rank_pipeline_under_both_policies() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu-dry-run", "--steps", "3"],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "pipeline step [cpu, gloo, strict" in done.stdout
    assert "pipeline step [cpu, gloo, readiness_first" in done.stdout
    assert "losses equal under both policies (8 microbatches)" in done.stdout


@pytest.mark.timeout(60)
def test_without_cuda_it_says_so_and_exits_2() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=50)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no CUDA device: nothing checked" in done.stdout
