from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# CI runs at least 300 examples per property test; locally HYPOTHESIS_PROFILE=dev is faster.
settings.register_profile(
    "ci", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=60, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


import pytest  # noqa: E402
import structlog  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_structlog():  # type: ignore[no-untyped-def]
    """Every test starts with structlog's defaults (the CLI configures it globally)."""
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()


@pytest.fixture(params=["per_edge", "shared"])
def p2p_io(request, monkeypatch):  # type: ignore[no-untyped-def]
    """Runs a test under both ways a ``P2PChannel`` receives (``io``): set in the
    environment, so the ranks it spawns (and torchrun's) build their channels with it."""
    from rrfp_async.channels._p2p import IO_ENV

    monkeypatch.setenv(IO_ENV, request.param)
    return request.param


@pytest.fixture(scope="session", autouse=True)
def _process_pool():  # type: ignore[no-untyped-def]
    """Stops the multi-process tests' pool (``tests/_pool.py``) when the session ends; it
    starts on the first ``pooled_spawn``, so a session without one starts nothing."""
    yield
    from tests._pool import shutdown

    shutdown()


# ---- solo tests under pytest-xdist --------------------------------------------------------
# ``./dev test`` runs two pytest-xdist workers. A test marked ``solo`` asserts on task
# durations that another test's processes on the same 2 cores distort (the stall analysis
# of a job with one slow task: beside another multi-process test, ordinary tasks took twice
# their median there and were called slow too). It runs with no other test running: a
# writer-preferring lock over two files shared by the run's workers. Every test passes the
# gate and holds the lock shared; a solo test holds the gate (no new test starts), then the
# lock exclusively (it waits for the running ones). Without xdist this is a no-op.
@pytest.fixture(autouse=True)
def _solo_or_shared(request, tmp_path_factory):  # type: ignore[no-untyped-def]
    """See above: ``solo`` tests run alone under pytest-xdist; the others side by side."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    import fcntl

    solo = request.node.get_closest_marker("solo") is not None
    # The run's temporary directory, which every worker's own (popen-gw<n>) is in: shared by
    # the workers of this run only, and removed by pytest's retention like the rest.
    shared = tmp_path_factory.getbasetemp().parent
    gate = os.open(shared / "solo.gate", os.O_CREAT | os.O_RDWR, 0o600)
    lock = os.open(shared / "solo.lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(gate, fcntl.LOCK_EX)  # behind a solo test that waits or runs
        if not solo:
            fcntl.flock(gate, fcntl.LOCK_UN)
        fcntl.flock(lock, fcntl.LOCK_EX if solo else fcntl.LOCK_SH)
        yield
    finally:
        os.close(lock)  # (closing the descriptor releases its lock)
        os.close(gate)
