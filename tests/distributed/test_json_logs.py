"""JSON logs of several processes sharing one stderr pipe stay one record per line."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]


def test_four_processes_on_one_stderr_pipe_write_whole_json_lines() -> None:
    """Before: ``configure_logging``'s writer printed a record and then its newline (two
    writes; with ``PYTHONUNBUFFERED`` two system calls), so another process's record could
    land between them: ``{...}{...}`` on one line and an empty one after."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.distributed._json_log_job", "4"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        timeout=280,
        check=False,
    )
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 0, err[-3000:]
    lines = err.splitlines()
    bad = []
    per_rank: collections.Counter[int] = collections.Counter()
    for line in lines:
        try:
            per_rank[json.loads(line)["rank"]] += 1
        except (ValueError, KeyError):
            bad.append(line)
    assert not bad, f"{len(bad)} of {len(lines)} lines are not one JSON record: {bad[:3]}"
    # Every rank logged every transition of its 4 steps, concurrently (not vacuous).
    assert set(per_rank) == {0, 1, 2, 3}
    assert min(per_rank.values()) > 2000, per_rank
