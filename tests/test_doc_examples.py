"""The docs' complete Python examples run as written and show what their text says.

Each page's runnable blocks (```` ```python ```` blocks without ``...`` placeholders) run
in order in one fresh interpreter per page (a page's later blocks use its earlier names),
in a temporary directory (an example may write a file), and a few lines appended to the
last block print what the text claims, which the test then checks. Fragments (``...``,
``await`` outside a coroutine, a user's ``loader``) are left to ``tests/test_docs.py``,
which checks every name they use exists.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)

pytestmark = pytest.mark.timeout(180)


def _blocks(page: str) -> list[str]:
    text = (ROOT / page).read_text(encoding="utf-8")
    return [b for b in _BLOCK.findall(text) if "..." not in b]


def _run(page: str, check: str, tmp_path: Path, *, first: int | None = None) -> list[str]:
    """Run the page's runnable blocks (the first ``first`` of them), then ``check``; the
    printed lines."""
    blocks = _blocks(page)[:first]
    assert blocks, f"{page} has no runnable example"
    code = "\n\n".join(blocks) + "\n\n" + check
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    got = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )
    assert got.returncode == 0, f"{page}'s example failed:\n{got.stderr[-3000:]}"
    return got.stdout.splitlines()


def test_the_readme_example_shows_readiness_first_ahead_of_the_fixed_order(
    tmp_path: Path,
) -> None:
    out = _run(
        "README.md",
        "print('CLAIM', runs['readiness_first'].makespan < runs['strict_1f1b'].makespan,"
        " max(r.memory_ratio for r in runs.values()) <= 1.0)",
        tmp_path,
        first=1,
    )
    rows = {line.split()[0]: line for line in out if "makespan" in line}
    assert set(rows) == {"strict_1f1b", "readiness_first"}, out
    for line in rows.values():  # what the block prints: makespan, efficiency, bytes
        assert re.search(
            r"makespan \d+\.\d{3} s  efficiency 0\.\d\d  activation bytes 1\.00x 1F1B's", line
        )
    assert out[-1] == "CLAIM True True", out


def test_the_policy_page_example_registers_and_compares_its_policy(tmp_path: Path) -> None:
    out = _run(
        "docs/policies.md",
        "print('CLAIM', sorted(runs), runs['backward_eager'].makespan > 0,"
        " runs['backward_eager'].executed != runs['strict'].executed)",
        tmp_path,
    )
    assert out[-1] == "CLAIM ['backward_eager', 'readiness_first', 'strict'] True True", out
    # "What a policy instance sees": one object decided for every rank of the simulation,
    # its state keyed by rank (16 tasks each: F and B of 8 microbatches), as the page prints.
    assert out[-2] == "{0: 16, 1: 16, 2: 16, 3: 16}", out


def test_the_simulation_page_examples_run_and_give_what_they_say(tmp_path: Path) -> None:
    out = _run(
        "docs/simulation.md",
        # The first block's trace file, the efficiency (lower bound / makespan, <= 1), the
        # three policies compared, a TP run's decisions, every task of the virtual-clock step
        # (ZB: F, I and W of each microbatch on each virtual stage).
        "import json, pathlib\n"
        "trace = json.loads(pathlib.Path('step.json').read_text())\n"
        "print('CLAIM', bool(trace['traceEvents']), sorted(runs), 0 < res.efficiency <= 1,"
        " res.tp_latency > 0, sum(len(s.executed) for s in stats) == 3 * plan.num_virtual * 8)",
        tmp_path,
    )
    assert out[-1] == "CLAIM True ['backfill', 'readiness_first', 'strict'] True True True", out


def test_the_memory_page_examples_run_and_give_what_they_say(tmp_path: Path) -> None:
    out = _run(
        "docs/memory.md",
        # The default runs within strict 1F1B's bytes; 1.5x holds more but within 1.5x; the
        # schedule of one's own bytes holds no more than its budgets.
        "print('CLAIM', base.memory_ratio == 1.0, same.memory_ratio <= 1.0,"
        " 1.0 < more.memory_ratio <= 1.5,"
        " all(schedule.peak_bytes(r) <= b for r, b in enumerate(schedule.budgets)))",
        tmp_path,
    )
    assert out[-1] == "CLAIM True True True True", out
