"""The examples run as README.md's Examples table shows them, and print what they claim.

The table is the spec (issue 38 item 3): every example in examples/ has a row; its command
runs here exactly as written (``python`` is this interpreter, the working directory a fresh
one, no torchrun variables, so a multi-process example starts its processes itself), and its
output is parsed and checked, not just looked for. A row's "needs" names the extra the
example needs; with that extra's packages hidden the example exits with one line naming
it. A row whose command is too slow for the suite names the smaller command the test runs
instead (the same command plus size flags). Beside the table's runs, in-process runs at
small sizes check the simulators' figures against ``rr.simulate``, and the drop-ins are held
to their originals' results.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.metadata as md
import importlib.util
import io
import json
import math
import re
import runpy
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import rrfp_async as rr
from tests.test_demo_plain_install import WARNING_LINE, hidden_env

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
ROOT = EXAMPLES.parent

pytestmark = pytest.mark.timeout(60)


# ---- the table ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One row of README.md's Examples table."""

    command: str  # as the table shows it
    needs: str | None  # the extra the example needs
    runs: str  # what the test runs: the command, or the smaller one the row names

    @property
    def script(self) -> str:
        """The example's file name."""
        return Path(shlex.split(self.command)[1]).name


def examples_table() -> list[Row]:
    """The rows of README.md's Examples table."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Examples\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        if not line.startswith("| `python "):
            continue
        command, needs, what = (c.strip() for c in line.strip().strip("|").split("|"))
        extra = re.fullmatch(r"`\[(\w+)\]`", needs)
        assert extra is not None or needs == "–", f"needs: {needs!r} in {line!r}"
        smaller = re.search(r"the test, which runs `([^`]+)`", what)
        rows.append(
            Row(
                command=command.strip("`"),
                needs=extra[1] if extra else None,
                runs=smaller[1] if smaller else command.strip("`"),
            )
        )
    return rows


TABLE = examples_table()


def _extras() -> dict[str, list[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return dict(project["optional-dependencies"])


def extra_modules(extra: str) -> set[str]:
    """The top-level modules of the distributions ``extra`` lists (of one that is not
    installed: its name as a module name)."""
    names = {canonicalize_name(Requirement(r).name) for r in _extras()[extra]}
    found = {
        m
        for m, dists in md.packages_distributions().items()
        if any(canonicalize_name(d) in names for d in dists)
    }
    return found or {n.replace("-", "_") for n in names}


def imported_modules(script: Path) -> set[str]:
    """The top-level modules an example imports anywhere (in its functions too)."""
    out = set()
    for node in ast.walk(ast.parse(script.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module.split(".")[0])
    return out


def run_as_shown(
    command: str, cwd: Path, *, timeout: float, hide: Iterable[str] = ()
) -> subprocess.CompletedProcess[str]:
    """``command`` (``python examples/x.py ...``) run as a user runs it from the checkout:
    this interpreter, this checkout's packages, ``cwd`` as the working directory, no
    torchrun variables; the modules ``hide`` cannot be imported."""
    words = shlex.split(command)
    assert words[0] == "python" and words[1].startswith("examples/"), command
    return subprocess.run(
        [sys.executable, str(ROOT / words[1]), *words[2:]],
        cwd=cwd,
        env=hidden_env(cwd / ".site", hide),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_the_table_shows_every_example_run_plainly() -> None:
    """One row per example; its command plain (no torchrun, no --spawn); its extra one that
    pyproject.toml declares, named exactly where the example imports an extra's package."""
    assert sorted(r.script for r in TABLE) == sorted(p.name for p in EXAMPLES.glob("*.py"))
    optional = {e: extra_modules(e) for e in _extras() if e != "dev"}
    for row in TABLE:
        assert row.command.startswith(f"python examples/{row.script}"), row
        assert "--spawn" not in row.command and "torchrun" not in row.command, row
        assert row.runs == row.command or row.runs.startswith(row.command + " --"), row
        assert row.needs is None or row.needs in optional, (row, sorted(optional))
        imports = imported_modules(EXAMPLES / row.script)
        uses = {e for e, mods in optional.items() if mods & imports}
        assert uses == ({row.needs} if row.needs else set()), (row, uses)


# ---- what each example prints, checked ------------------------------------------------------

NUM = r"([0-9]+(?:\.[0-9]+)?)"


def _match_all(pattern: str, lines: list[str]) -> list[re.Match[str]]:
    rx = re.compile(pattern)
    found = [m for m in map(rx.fullmatch, lines) if m is not None]
    assert found, f"no line matches {pattern!r} in:\n" + "\n".join(lines)
    return found


def check_custom_policy(lines: list[str], cwd: Path) -> None:
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


def check_embed_in_asyncio(lines: list[str], cwd: Path) -> None:
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


def check_dropout_reference(lines: list[str], cwd: Path) -> None:
    # Bitwise, both lines: fails without per-task random streams (the two orders and the
    # reference loop draw the dropout masks in other orders) or if rr.task_rng drew
    # another stream than the pipeline's forwards.
    (orders,) = _match_all(r"strict 1f1b vs readiness_first bfw: max \|diff\| (\S+)", lines)
    (ref,) = _match_all(r"pipeline vs single-process reference: max \|diff\| (\S+)", lines)
    assert float(orders[1]) == 0.0
    assert float(ref[1]) == 0.0


def check_what_if_128_gpus(lines: list[str], cwd: Path) -> None:
    assert lines[0] == (
        "PP=16 x DP=8 = 128 GPUs, 128 microbatches per replica (simulated, virtual time)"
    )
    rows = _match_all(rf"  (\w+) +(\w+) +memory (\d)x  step {NUM} s  speedup {NUM}x", lines)
    assert len(rows) == 5 and rows[0][5] == "1.000", rows
    for m in rows:
        assert float(m[5]) == pytest.approx(float(rows[0][4]) / float(m[4]), rel=2e-3), m[0]
    _match_all(rf"40 simulations, median {NUM} s of wall time each", lines)


def check_what_if_1024_gpus(lines: list[str], cwd: Path) -> None:
    # The smaller command the table names for the test: PP 16, 128 microbatches.
    assert lines[0].startswith("PP=16 x TP=8 = 128 GPUs, 128 microbatches (simulated"), lines
    rows = _match_all(
        rf"  (\w+) +(\w+) +memory (\d)x  step {NUM} s  speedup {NUM}x  efficiency {NUM}"
        rf"  \((\d+) tasks simulated in {NUM} s\)",
        lines,
    )
    assert [(m[1], m[2]) for m in rows] == [("1f1b", "strict"), ("bfw", "readiness_first")]
    assert all(int(m[7]) == 16 * 128 * 2 for m in rows)


TRAIN_ROW = re.compile(
    r"(\w+) +median step +\S+ ms  speedup (\S+)x  deviations +\d+  loss (\S+) -> (\S+)"
    r"  \(CPU \+ emulated GPU time\)"
)


def check_train_image_text(lines: list[str], cwd: Path) -> None:
    assert lines[0].startswith("6 timed steps per policy"), lines[0]
    rows = _match_all(TRAIN_ROW.pattern, lines)
    assert [m[1] for m in rows] == ["strict", "readiness_first"]
    assert all(float(m[4]) < float(m[3]) for m in rows), rows  # it trains
    # 6 paired steps, so the signed-rank test can decide: the verdict is its own.
    (versus,) = _match_all(r" +steps \(ms\) [\d. ]+; vs strict step by step .*, (\w.*)", lines)
    assert versus[1].startswith(("faster in", "slower in", "within noise")), versus[0]


HF_ROW = re.compile(
    rf"step (\d+)  loss {NUM}  \(reference {NUM}\)  (\d+) microbatches of \[([0-9, ]+)\]"
    r" tokens  (\d+) ms"
)
HF_END = re.compile(
    r"max \|parameter - single-process reference\| = (\S+) over (\d+) tensors"
    r" \(the reference with its microbatches reversed: (\S+)\)"
)


def check_train_hf_causal_lm(lines: list[str], cwd: Path) -> None:
    rows = _match_all(HF_ROW.pattern, lines)
    assert [int(m[1]) for m in rows] == [0, 1, 2, 3, 4]
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


def check_torch_pipelining_dropin(lines: list[str], cwd: Path) -> None:
    steps = _match_all(rf"step (\d)  loss {NUM}", lines)
    assert [int(m[1]) for m in steps] == [0, 1, 2, 3, 4]
    _match_all(r"parameter checksum -?[0-9]+\.[0-9]{12}", lines)


MEGATRON_ROW = re.compile(
    r"(?:megatron|rrfp_async readiness-first) .*: step (\d) mean lm loss (\S+)"
)


def check_megatron_dropin(lines: list[str], cwd: Path) -> None:
    rows = _match_all(MEGATRON_ROW.pattern, lines)
    assert [m[1] for m in rows] == ["0", "1", "2"]
    assert all(m[0].startswith("rrfp_async readiness-first (1F1B): ") for m in rows), rows
    # An untrained LM predicts about uniformly: cross-entropy ~ ln(vocab = 64).
    assert all(abs(float(m[2]) - math.log(64)) < 0.5 for m in rows), rows


DEEPSPEED_ROW = re.compile(r"(PipelineEngine|ReadinessFirstPipelineEngine) step (\d): loss (\S+)")


def check_deepspeed_dropin(lines: list[str], cwd: Path) -> None:
    rows = _match_all(DEEPSPEED_ROW.pattern, lines)
    assert [m[1] for m in rows] == ["0", "1", "2", "3"]
    assert all(m[0] == "ReadinessFirstPipelineEngine" for m in rows), rows
    losses = [float(m[2]) for m in rows]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses


def check_debug_slow_forward(lines: list[str], cwd: Path) -> None:
    (wrote,) = _match_all(r"wrote out/slowfw/rank\{0\.\.3\}\.log and .*", lines)
    assert "(4 processes, policy strict, 1F3 slow: 400 ms; EMULATED GPU time)" in wrote[0]
    out = cwd / "out" / "slowfw"
    for r in range(4):
        events = [json.loads(x) for x in (out / f"rank{r}.log").read_text().splitlines()]
        assert {e["rank"] for e in events} == {r}, r
        assert json.loads((out / "traces" / f"rank{r}.json").read_text()), r


def check_resume_after_kill(lines: list[str], cwd: Path) -> None:
    # Rank 1 SIGKILLed itself as step 3 began; torchrun restarted the job, which resumed.
    for rank in (0, 1):
        assert f"rank {rank} attempt 1: resumed after step 2" in lines, lines
    (losses,) = _match_all(rf"loss by step:((?: {NUM}){{6}})", lines)
    out = cwd / "out" / "resume" / "out"
    saved = [json.loads((out / f"loss-{s}.json").read_text()) for s in range(6)]
    assert [float(x) for x in losses[1].split()] == pytest.approx(saved, abs=1e-6)
    assert (out / "params-rank0.json").is_file() and (out / "params-rank1.json").is_file()


def check_torchtitan_config(lines: list[str], cwd: Path) -> None:
    assert lines[0].startswith(
        "llama3_8b_readiness_first: PP 4, schedule InterleavedReadinessFirst, imports"
    ), lines
    assert lines[1].startswith(
        "llama3_debugmodel_readiness_first: PP 2, schedule ReadinessFirst1F1B, imports"
    ), lines
    assert "-m torchtitan.train --module torchtitan_config" in lines[2], lines


#: Per example: its output's check, whether it starts processes, the test's time limit (s).
CHECKS: dict[str, tuple[Callable[[list[str], Path], None], bool, int]] = {
    "custom_policy.py": (check_custom_policy, False, 60),
    "embed_in_asyncio.py": (check_embed_in_asyncio, False, 60),
    "dropout_reference.py": (check_dropout_reference, False, 60),
    "what_if_128_gpus.py": (check_what_if_128_gpus, False, 90),
    "what_if_1024_gpus.py": (check_what_if_1024_gpus, False, 90),
    "torchtitan_config.py": (check_torchtitan_config, False, 60),
    "train_image_text.py": (check_train_image_text, True, 300),
    "train_hf_causal_lm.py": (check_train_hf_causal_lm, True, 300),
    "torch_pipelining_dropin.py": (check_torch_pipelining_dropin, True, 240),
    "megatron_dropin.py": (check_megatron_dropin, True, 300),
    "deepspeed_dropin.py": (check_deepspeed_dropin, True, 300),
    "debug_slow_forward.py": (check_debug_slow_forward, True, 240),
    "resume_after_kill.py": (check_resume_after_kill, True, 300),
}


def _table_params() -> list[Any]:
    out = []
    for row in TABLE:
        _, processes, limit = CHECKS[row.script]
        marks = [pytest.mark.timeout(limit)] + ([pytest.mark.distributed] if processes else [])
        out.append(pytest.param(row, marks=marks, id=row.script.removesuffix(".py")))
    return out


def _installed(extra: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in extra_modules(extra))


@pytest.mark.parametrize("row", _table_params())
def test_example_runs_as_the_table_shows(row: Row, tmp_path: Path) -> None:
    if row.needs is not None and not _installed(row.needs):
        pytest.skip(f"the {row.needs} extra is not installed (without it: the test below)")
    check, _, limit = CHECKS[row.script]
    out = run_as_shown(row.runs, tmp_path, timeout=limit - 10)
    assert out.returncode == 0, out.stderr[-3000:]
    warned = [line for line in out.stderr.splitlines() if WARNING_LINE.search(line)]
    assert not warned, "\n".join(warned)
    if row.script != "resume_after_kill.py":  # there the survivor's step fails, by design
        assert "Traceback" not in out.stderr, out.stderr[-3000:]
    check(out.stdout.splitlines(), tmp_path)


#: The module an example names when its extra is missing, where not the extra's only module.
NAMED = {"megatron": "megatron.core"}


@pytest.mark.parametrize(
    "row", [r for r in TABLE if r.needs is not None], ids=lambda r: r.script.removesuffix(".py")
)
def test_example_without_its_extra_says_what_to_install(row: Row, tmp_path: Path) -> None:
    assert row.needs is not None
    hide = extra_modules(row.needs)
    out = run_as_shown(row.command, tmp_path, timeout=50, hide=hide)
    assert (out.returncode, out.stdout) == (1, ""), (out.returncode, out.stdout, out.stderr)
    module = NAMED.get(row.needs, min(hide))
    assert out.stderr.splitlines() == [
        f"{row.script} needs {module}: pip install 'rrfp-async[{row.needs}]'"
    ]


# ---- in-process runs at small sizes, and the drop-ins against their originals -----------------


def _run(name: str, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Run an example as ``__main__`` in this process; its stdout lines. An exception (or
    ``SystemExit``) from the script fails the test."""
    monkeypatch.setattr(sys, "argv", [name, *argv])
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    return buf.getvalue().splitlines()


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


def _lines(command: str, cwd: Path) -> list[str]:
    out = run_as_shown(command, cwd, timeout=200)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.splitlines()


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_torch_pipelining_dropin_example_matches_torch(tmp_path: Path) -> None:
    # The same script with torch's Schedule1F1B and with the one changed line: the same
    # losses and (with torch's order, --strict) the same parameters to the last digit. The
    # second with the old --spawn: still accepted, and it changes nothing.
    want = _lines("python examples/torch_pipelining_dropin.py --torch --steps 3", tmp_path)
    got = _lines("python examples/torch_pipelining_dropin.py --spawn --strict --steps 3", tmp_path)
    assert len([x for x in want if x.startswith("step ")]) == 3
    assert [x for x in got if x.startswith(("step ", "parameter"))] == [
        x for x in want if x.startswith(("step ", "parameter"))
    ]


@pytest.mark.distributed
@pytest.mark.timeout(500)
def test_megatron_dropin_example_matches_megatron_interleaved(tmp_path: Path) -> None:
    # training.py's call with 2 chunks per rank: megatron's own interleaved schedule and the
    # one changed line train to the same losses (printed to 6 decimals) over 3 steps.
    pytest.importorskip("megatron.core")
    want = _match_all(
        MEGATRON_ROW.pattern,
        _lines("python examples/megatron_dropin.py --vp 2 --megatron", tmp_path),
    )
    got = _match_all(
        MEGATRON_ROW.pattern, _lines("python examples/megatron_dropin.py --vp 2", tmp_path)
    )
    assert [m[1] for m in want] == ["0", "1", "2"]
    assert [m[2] for m in got] == [m[2] for m in want]
    assert want[0][0].startswith("megatron interleaved") and "(interleaved)" in got[0][0]
