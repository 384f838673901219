"""The torchrun training example runs, with torchrun and with its own spawn, and reports
what it claims: one row per policy, parsed and checked."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

import rrfp_async as rr

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_image_text.py"
SMALL = ["--pp", "2", "--microbatches", "4", "--steps", "2", "--jitter", "0.1"]

ROW = re.compile(
    r"(?P<policy>\w+) +median step +(?P<ms>\S+) ms  speedup (?P<speedup>\S+)x"
    r"  deviations +(?P<dev>\d+)  loss (?P<first>\S+) -> (?P<last>\S+)"
    r"  \(CPU \+ emulated GPU time\)"
)


def _rows(stdout: str) -> dict[str, dict[str, float]]:
    """The report's rows: ``{policy: {ms, speedup, dev, first, last}}`` (numbers; nan stays
    nan so that the finiteness checks, not the parser, reject it)."""
    rows = {}
    for line in stdout.splitlines():
        m = ROW.fullmatch(line)
        if m is not None:
            rows[m["policy"]] = {k: float(v) for k, v in m.groupdict().items() if k != "policy"}
    return rows


def _check_rows(rows: dict[str, dict[str, float]], policies: list[str]) -> None:
    assert list(rows) == policies, rows
    base = rows[policies[0]]["ms"]
    for policy, r in rows.items():
        assert all(math.isfinite(v) for v in r.values()), (policy, r)
        assert r["ms"] > 0, policy
        # the median step is printed to 0.1 ms, the speedup to 0.001
        assert r["speedup"] == pytest.approx(base / r["ms"], rel=5e-3, abs=2e-3), policy
        # an untrained model predicts about uniformly: mean cross-entropy ~ ln(vocab = 256)
        assert abs(r["first"] - math.log(256)) < 0.5, (policy, r)
    assert rows[policies[0]]["speedup"] == 1.0
    # Every policy trains the same model on the same data: the same losses (3 decimals;
    # the last step's may round apart by one unit of float noise).
    for r in rows.values():
        assert r["first"] == rows[policies[0]]["first"]
        assert r["last"] == pytest.approx(rows[policies[0]]["last"], abs=1.5e-3)


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
    _check_rows(_rows(out.stdout), ["strict", "readiness_first"])


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
    _check_rows(_rows(out.stdout), ["readiness_first"])
