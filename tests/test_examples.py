"""The examples run (small sizes) and print what they claim: their numbers are parsed and
checked, not just looked for. (``train_image_text.py``: tests/distributed;
``train_hf_causal_lm.py`` runs here as a child process, since it spawns its ranks.)"""

from __future__ import annotations

import contextlib
import io
import math
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

import rrfp_async as rr

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

pytestmark = pytest.mark.timeout(60)


def _run(name: str, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Run an example as ``__main__`` in this process; its stdout lines. An exception (or
    ``SystemExit``) from the script fails the test."""
    monkeypatch.setattr(sys, "argv", [name, *argv])
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    return buf.getvalue().splitlines()


def _match_all(pattern: str, lines: list[str]) -> list[re.Match[str]]:
    rx = re.compile(pattern)
    found = [m for m in map(rx.fullmatch, lines) if m is not None]
    assert found, f"no line matches {pattern!r} in:\n" + "\n".join(lines)
    return found


NUM = r"([0-9]+(?:\.[0-9]+)?)"


def test_custom_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    lines = _run("custom_policy.py", [], monkeypatch)
    rows = {
        m[1]: (float(m[2]), float(m[3]), float(m[4]))
        for m in _match_all(
            rf"(\w+) +makespan {NUM} s  speedup {NUM}x  efficiency {NUM}"
            r"  \(simulated, virtual time\)",
            lines,
        )
    }
    assert list(rows) == ["strict", "readiness_first", "backward_eager"]
    base = rows["strict"][0]
    for name, (makespan, speedup, eff) in rows.items():
        assert math.isfinite(makespan) and makespan > 0, name
        assert speedup == pytest.approx(base / makespan, rel=2e-3), name
        assert 0 < eff <= 1, name
    assert rows["strict"][1] == 1.0
    # The headline: readiness-first beats strict on this (deterministic, simulated) setup.
    assert rows["readiness_first"][1] > 1.0
    # The plug-in really made the decisions: its step differs from both built-ins'.
    assert rows["backward_eager"][0] not in (rows["strict"][0], rows["readiness_first"][0])


def test_embed_in_asyncio(monkeypatch: pytest.MonkeyPatch) -> None:
    lines = _run("embed_in_asyncio.py", [], monkeypatch)
    steps = _match_all(
        rf"step (\d): {NUM} ms wall, peak in-flight \[([0-9, ]+)\], deviations (\d+)", lines
    )
    assert [int(m[1]) for m in steps] == [0, 1, 2]
    for m in steps:
        assert float(m[2]) > 0
        peak = [int(x) for x in m[3].split(",")]
        # 4 stages, 1F1B hint, memory_factor 2.0: stage s holds at most 2 * (4 - s) microbatches
        assert len(peak) == 4 and all(1 <= p <= 2 * (4 - s) for s, p in enumerate(peak)), peak
    (beat,) = _match_all(r"the heartbeat ticked (\d+) times meanwhile .*", lines)
    wall_ms = sum(float(m[2]) for m in steps)
    # The pipeline ran next to the heartbeat, not instead of it: the 5 ms heartbeat got at
    # least a quarter of the ticks the steps' wall time allows (53 of 55 on a quiet machine).
    assert wall_ms / 5 / 4 <= int(beat[1]) <= wall_ms / 5 + 5, (beat[1], wall_ms)


def test_dropout_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    # Bitwise, both lines: fails without per-task random streams (the two orders and the
    # reference loop draw the dropout masks in other orders) or if rr.task_rng drew
    # another stream than the pipeline's forwards.
    lines = _run("dropout_reference.py", ["--steps", "2", "--microbatches", "5"], monkeypatch)
    (orders,) = _match_all(r"strict 1f1b vs readiness_first bfw: max \|diff\| (\S+)", lines)
    (ref,) = _match_all(r"pipeline vs single-process reference: max \|diff\| (\S+)", lines)
    assert float(orders[1]) == 0.0
    assert float(ref[1]) == 0.0


def test_what_if_128_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["--stages", "4", "--replicas", "2", "--microbatches", "8", "--jitter", "0.2"]
    lines = _run("what_if_128_gpus.py", argv, monkeypatch)
    assert lines[0] == (
        "PP=4 x DP=2 = 8 GPUs, 8 microbatches per replica (simulated, virtual time)"
    )
    rows = _match_all(rf"  (\w+) +(\w+) +memory (\d)x  step {NUM} s  speedup {NUM}x", lines)
    assert [(m[1], m[2], m[3]) for m in rows] == [
        ("1f1b", "strict", "1"),
        ("1f1b", "readiness_first", "2"),
        ("1f1b", "backfill", "2"),
        ("bfw", "strict", "1"),
        ("bfw", "backfill", "2"),
    ]
    base = float(rows[0][4])
    for m in rows:
        step = float(m[4])
        assert math.isfinite(step) and step > 0
        assert float(m[5]) == pytest.approx(base / step, rel=2e-3)
    # A DP step lasts as long as its slowest replica: the max over the replicas' draws.
    slowest = max(
        rr.simulate(
            stages=4,
            microbatches=8,
            workload="multimodal",
            jitter=0.2,
            seed=seed,
            hint="bfw",
            policy="backfill",
            memory_factor=2.0,
        ).makespan
        for seed in range(2)
    )
    assert float(rows[4][4]) == pytest.approx(slowest, abs=5e-4)
    (timing,) = _match_all(rf"10 simulations, median {NUM} s of wall time each", lines)
    assert float(timing[1]) > 0


def test_what_if_1024_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    argv = [
        "--stages",
        "4",
        "--tp",
        "8",
        "--microbatches",
        "8",
        "--jitter",
        "0.2",
        "--latency",
        "0",
    ]
    lines = _run("what_if_1024_gpus.py", argv, monkeypatch)
    assert lines[0] == (
        "PP=4 x TP=8 = 32 GPUs, 8 microbatches (simulated, virtual time; TP = compute / 8)"
    )
    rows = _match_all(
        rf"  (\w+) +(\w+) +memory (\d)x  step {NUM} s  speedup {NUM}x  efficiency {NUM}"
        rf"  \((\d+) tasks simulated in {NUM} s\)",
        lines,
    )
    assert [(m[1], m[2], m[3]) for m in rows] == [
        ("1f1b", "strict", "1"),
        ("bfw", "readiness_first", "2"),
    ]
    assert all(int(m[7]) == 4 * 8 * 2 for m in rows)
    # TP divides every stage's compute: the same step at TP 1 lasts exactly 8x longer
    # (no latency, so nothing else scales), and each printed figure is simulate's own.
    for m, (hint, policy, mf) in zip(
        rows, [("1f1b", "strict", None), ("bfw", "readiness_first", 2.0)], strict=True
    ):
        kw = dict(
            stages=4,
            microbatches=8,
            workload="multimodal",
            jitter=0.2,
            seed=0,
            hint=hint,
            policy=policy,
            memory_factor=mf,
        )
        tp1 = rr.simulate(**kw)  # type: ignore[arg-type]
        assert float(m[4]) == pytest.approx(tp1.makespan / 8, rel=2e-3, abs=5e-4)
        assert float(m[6]) == pytest.approx(tp1.efficiency, abs=2e-3)
    assert float(rows[1][5]) == pytest.approx(float(rows[0][4]) / float(rows[1][4]), rel=2e-3)


HF_ROW = re.compile(
    rf"step (\d+)  loss {NUM}  \(reference {NUM}\)  (\d+) microbatches of \[([0-9, ]+)\]"
    r" tokens  (\d+) ms"
)
HF_END = re.compile(
    r"max \|parameter - single-process reference\| = (\S+) over (\d+) tensors"
    r" \(the reference with its microbatches reversed: (\S+)\)"
)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_train_hf_causal_lm() -> None:
    pytest.importorskip("transformers")
    # A child process (the script spawns its ranks, which needs a real __main__), importing
    # this checkout's rrfp_async, not whichever one is installed.
    root = EXAMPLES.parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_hf_causal_lm.py"), "--spawn", "--steps", "3"],
        capture_output=True,
        text=True,
        timeout=200,
        check=False,
        env=env,
        cwd=root,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    rows = _match_all(HF_ROW.pattern, lines)
    assert [int(m[1]) for m in rows] == [0, 1, 2]
    for m in rows:
        # The pipeline's step loss is the reference's (printed to 4 decimals).
        assert m[2] == m[3], m[0]
        assert int(m[4]) == 4 and int(m[6]) > 0
        tokens = [int(t) for t in m[5].split(",")]
        assert len(tokens) == 4 and len(set(tokens)) > 1, tokens  # variable lengths
    # An untrained LM predicts about uniformly: cross-entropy ~ ln(vocab = 128).
    assert abs(float(rows[0][2]) - math.log(128)) < 0.5
    assert float(rows[-1][2]) < float(rows[0][2])  # it trains
    (end,) = _match_all(HF_END.pattern, lines)
    diff, tensors, reordered = float(end[1]), int(end[2]), float(end[3])
    # Qwen2 with 4 layers: embed_tokens, 12 per layer (q/k/v weight + bias, o, gate/up/down,
    # two norms), the final norm (lm_head is embed_tokens).
    assert tensors == 1 + 12 * 4 + 1
    # Rounding only (the reference reordered differs from itself by as much); without the
    # tied weight's gradient reduction it would be ~1e-2.
    assert diff < 1e-4 and reordered < 1e-4, (diff, reordered)


def _run_example(name: str, *args: str) -> list[str]:
    root = EXAMPLES.parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=200,
        check=False,
        env=env,
        cwd=root,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.splitlines()


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_torch_pipelining_dropin_example_matches_torch() -> None:
    # The same script with torch's Schedule1F1B and with the one changed line: the same
    # losses and (with torch's order, --strict) the same parameters to the last digit.
    want = _run_example("torch_pipelining_dropin.py", "--spawn", "--torch", "--steps", "3")
    got = _run_example("torch_pipelining_dropin.py", "--spawn", "--strict", "--steps", "3")
    assert len([x for x in want if x.startswith("step ")]) == 3
    assert [x for x in got if x.startswith(("step ", "parameter"))] == [
        x for x in want if x.startswith(("step ", "parameter"))
    ]


MEGATRON_ROW = re.compile(
    r"(?:megatron|rrfp_async readiness-first) .*: step (\d) mean lm loss (\S+)"
)


@pytest.mark.distributed
@pytest.mark.timeout(500)
def test_megatron_dropin_example_matches_megatron_interleaved() -> None:
    # training.py's call with 2 chunks per rank: megatron's own interleaved schedule and the
    # one changed line train to the same losses (printed to 6 decimals) over 3 steps.
    pytest.importorskip("megatron.core")
    want = _match_all(
        MEGATRON_ROW.pattern,
        _run_example("megatron_dropin.py", "--spawn", "--vp", "2", "--megatron"),
    )
    got = _match_all(
        MEGATRON_ROW.pattern, _run_example("megatron_dropin.py", "--spawn", "--vp", "2")
    )
    assert [m[1] for m in want] == ["0", "1", "2"]
    assert [m[2] for m in got] == [m[2] for m in want]
    assert want[0][0].startswith("megatron interleaved") and "(interleaved)" in got[0][0]
