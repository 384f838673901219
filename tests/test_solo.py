"""``solo`` tests run with no other test running under pytest-xdist (``tests/conftest.py``):
an inner two-worker session whose tests record, in files, which tests run at once."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_INNER = textwrap.dedent(
    """
    import os, time
    from pathlib import Path

    import pytest

    RUNNING = Path(os.environ["SOLO_TEST_DIR"])


    def _run(name: str, solo: bool) -> None:
        mine = RUNNING / name
        mine.touch()
        others = []
        for _ in range(5):  # a while, so that the other worker's tests overlap it
            others += [p.name for p in RUNNING.iterdir() if p != mine]
            time.sleep(0.1)
        mine.unlink()
        (RUNNING.parent / "log").open("a").write(f"{name} {sorted(set(others))}\\n")


    @pytest.mark.parametrize("i", range(6))
    def test_shared(i: int) -> None:
        _run(f"shared{i}", False)


    @pytest.mark.solo
    @pytest.mark.parametrize("i", range(2))
    def test_solo(i: int) -> None:
        _run(f"solo{i}", True)
    """
)

_CONFTEST = "from tests.conftest import _solo_or_shared  # noqa: F401\n"
_INI = "[pytest]\nmarkers =\n    solo: alone\n"


@pytest.mark.timeout(120)
def test_solo_tests_see_no_other_test_running_and_the_others_overlap(tmp_path: Path) -> None:
    (tmp_path / "test_inner.py").write_text(_INNER)
    (tmp_path / "conftest.py").write_text(_CONFTEST)
    (tmp_path / "pytest.ini").write_text(_INI)
    running = tmp_path / "running"
    running.mkdir()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")},
        "SOLO_TEST_DIR": str(running),
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:benchmark"]
    cmd += ["-n", "2", "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py")]
    done = subprocess.run(
        cmd,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    seen = dict(line.split(" ", 1) for line in (tmp_path / "log").read_text().splitlines())
    assert sorted(seen) == sorted([f"shared{i}" for i in range(6)] + ["solo0", "solo1"])
    assert seen["solo0"] == seen["solo1"] == "[]", seen  # alone
    # Not vacuous: the shared tests did run side by side (two workers).
    assert any(v != "[]" for k, v in seen.items() if k.startswith("shared")), seen
