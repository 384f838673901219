"""The test suite's process pool (``tests/_pool.py``): ``pooled_spawn`` reports what
``rr.spawn`` reports, and a job that crashes, hangs, times out or leaves state behind costs
nothing to the next job, which runs on the same pool from a clean slate."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import rrfp_async as rr
from tests._pool import pool_pids, pooled_spawn

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]
LEAK_ENV = "RRFP_POOL_TEST_LEAK"


def _allreduce(rank: int, world: int, base: int) -> tuple[int, int]:
    import torch
    import torch.distributed as dist

    t = torch.tensor([rank + base])
    dist.all_reduce(t)
    return int(t.item()), os.getpid()


def test_results_come_back_in_rank_order_from_new_processes_each_job() -> None:
    first = pooled_spawn(_allreduce, 2, 10)
    zygotes = pool_pids()
    second = pooled_spawn(_allreduce, 2, 10)
    assert [v for v, _ in first] == [21, 21] == [v for v, _ in second]
    pids = {p for _, p in first} | {p for _, p in second}
    assert len(pids) == 4 and os.getpid() not in pids  # one process per rank per job
    assert pool_pids()[:2] == zygotes[:2]  # ... forked from the same, reused zygotes
    assert [v for v, _ in pooled_spawn(_allreduce, 3, 1)] == [6, 6, 6]  # the pool grows


def _die_on_1(rank: int, world: int) -> None:
    if rank == 1:
        os._exit(3)  # no report, no traceback: the pool must notice the dead process
    time.sleep(30)


def _fail_on_1(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("boom on purpose")
    time.sleep(30)


def _hang(rank: int, world: int) -> None:
    time.sleep(60)


def test_a_crashed_rank_fails_its_job_as_spawn_reports_it_and_the_next_job_runs() -> None:
    zygotes = pooled_spawn(_allreduce, 2, 0) and pool_pids()
    with pytest.raises(rr.errors.SpawnError, match="process died with exit code 3") as ei:
        pooled_spawn(_die_on_1, 2, timeout=60)
    assert ei.value.failures[0] == "stopped after another rank failed"
    assert str(ei.value).startswith("2 of 2 rank(s) failed; rank 1: process died with exit")
    assert [v for v, _ in pooled_spawn(_allreduce, 2, 10)] == [21, 21]
    assert pool_pids()[:2] == zygotes[:2]  # the zygotes ran nothing of the crashed job


def test_every_rank_exception_comes_back_with_its_traceback() -> None:
    with pytest.raises(rr.errors.SpawnError, match=r"rank 1: ValueError: boom on purpose") as ei:
        pooled_spawn(_fail_on_1, 2, timeout=60, grace=1.0)
    assert "Traceback" in ei.value.failures[1] and "_fail_on_1" in ei.value.failures[1]
    assert ei.value.failures[0] == "stopped after another rank failed"
    assert [v for v, _ in pooled_spawn(_allreduce, 2, 10)] == [21, 21]


def test_a_job_past_its_timeout_is_killed_and_the_next_job_runs() -> None:
    t = time.monotonic()
    with pytest.raises(rr.errors.SpawnError, match="did not finish within 3") as ei:
        pooled_spawn(_hang, 2, timeout=3)
    assert set(ei.value.failures) == {0, 1}
    assert time.monotonic() - t < 20
    assert [v for v, _ in pooled_spawn(_allreduce, 2, 10)] == [21, 21]


def test_what_cannot_reach_the_ranks_is_refused_as_spawn_refuses_it() -> None:
    with pytest.raises(rr.errors.SpawnError, match=r"needs a picklable, module-level function"):
        pooled_spawn(lambda rank, world: rank, 2)
    with pytest.raises(rr.PlanError, match=r"world_size \(the number of processes\) must be"):
        pooled_spawn(_allreduce, 0, 1)


def _leave_state_behind(rank: int, world: int) -> None:
    """Everything a test body could leave in a reused process."""
    import structlog
    import torch
    import torch.distributed as dist

    from rrfp_async.distributed import _spawn

    dist.new_group([0, 1])  # as DistributedStage's groups do, never destroyed
    if rank == 0:  # a message nobody receives, on the default group, its send kept alive
        globals()["_pending"] = dist.isend(torch.tensor([111]), dst=1, tag=7)
    os.environ[LEAK_ENV] = "leaked"
    structlog.configure(processors=[structlog.processors.JSONRenderer()])
    torch.set_num_threads(2)
    torch.manual_seed(0)
    _spawn.report_progress("from the leaking job")  # no listener: must not leak either
    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
    globals()["_leaked_global"] = True


def _see_a_clean_slate(rank: int, world: int) -> dict[str, Any]:
    import structlog
    import torch
    import torch.distributed as dist

    got = torch.tensor([-1])
    if rank == 0:
        dist.isend(torch.tensor([222]), dst=1, tag=7).wait()
    else:
        dist.recv(got, src=0, tag=7)  # the first message on tag 7 this process sees
    return {
        "groups": len(dist.distributed_c10d._world.pg_map),
        "message": int(got.item()),
        "env": os.environ.get(LEAK_ENV),
        "structlog": structlog.is_configured(),
        "threads": torch.get_num_threads(),
        "seed": torch.initial_seed(),
        "python_threads": threading.active_count(),
        "global": "_leaked_global" in globals(),
    }


def _leak_then_look(rank: int, world: int) -> dict[str, Any]:
    """What a long-lived rank would see: the leaks and the look in one process."""
    import torch
    import torch.distributed as dist

    _leave_state_behind(rank, world)
    look = _see_a_clean_slate(rank, world)
    if rank == 1:  # it took the stale message: take the one rank 0 is still sending
        dist.recv(torch.tensor([-1]), src=0, tag=7)
    return look


def test_a_job_that_leaves_groups_env_config_seeds_and_threads_leaves_the_next_clean() -> None:
    pooled_spawn(_allreduce, 2, 0)
    zygotes = pool_pids()
    pooled_spawn(_leave_state_behind, 2)
    looks = [pooled_spawn(_see_a_clean_slate, 2) for _ in range(2)]
    for rank in range(2):
        seeds = {look[rank].pop("seed") for look in looks}
        assert len(seeds) == 2 and 0 not in seeds  # fresh from the OS in every job
        for look in looks:
            assert look[rank].pop("message") == (222 if rank else -1)  # not the stale 111
            assert look[rank] == {
                "groups": 1,  # the default group only
                "env": None,
                "structlog": False,
                "threads": 1,
                "python_threads": 1,
                "global": False,
            }
    assert pool_pids()[:2] == zygotes[:2]  # the same pool: the slate is clean by design
    # The look is not vacuous: in the process that leaked, it sees every leak.
    for rank, seen in enumerate(pooled_spawn(_leak_then_look, 2)):
        assert seen == {
            "groups": 2,
            "message": 111 if rank else -1,
            "env": "leaked",
            "structlog": True,
            "threads": 2,
            "seed": 0,
            "python_threads": 2,
            "global": True,
        }


def _seen_env(rank: int, world: int) -> tuple[str | None, str]:
    return os.environ.get(LEAK_ENV), os.getcwd()


def test_the_callers_environment_and_directory_reach_the_ranks(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(LEAK_ENV, "set by this test")
    monkeypatch.chdir(tmp_path)
    assert pooled_spawn(_seen_env, 2) == [("set by this test", str(tmp_path))] * 2
    monkeypatch.undo()
    assert pooled_spawn(_seen_env, 2) == [(None, os.getcwd())] * 2


def _progress_and_print(rank: int, world: int) -> int:
    from rrfp_async.distributed._spawn import report_progress

    print(f"stdout of rank {rank}", flush=True)
    print(f"stderr of rank {rank}", file=sys.stderr, flush=True)
    report_progress(("rank", rank))
    return rank


def test_progress_and_output_reach_the_test_that_ran_the_job(
    capfd: pytest.CaptureFixture[str],
) -> None:
    seen: list[Any] = []
    assert pooled_spawn(_progress_and_print, 2, on_progress=seen.append) == [0, 1]
    assert sorted(seen) == [("rank", 0), ("rank", 1)]
    out, err = capfd.readouterr()
    assert "stdout of rank 0" in out and "stdout of rank 1" in out
    assert "stderr of rank 1" in err


def test_shutdown_stops_every_zygote() -> None:
    from tests._pool import _Pool

    pool = _Pool()  # a pool of its own, not the session's
    assert [v for v, _ in pool.run(_allreduce, 1, (5,), **_DEFAULTS)] == [5]
    pids = [s.pid for s in pool.slots if s.pid is not None]
    assert len(pids) == 1
    pool.close()
    assert _alive(pids, within=10) == []


_DEFAULTS: dict[str, Any] = {
    "backend": "gloo",
    "timeout": 60.0,
    "pg_timeout": 60.0,
    "threads": 1,
    "on_progress": None,
    "grace": 3.0,
}

# An inner pytest session, for what only a session can show: pytest-timeout stopping a test
# inside a pooled job (and the next test running on the same pool), and a pytest killed
# with SIGKILL, which runs no clean-up, leaving no process behind.
_INNER = """
import os, time
from pathlib import Path
import pytest
from tests._pool import pool_pids, pooled_spawn

OUT = Path(os.environ["POOL_TEST_OUT"])

def _pid_then_hang(rank, world, name):
    (OUT / f"{name}{rank}").write_text(str(os.getpid()))
    time.sleep(600)

def _pid(rank, world):
    return os.getpid()

def test_warm_the_pool():  # so that the next test's timeout is spent inside its job
    assert len(set(pooled_spawn(_pid, 2))) == 2
    (OUT / "zygotes").write_text(" ".join(map(str, pool_pids())))

@pytest.mark.timeout(10)
def test_hangs():
    try:
        pooled_spawn(_pid_then_hang, 2, "hung", timeout=600)
    except BaseException as e:  # what stopped the job, for the outer test
        (OUT / "hung-by").write_text(f"{type(e).__name__}: {e}")
        raise

def test_next():
    # The hung job's children are gone, and this job runs on the same pool.
    for r in range(2):
        pid = int((OUT / f"hung{r}").read_text())
        for _ in range(50):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"the hung job's rank {r} (pid {pid}) is still alive")
    assert len(set(pooled_spawn(_pid, 2))) == 2
    assert " ".join(map(str, pool_pids())) == (OUT / "zygotes").read_text()
    (OUT / "next-passed").write_text("")

def test_killed_with_its_session():
    pooled_spawn(_pid_then_hang, 2, "killed", timeout=600)
"""


def _alive(pids: list[int], within: float) -> list[int]:
    """The pids still alive after waiting up to ``within`` seconds for them to end."""
    deadline = time.monotonic() + within
    while True:
        alive = []
        for p in pids:
            try:
                os.kill(p, 0)
                alive.append(p)
            except ProcessLookupError:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def test_pytest_timeout_stops_a_job_and_a_killed_pytest_leaves_no_process(
    tmp_path: Path,
) -> None:
    (tmp_path / "test_inner.py").write_text(_INNER)
    out = tmp_path / "out"
    out.mkdir()
    env = {
        **os.environ,
        "POOL_TEST_OUT": str(out),
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    # ``-c os.devnull``: the inner session has none of this project's configuration
    # (it would rerun its own suite's fixtures); ``-v`` names each test's outcome as it ends.
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-c", os.devnull),
            *("--rootdir", str(tmp_path), str(tmp_path / "test_inner.py")),
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 150
        while not ((out / "killed0").exists() and (out / "killed1").exists()):
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "the inner session did not reach its last test"
            time.sleep(0.2)
        assert (out / "next-passed").exists()
        zygotes = [int(p) for p in (out / "zygotes").read_text().split()]
        children = [int((out / f"killed{r}").read_text()) for r in range(2)]
        proc.send_signal(signal.SIGKILL)
        stdout = proc.communicate(timeout=30)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "test_hangs FAILED" in stdout and "test_next PASSED" in stdout, stdout
    assert (out / "hung-by").read_text() == "Failed: Timeout (>10.0s) from pytest-timeout."
    assert _alive(zygotes + children, within=10) == []
