"""torchtitan 0.3 switches to rrfp_async's schedule by configuration, on its own model.

torchtitan's own llama3 debug model (``llama3_debugmodel``: 6 layers, dim 256, vocab 2048;
sequences of 32 tokens, 4 microbatches of 1 per step) trains for 3 steps, PP 2 on CPU/gloo,
through torchtitan's own ``Trainer`` built from the command-line flags a user gives: once
with torchtitan's 1F1B, then with ours (``--override.imports
rrfp_async.torchtitan.readiness_first --parallelism.pipeline_parallel_schedule
ReadinessFirst``): strict order, the default, and the default with options (a count bound,
a byte budget). All runs are one launch (``torchtitan_worker.py``: torchtitan's import paid
once); the tokenizer and the corpus are written here (no download; torchtitan's test assets
are not in its wheel).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
FACTORY = "rrfp_async.torchtitan.readiness_first"


def _ours(schedule: str, options: dict[str, Any] | None = None) -> list[str]:
    entry = FACTORY if options is None else f"{FACTORY}={json.dumps(options)}"
    return ["--override.imports", entry, "--parallelism.pipeline_parallel_schedule", schedule]


SLOW = {"slow_rank": 1, "slow_s": 0.5, "microbatches": 4}  # each step's first mb late there
RUNS: list[dict[str, Any]] = [
    {"name": "torch_1f1b", "args": ["--parallelism.pipeline_parallel_schedule", "1F1B"]},
    # Before any override ran: imported by hand, not listed.
    {
        "name": "not_listed",
        "import_first": True,
        "args": ["--parallelism.pipeline_parallel_schedule", "ReadinessFirst"],
    },
    {"name": "ours_strict", "args": _ours("ReadinessFirst", {"policy": "strict", "hint": "1F1B"})},
    {"name": "ours_default", "args": _ours("ReadinessFirst"), **SLOW},
    {"name": "ours_wide", "args": _ours("readinessfirst", {"memory_factor": 2}), **SLOW},
    # A byte budget: a factor of the fixed order's measured bytes, and bytes.
    {"name": "ours_bytes", "args": _ours("ReadinessFirst", {"memory_budget": 1.5}), **SLOW},
    {"name": "ours_gib", "args": _ours("ReadinessFirst", {"memory_budget": "1GiB"})},
    # A user's own config registry (examples/torchtitan_config.py), no flags of ours.
    {
        "name": "user_config",
        "config": ["torchtitan_config", "llama3_debugmodel_readiness_first"],
        "args": [],
    },
    {"name": "user_config_8b", "inspect": ["torchtitan_config", "llama3_8b_readiness_first"]},
    {"name": "bad_option", "args": _ours("ReadinessFirst", {"polcy": "strict"})},
    {"name": "vshape", "args": _ours("ReadinessFirstZBVZeroBubble")},
    {"name": "split_on_fsdp", "args": _ours("ReadinessFirstZBH1")},
]


def write_assets(root: Path) -> None:
    """A WordLevel tokenizer of 500 words (+ BOS/EOS/UNK) and a 200-document corpus, in the
    layouts torchtitan reads (``tokenizer.json`` + ``tokenizer_config.json``; a local
    ``datasets`` JSON directory for ``c4_test``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    (root / "tokenizer").mkdir(parents=True)
    (root / "c4_test").mkdir()
    words = [f"w{i}" for i in range(500)]
    vocab = {"<unk>": 0, "<|begin_of_text|>": 1, "<|end_of_text|>": 2}
    vocab.update({w: i + 3 for i, w in enumerate(words)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(root / "tokenizer" / "tokenizer.json"))
    (root / "tokenizer" / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"})
    )
    rng = random.Random(0)
    with open(root / "c4_test" / "data.json", "w") as f:
        for _ in range(200):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(10, 80)))
            f.write(json.dumps({"text": text}) + "\n")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Every run's per-rank results, from one launch of two processes."""
    from rrfp_async.distributed._spawn import free_port

    tmp = tmp_path_factory.mktemp("torchtitan")
    assets, out = tmp / "assets", tmp / "out"
    write_assets(assets)
    out.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT), str(ROOT / "examples"), os.environ.get("PYTHONPATH", "")]
        ),
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        str(HERE / "torchtitan_worker.py"), str(assets), str(out), json.dumps(RUNS),
    ]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    print(f"torchtitan launch: {len(RUNS)} runs in {time.perf_counter() - t0:.1f} s")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    got = {}
    for spec in RUNS:
        got[spec["name"]] = [
            json.loads((out / f"{spec['name']}.{r}.json").read_text()) for r in range(2)
        ]
    return got


def _ok(rs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for r in rs:
        assert "error" not in r, r["error"]["traceback"]
    return rs


def test_strict_order_gives_torchtitans_losses_and_parameters_bitwise(runs: Any) -> None:
    ref, got = _ok(runs["torch_1f1b"]), _ok(runs["ours_strict"])
    for rank in range(2):
        # Ours, through torchtitan's own lookup and constructor call; torch's was torch's.
        assert ref[rank]["schedule"][0] == "Schedule1F1B"
        assert got[rank]["schedule"][:2] == ["ScheduleReadinessFirst"] * 2
        assert got[rank]["module"] == "rrfp_async.torchtitan"
        assert {s["policy"] for s in got[rank]["steps"]} == {"strict"}
        assert got[rank]["step_timeout"] == 300.0  # torchtitan's first-step allowance
        assert got[rank]["losses"] == ref[rank]["losses"]
        assert got[rank]["params"] == ref[rank]["params"]
    assert len(ref[1]["losses"]) == 3 and all(x > 0 for x in ref[1]["losses"])


def test_readiness_first_default_within_1e6_of_torchtitans_losses(runs: Any) -> None:
    ref, got = _ok(runs["torch_1f1b"]), _ok(runs["ours_default"])
    for rank in range(2):
        steps = got[rank]["steps"]
        assert {(s["policy"], s["hint"]) for s in steps} == {
            ("readiness_first", "breadth_first_weighted")
        }
        assert got[rank]["losses"] == pytest.approx(ref[rank]["losses"], abs=1e-6, rel=0)


def test_override_options_reach_the_schedule(runs: Any) -> None:
    # memory_factor 2 doubles rank 0's admission bound; with rank 1 late on each step's
    # first microbatch, readiness-first then runs out of the hint's order (not vacuous).
    ref, strict, got = _ok(runs["torch_1f1b"]), runs["ours_strict"], _ok(runs["ours_wide"])
    bound = strict[0]["steps"][0]["max_inflight"]
    assert {s["max_inflight"] for s in got[0]["steps"]} == {2 * bound}
    assert sum(s["deviations"] for r in got for s in r["steps"]) > 0
    for rank in range(2):
        assert got[rank]["losses"] == pytest.approx(ref[rank]["losses"], abs=1e-6, rel=0)


def test_a_byte_budget_is_learned_on_torchtitans_fsdp_stages(runs: Any) -> None:
    # torchtitan's microbatches are one size (packed to seq_len): the first step is measured
    # (on FSDP-wrapped stages: DTensor parameters), and the steps after it are planned in
    # those bytes: 1.5x what 1F1B holds, or the bytes given.
    ref, strict = _ok(runs["torch_1f1b"]), runs["ours_strict"]
    factor, gib = _ok(runs["ours_bytes"]), _ok(runs["ours_gib"])
    for rank in range(2):
        bound = strict[rank]["steps"][0]["max_inflight"]  # 1F1B's: 2 on rank 0, 1 on rank 1
        first, *rest = factor[rank]["steps"]
        assert first["budget_bytes"] == int(1.5 * bound)  # nothing measured yet: the count
        for s in rest:
            assert s["budget_bytes"] > 1000 and s["peak_bytes"] <= s["budget_bytes"], s
        assert factor[rank]["learned"]["steps"] == 1  # one size: measured once, then known
        assert gib[rank]["steps"][0]["budget_bytes"] is None  # before: the count bound
        for s in gib[rank]["steps"][1:]:
            assert s["budget_bytes"] == 2**30 and s["peak_bytes"] <= 2**30, s
        for run in (factor, gib):
            assert run[rank]["losses"] == pytest.approx(ref[rank]["losses"], abs=1e-6, rel=0)


def test_a_users_config_registry_switches_too(runs: Any) -> None:
    # examples/torchtitan_config.py: the schedule name and the override set in Python
    ref, got = _ok(runs["torch_1f1b"]), _ok(runs["user_config"])
    for rank in range(2):
        assert got[rank]["module"] == "rrfp_async.torchtitan"
        assert {(s["policy"], s["hint"]) for s in got[rank]["steps"]} == {
            ("readiness_first", "torch:Schedule1F1B")
        }
        assert got[rank]["losses"] == pytest.approx(ref[rank]["losses"], abs=1e-6, rel=0)


def test_the_8b_example_config_names_an_interleaved_schedule(runs: Any) -> None:
    got = runs["user_config_8b"][0]
    assert got["schedule_name"] == "InterleavedReadinessFirst" and got["pp"] == 4
    assert got["schedule"][1] == "ScheduleInterleavedReadinessFirst"
    assert got["imports"] == [[FACTORY, {"memory_factor": 1.5}]]


@pytest.mark.parametrize(
    ("run", "error", "words"),
    [
        ("not_listed", "PlanError", "never applied rrfp_async.torchtitan.readiness_first"),
        ("bad_option", "PlanError", "unknown option(s) ['polcy']"),
        ("vshape", "PlanError", "V-shape placement is not offered through torchtitan"),
        ("split_on_fsdp", "PlanError", "not supported on FSDP-wrapped modules"),
    ],
)
def test_what_is_not_supported_is_refused_by_name(
    runs: Any, run: str, error: str, words: str
) -> None:
    for r in runs[run]:
        assert r.get("error", {}).get("type") == error, r
        assert words in r["error"]["message"], r["error"]["message"]


@pytest.mark.timeout(120)
def test_import_rrfp_async_never_imports_torchtitan() -> None:
    code = (
        "import sys, rrfp_async, rrfp_async.pipelining, rrfp_async.integrations;"
        "assert 'torchtitan' not in sys.modules, 'torchtitan imported'"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=100)
