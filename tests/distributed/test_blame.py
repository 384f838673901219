"""The right rank, always: every rank's error names the rank where the failure began, and
what it did, however far from it the rank is and whatever told it (a collective, a closed
channel, a CLOSE or an ABORT passed on).

Four ranks under a real torchrun (``_dead_rank_worker.py``, one small stage each, through
``test_dead_rank._run``); each rank writes its error the moment its step fails:

* a rank SIGKILLed after opening its stage, before step 0: every survivor's plan check
  (an all-gather) fails, and its error names the lost rank, gloo's text last;
* the last rank leaves its ``async with`` block cleanly one step early: every other rank
  says that it left, and after which step (its clean CLOSE carries it), not that its
  neighbour closed;
* a middle rank SIGKILLed mid-step: its neighbours lose it, and the rank two hops away
  names it too (its neighbour's CLOSE carries the origin), in its first line;
* a policy that never returns: its rank's error opens with the stuck policy, and its peers
  say they waited for that rank's policy.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.distributed.test_dead_rank import _report, _run

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]


def _first(err: dict[str, str]) -> str:
    return err["message"].splitlines()[0]


def test_a_rank_killed_before_step_0_is_named_by_the_plan_check(tmp_path: Path) -> None:
    res = _run(tmp_path, victim=2, how="OPENKILL", survivors=[0, 1, 3], world=4)
    _report("SIGKILL rank 2 of 4 before step 0", res)
    for r in (0, 1, 3):
        err = res["errors"].get(r)
        assert err is not None, res["log"][-3000:]
        assert err["type"] == "PeerError", err
        first = _first(err)
        assert f"rank {r} (global {r}) step 0: " in first, first
        assert "rank 2 (global 2)" in first, first
        # gloo's own text is kept, but only as the cause, at the end.
        assert not first.split("rank 2 (global 2)")[0].count("pair.cc"), first
        # Non-zero by itself, and no SIGABRT at exit: a receive still blocked in gloo when the
        # channel closed is waited for at exit (``channels._strays``; before it, a neighbour
        # of the dead rank ended with -6 in 6 of 6 runs under load).
        assert res["exit"].get(r) == 1, res["exit"]
    assert res["exit"].get(2) == -signal.SIGKILL, res["exit"]


def test_a_rank_that_leaves_one_step_early_is_named_with_its_last_step(tmp_path: Path) -> None:
    res = _run(tmp_path, victim=3, how="LEAVE", survivors=[0, 1, 2], world=4, steps=3)
    _report("rank 3 of 4 leaves after step 1", res)
    for r in (0, 1, 2):
        err = res["errors"].get(r)
        assert err is not None, res["log"][-3000:]
        assert err["type"] == "PeerError", err
        first = _first(err)
        assert f"rank {r} (global {r}) step 2: " in first or f"rank {r} step 2: " in first, first
        assert "rank 3 (global 3) left after step 1" in first, first
        assert res["exit"].get(r) == 1, res["exit"]


def test_a_rank_two_hops_from_a_killed_rank_names_it_first(tmp_path: Path) -> None:
    res = _run(tmp_path, victim=2, how="KILL", survivors=[0, 1, 3], world=4)
    _report("SIGKILL rank 2 of 4 mid-step", res)
    for r in (0, 1, 3):
        err = res["errors"].get(r)
        assert err is not None, res["log"][-3000:]
        assert err["type"] == "PeerError", err
        first = _first(err)
        assert "rank 2 (global 2)" in first, first
        assert "lost" in first, first
    assert "closed its channel (it ended or failed)" not in res["errors"][0]["message"]
    assert res["exit"].get(2) == -signal.SIGKILL, res["exit"]


def test_a_policy_that_never_returns_is_the_cause_on_every_rank(tmp_path: Path) -> None:
    res = _run(tmp_path, victim=1, how="HANG", survivors=[0, 1, 2, 3], world=4, step_timeout=4.0)
    _report("rank 1's policy never returns at step 2", res)
    e1 = res["errors"].get(1)
    assert e1 is not None, res["log"][-3000:]
    assert e1["type"] == "StepTimeoutError", e1
    first = _first(e1)
    assert "the policy" in first and "did not return" in first, first
    for r in (0, 2, 3):
        err = res["errors"].get(r)
        assert err is not None, res["log"][-3000:]
        assert "rank 1 (global 1)" in _first(err), err
        assert "policy" in _first(err), err
