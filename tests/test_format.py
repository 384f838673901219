"""The code is formatted: ``ruff format --check`` passes on what ``./dev lint`` formats.

CI runs the suite, not ``./dev lint``, so the formatting is enforced here; without ruff
installed (a plain install, not the dev extra) the test is skipped.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The same folders as ./dev lint.
FOLDERS = ("rrfp_async", "rrfp_lab", "tests", "examples", "scripts")


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff is not installed")
@pytest.mark.timeout(120)
def test_ruff_format_check() -> None:
    got = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", *FOLDERS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert got.returncode == 0, (
        "files are not formatted; run `ruff format rrfp_async tests examples scripts`:\n"
        + got.stdout
        + got.stderr
    )
