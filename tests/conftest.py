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
