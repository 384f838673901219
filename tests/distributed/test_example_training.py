"""The torchrun training example runs, with torchrun and with its own spawn, and reports
what it claims: one row per policy, parsed and checked."""

from __future__ import annotations

import math
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import rrfp_async as rr

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_image_text.py"
SMALL = ["--pp", "2", "--microbatches", "4", "--steps", "2", "--jitter", "0.1"]

ROW = re.compile(
    r"(?P<policy>\w+) +median step +(?P<ms>\S+) ms  speedup (?P<speedup>\S+)x"
    r"  deviations +(?P<dev>\d+)  loss (?P<first>\S+) -> (?P<last>\S+)"
    r"  \(CPU \+ emulated GPU time\)"
)
STEPS = re.compile(r" {17}steps \(ms\) (?P<steps>[\d. ]+); (?P<rest>.*)")
VERSUS = re.compile(
    r"vs (?P<base>\w+) step by step (?P<ratios>[\d. ]+): min-max (?P<lo>\S+)–(?P<hi>\S+),"
    r" (?P<note>.*)"
)


def _rows(stdout: str) -> dict[str, dict[str, Any]]:
    """The report's rows: ``{policy: {ms, speedup, dev, first, last, steps, rest}}``
    (numbers; nan stays nan so that the finiteness checks, not the parser, reject it;
    ``steps``: the per-step ms of the line below, ``rest``: what follows them)."""
    rows: dict[str, dict[str, Any]] = {}
    last = None
    for line in stdout.splitlines():
        m = ROW.fullmatch(line)
        if m is not None:
            last = rows[m["policy"]] = {
                k: float(v) for k, v in m.groupdict().items() if k != "policy"
            }
            continue
        m = STEPS.fullmatch(line)
        if m is not None and last is not None:
            last["steps"] = [float(x) for x in m["steps"].split()]
            last["rest"] = m["rest"]
            last = None
    return rows


def _check_rows(rows: dict[str, dict[str, Any]], policies: list[str], steps: int) -> None:
    assert list(rows) == policies, rows
    base = rows[policies[0]]
    assert base["speedup"] == 1.0 and base["rest"] == "the baseline", base
    for policy, r in rows.items():
        ms, st = r["ms"], r["steps"]
        assert isinstance(ms, float) and isinstance(st, list) and len(st) == steps, (policy, r)
        assert all(math.isfinite(v) for v in (ms, *st)) and ms > 0, (policy, r)
        assert ms == pytest.approx(statistics.median(st), abs=0.11), policy
        # an untrained model predicts about uniformly: mean cross-entropy ~ ln(vocab = 256)
        assert abs(r["first"] - math.log(256)) < 0.5, (policy, r)
        if policy == policies[0]:
            continue
        # The speedup is paired step by step: the median of base step i / this step i (the
        # steps are printed to 0.1 ms, the ratios and the speedup to 0.001) ...
        m = VERSUS.fullmatch(str(r["rest"]))
        assert m is not None and m["base"] == policies[0], r["rest"]
        ratios = [float(x) for x in m["ratios"].split()]
        expected = [b / t for b, t in zip(base["steps"], st, strict=True)]
        assert ratios == pytest.approx(expected, rel=5e-3, abs=2e-3), policy
        assert r["speedup"] == pytest.approx(statistics.median(ratios), abs=1.5e-3), policy
        lo, hi = float(m["lo"]), float(m["hi"])
        assert (lo, hi) == pytest.approx((min(ratios), max(ratios)), abs=6e-3), policy
        # ... said to be noise exactly as the signed-rank test over those ratios says (the
        # package's test; tests/test_paired.py holds it to an independent count).
        from rrfp_async.observability._paired import ALPHA, signed_rank_test

        if all(abs(x - 1) > 0.005 for x in ratios):  # away from the printed rounding
            noise = signed_rank_test(ratios) > ALPHA
            if len(ratios) < 6:  # no outcome of so few steps is significant: no verdict
                assert noise and m["note"].startswith("too few steps to judge"), m["note"]
            else:
                assert m["note"].startswith("within noise") == noise, (m["note"], ratios)
        same = base["dev"] == r["dev"] == 0
        assert ("same order as " + policies[0] + ": ratio is noise" in m["note"]) == same
    # Every policy trains the same model on the same data: the same losses (3 decimals;
    # the last step's may round apart by one unit of float noise).
    for r in rows.values():
        assert r["first"] == base["first"]
        assert r["last"] == pytest.approx(base["last"], abs=1.5e-3)


def test_example_under_torchrun() -> None:
    port = rr.testing.free_port()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            str(EXAMPLE),
            *SMALL,
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    _check_rows(_rows(out.stdout), ["strict", "readiness_first"], steps=2)


def test_example_with_spawn_and_tp() -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE),
            "--spawn",
            "--tp",
            "2",
            *SMALL,
            "--policy",
            "readiness_first",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    _check_rows(_rows(out.stdout), ["readiness_first"], steps=2)
