"""A killed job resumes (issue 30 item 4): ``examples/resume_after_kill.py`` under torchrun
with ``--max-restarts 1``, rank 1 SIGKILLed as step 3 begins, ends with the losses and the
parameters of an uninterrupted run, bitwise.

Fresh processes by necessity: torchrun's agent is what restarts the job.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import rrfp_async as rr

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(400)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "resume_after_kill.py"
STEPS, KILL_AT = 6, 3


def _torchrun(tmp: Path, *extra: str, restarts: int) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        str(restarts),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{rr.free_port()}",
        str(EXAMPLE),
        "--ckpt",
        str(tmp / "ckpt"),
        "--out",
        str(tmp / "out"),
        "--steps",
        str(STEPS),
        *extra,
    ]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180, check=False)


def test_a_job_with_a_killed_rank_resumes_to_the_uninterrupted_result(tmp_path: Path) -> None:
    killed = _torchrun(tmp_path / "killed", "--kill-at", str(KILL_AT), restarts=1)
    out = killed.stdout + killed.stderr
    assert killed.returncode == 0, out[-4000:]
    # The survivor's step failed naming the lost rank (no hang), then both ranks resumed.
    assert "PeerError: rank 0 (global 0) lost rank 1 (global 1)" in out, out[-4000:]
    for rank in (0, 1):
        assert f"rank {rank} attempt 1: resumed after step {KILL_AT - 1}" in out, out[-4000:]
    plain = _torchrun(tmp_path / "plain", restarts=0)
    assert plain.returncode == 0, (plain.stdout + plain.stderr)[-4000:]
    assert "resumed" not in plain.stdout
    names = [f"loss-{s}.json" for s in range(STEPS)] + ["params-rank0.json", "params-rank1.json"]
    for name in names:
        got = (tmp_path / "killed" / "out" / name).read_text()
        want = (tmp_path / "plain" / "out" / name).read_text()
        assert got == want, name


def test_without_a_restart_the_killed_job_fails_and_names_the_lost_rank(tmp_path: Path) -> None:
    # The same kill with no restart allowed: the job fails (it does not hang or finish).
    got = _torchrun(tmp_path, "--kill-at", str(KILL_AT), restarts=0)
    assert got.returncode != 0
    assert "lost rank 1 (global 1)" in got.stdout + got.stderr
    assert not (tmp_path / "out" / f"loss-{STEPS - 1}.json").exists()
