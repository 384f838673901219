"""Programs that use the torch drop-in without ``close()`` exit 0 on every rank under torchrun.

Before the stages were released at garbage collection, at ``destroy_process_group`` and at
exit (``rrfp_async.distributed._lifetime``), a rank of such a program aborted after its last
line ("terminate called without an active exception", SIGABRT) and torchrun marked the job
FAILED. Each mode of ``exit_jobs/torch_job.py`` is a way users' programs end; one run each
here (``python scripts/dropin_exits.py --runs 20`` repeats them).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]


def _runner() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "dropin_exits", ROOT / "scripts" / "dropin_exits.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


RUNNER = _runner()


@pytest.mark.parametrize("mode", RUNNER.MODES)
def test_a_program_without_close_exits_cleanly(mode: str) -> None:
    ok, log = RUNNER.run_job(mode)
    assert ok, log[-4000:]
    if mode == "collected":  # the dropped schedule's stage was closed when it was collected
        assert log.count("open after collect 0") == 2, log[-4000:]


@pytest.mark.parametrize("mode", sorted(RUNNER.MEGATRON))
def test_a_megatron_training_loop_without_close_exits_cleanly(mode: str) -> None:
    pytest.importorskip("megatron.core")
    ok, log = RUNNER.run_job(mode)
    assert ok, log[-4000:]


def test_a_middle_rank_exits_cleanly_too() -> None:
    ok, log = RUNNER.run_job("tutorial", nproc=3)
    assert ok, log[-4000:]
