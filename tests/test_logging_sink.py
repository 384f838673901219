"""A failing log sink is reported once and disabled; training goes on (invariant 8)."""

from __future__ import annotations

import errno
import io
from typing import Any

import pytest

import rrfp_async as rr
from rrfp_async.observability._logging import LogObserver, configure_logging


class FullDisk(io.StringIO):
    """A stream on a full disk: every write raises ENOSPC."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, s: str) -> int:
        self.writes += 1
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_log_stream_never_fails_a_step(capsys: pytest.CaptureFixture[str]) -> None:
    """Before: every step failed (with an ObserverError now, an OSError before)."""
    stream = FullDisk()
    configure_logging(format="json", level="debug", stream=stream)
    for seed in range(3):
        r = rr.simulate(stages=2, microbatches=4, observer=LogObserver(), seed=seed)
        assert r.makespan > 0
    assert stream.writes == 1  # disabled after the first failure
    err = capsys.readouterr().err
    assert err.count("rrfp_async: warning:") == 1
    assert "No space left on device" in err and "disabled" in err


class BrokenLogger:
    """An application's logger that raises on every call."""

    def __getattr__(self, name: str) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            if name == "is_enabled_for":
                return True
            raise OSError(errno.ENOSPC, "No space left on device")

        return call


async def test_log_observer_with_a_failing_logger_goes_quiet(
    capsys: pytest.CaptureFixture[str],
) -> None:
    s = rr.StepSchedule.build(rr.StepPlan(topology=rr.Topology(stages=2), microbatches=4), "1f1b")
    obs = LogObserver(BrokenLogger())
    pipe = rr.LocalPipeline(s, rr.sim.CostModelExecutor(_zero(s)), observer=obs)
    for _ in range(3):
        await pipe.run_step([None] * 4)
    assert isinstance(obs.broken, OSError) and not obs.active
    assert capsys.readouterr().err.count("rrfp_async: warning:") == 1


def _zero(s: rr.StepSchedule) -> rr.Durations:
    pl = s.plan
    return rr.Durations.from_arrays(pl, [[0.0] * pl.microbatches for _ in range(pl.num_virtual)])
