"""The torchrun training example runs, with torchrun and with its own spawn."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import rrfp_async as rr

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_image_text.py"
SMALL = ["--pp", "2", "--microbatches", "4", "--steps", "2", "--jitter", "0.1"]


def test_example_under_torchrun() -> None:
    port = rr.free_port()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            str(EXAMPLE),
            *SMALL,
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "strict" in out.stdout and "readiness_first" in out.stdout
    assert "emulated GPU time" in out.stdout


def test_example_with_spawn_and_tp() -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE),
            "--spawn",
            "--tp",
            "2",
            *SMALL,
            "--policy",
            "readiness_first",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "readiness_first" in out.stdout
