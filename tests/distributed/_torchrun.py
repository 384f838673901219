"""torchrun jobs whose ranks the test watches itself, with the agent kept out of the way.

torchrun's agent looks at its workers every ``--monitor-interval`` seconds (0.1 s by
default) and, at the first look that finds one dead, SIGTERMs the others. A test of what a
survivor does after a rank dies (fails by itself, names the lost rank, exits non-zero)
races that look: a look that falls between the kill and the survivor's own failure takes
the survivor down first, and what the test reads (its error, its exit code) never comes.
Seen in full runs of the suite: ``test_dead_rank.py`` at a 3 s interval (in CI, about 1 run
in 100) and ``test_resume.py`` at the default 0.1 s.

So such a test runs the agent with ``--monitor-interval`` :data:`AGENT_NEVER_LOOKS` (longer
than any test's own deadline): the agent never looks while the test runs, each survivor
fails and exits by itself, the test reads each worker's exit code from its zombie's
``/proc/PID/stat`` (the agent has not reaped it), and :func:`end` ends the agent and its
workers. Linux only, as the rest of the distributed tier.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

AGENT_NEVER_LOOKS = 600
"""torchrun's ``--monitor-interval`` for these tests: longer than any test's deadline."""


def stat(pid: int) -> list[str]:
    """The fields of ``/proc/PID/stat`` from the third (the state) on, or ``[]`` if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return []
    return text.rsplit(")", 1)[1].split()


def state(pid: int) -> str:
    """The process state letter (``T`` stopped, ``Z`` exited, unreaped), or ``-`` if gone."""
    fields = stat(pid)
    return fields[0] if fields else "-"


def exit_code(pid: int) -> int | None:
    """An exited, unreaped process's exit code (``-N`` for signal N), from field 52 of its
    stat (Linux >= 3.5: the status waitpid would report); None unless it is a zombie."""
    fields = stat(pid)
    if not fields or fields[0] != "Z" or len(fields) < 50:
        return None
    return os.waitstatus_to_exitcode(int(fields[49]))


def children(pid: int) -> set[int]:
    """The pids whose parent is ``pid`` (torchrun's workers are its agent's children)."""
    out = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            fields = stat(int(d.name))
            if len(fields) > 1 and fields[1] == str(pid):
                out.add(int(d.name))
    return out


def end(agent: subprocess.Popen[bytes], workers: set[int]) -> None:
    """Nothing stays: the agent (started with ``start_new_session=True``: its process group),
    then ``workers`` and any other child of the agent (each worker is in a session of its
    own). A stopped process takes SIGKILL as it is (SIGCONT first would let it run a
    moment: its threads wake to a clock that ran on while it was stopped)."""
    workers = workers | children(agent.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(agent.pid, signal.SIGKILL)
    for pid in workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    agent.wait(timeout=30)


def worker_env(**extra: str) -> dict[str, str]:
    """The environment of a job's workers: loopback gloo, one OpenMP thread, this checkout
    on ``PYTHONPATH``; ``extra`` on top."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {
        **os.environ,
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": path,
        **extra,
    }


def run_job(
    workdir: Path,
    args: Sequence[str],
    *,
    world: int,
    out: Path,
    env: dict[str, str],
    done: Callable[[dict[int, int]], bool],
    seconds: float,
    settle: float = 0.0,
) -> dict[int, int]:
    """Run the worker script and ``args`` on ``world`` ranks under torchrun (the agent kept
    from looking), its output to ``workdir / "torchrun.log"``; read each rank's pid from
    ``out / f"rank{r}.pid"``; wait until ``done(pids)`` or ``seconds``, then ``settle``
    seconds more; return the exit code of each rank that had exited, and end the job."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", str(world), "--max-restarts", "0"]
    cmd += ["--monitor-interval", str(AGENT_NEVER_LOOKS), *args]
    with (workdir / "torchrun.log").open("w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, cwd=workdir, env=env, start_new_session=True
        )
    pids: dict[int, int] = {}
    exits: dict[int, int] = {}
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and proc.poll() is None:
            for r in range(world):
                f = out / f"rank{r}.pid"
                if r not in pids and f.exists() and f.read_text():
                    pids[r] = int(f.read_text())
            if done(pids):
                break
            time.sleep(0.1)
        time.sleep(settle)
        for r, pid in pids.items():
            code = exit_code(pid)
            if code is not None:
                exits[r] = code
    finally:
        end(proc, set(pids.values()))
    return exits
