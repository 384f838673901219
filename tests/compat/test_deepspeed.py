"""DeepSpeed's pipeline engine switched with one line (``rrfp_async.deepspeed.install()``),
against DeepSpeed's own engine on the same model, data and seeds.

``deepspeed_worker.py`` trains each configuration three times in one launch (DeepSpeed's
``PipelineEngine``; ours with ``policy="strict"``, DeepSpeed's own order; ours by default,
readiness-first) and saves each rank's losses, eval output and parameters. A gpt-neox-shaped
model (``TiedLayerSpec`` embedding shared by the first and last stage, ``(hidden, bool
mask)`` tuples between stages, ``set_has_attention_mask``, a ``set_batch_fn``), dropout on,
gradient clipping, a warm-up LR scheduler; the matrix: fp32 / bf16 (fp16 where DeepSpeed's
CPU accelerator supports it), ZeRO-0 / ZeRO-1, SGD / AdamW, activation checkpointing
(reentrant and not), ``dynamic_shape`` with variable lengths, PP 2, PP 4, PP 2 x DP 2.
``strict`` must equal DeepSpeed bit for bit; the default within 1e-6 (it is bitwise too
where it kept DeepSpeed's order); in the ``jitter`` configuration, whose forwards take time
by length, the default must have learned and run another order than DeepSpeed's, and with
dropout (``jitter_dropout``) kept DeepSpeed's forward order.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

torch = pytest.importorskip("torch")
pytest.importorskip("deepspeed")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WORKER = HERE / "deepspeed_worker.py"

TWO = ["base", "adamw_zero1", "checkpointing", "bf16", "fp16", "dynamic"]
FOUR = [
    "pp4_tied",
    "pp4_bf16_ckpt",
    "pp2_dp2_zero1",
    "pp2_dp2_dynamic_fp16",
    "jitter",
    "jitter_dropout",
]
ERRORS_TWO = ["patched_schedule", "patched_schedule_hint", "dry", "gas_mismatch", "zero2"]
ERRORS_FOUR = ["tensor_parallel", "dry"]
TOL = 1e-6


def _launch(out: Path, world: int, args: list[str]) -> None:
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", str(world), str(WORKER), str(out), *args]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=800)
    if r.returncode != 0:
        tail = "\n".join((r.stdout + r.stderr).splitlines()[-60:])
        raise AssertionError(f"the job failed ({r.returncode}):\n{tail}")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("deepspeed")
    _launch(out, 2, TWO)
    _launch(out, 4, FOUR)
    _launch(out, 2, ["--errors", *ERRORS_TWO])
    (out / "four").mkdir()
    _launch(out / "four", 4, ["--errors", *ERRORS_FOUR])
    return out


def _load(out: Path, name: str, kind: str) -> list[dict[str, Any]]:
    files = sorted(out.glob(f"{name}.{kind}.*.pt"))
    return [torch.load(f) for f in files]


@pytest.mark.parametrize("name", TWO + FOUR)
def test_strict_is_deepspeed_bit_for_bit_and_readiness_first_within_tolerance(
    results: Path, name: str
) -> None:
    ref = _load(results, name, "deepspeed")
    if not ref:
        assert name.endswith("fp16") or name == "fp16", name
        assert (results / "fp16_supported").read_text() == "False"
        pytest.skip("fp16: DeepSpeed's CPU accelerator refuses it on this processor")
    strict = _load(results, name, "strict")
    ours = _load(results, name, "readiness_first")
    assert len(ref) == len(strict) == len(ours) >= 2
    for r, (a, s, o) in enumerate(zip(ref, strict, ours, strict=True)):
        assert s["losses"] == a["losses"], (r, s["losses"], a["losses"])
        assert s["eval"] == a["eval"] and s["eval2"] == a["eval2"], r
        assert (s["logits"] is None) == (a["logits"] is None), r
        if a["logits"] is not None:  # (the last stage's)
            assert torch.equal(s["logits"], a["logits"]), r
            assert torch.allclose(o["logits"], a["logits"], rtol=0, atol=TOL), r
        assert a["params"].keys() == s["params"].keys() == o["params"].keys()
        for k, v in a["params"].items():
            assert torch.equal(s["params"][k], v), (r, k)
            assert torch.allclose(o["params"][k], v, rtol=0, atol=TOL), (r, k)
        for x, y in zip(o["losses"], a["losses"], strict=True):
            assert abs(x - y) <= TOL * max(1.0, abs(y)), (r, o["losses"], a["losses"])
        assert abs(o["eval"] - a["eval"]) <= TOL * max(1.0, abs(a["eval"])), r
        assert abs(o["eval2"] - a["eval2"]) <= TOL * max(1.0, abs(a["eval2"])), r
        assert s["deviations"] == 0, r
    # The model learned something: the loss moved over the steps (the last one a batch of
    # 2 microbatches, after set_train_batch_size).
    assert ref[0]["losses"][0] != ref[0]["losses"][-2]
    assert len(ref[0]["losses"]) == 4


def test_the_default_learns_and_leaves_deepspeeds_order_where_forwards_vary(
    results: Path,
) -> None:
    """Variable lengths whose forwards take time by length, no dropout: once the fits are
    ready the default plans the batch (cost-aware, within DeepSpeed's bytes), and some
    stage runs another order than DeepSpeed's; the result stays within tolerance (above)."""
    ours = _load(results, "jitter", "readiness_first")
    assert all(o["learning_off"] is None for o in ours)
    assert sum(o["reordered"] for o in ours) > 0


def test_a_model_with_dropout_keeps_deepspeeds_forward_order(results: Path) -> None:
    """The same with dropout: a reordered forward would draw another microbatch's random
    numbers, so the default stops learning (said once, a RuntimeWarning) and runs
    DeepSpeed's order readiness-first: bit for bit DeepSpeed's result here."""
    ours = _load(results, "jitter_dropout", "readiness_first")
    ref = _load(results, "jitter_dropout", "deepspeed")
    for o, a in zip(ours, ref, strict=True):
        assert o["learning_off"] is not None and "dropout" in o["learning_off"]
        assert o["reordered"] == 0
        assert o["losses"] == a["losses"]
        assert all(torch.equal(o["params"][k], v) for k, v in a["params"].items())


def _errors(out: Path, case: str) -> list[dict[str, Any]]:
    files = sorted(out.glob(f"error.{case}.*.json"))
    return [json.loads(f.read_text()) for f in files]


def test_a_patched_train_schedule_is_refused_by_name_on_every_rank(results: Path) -> None:
    got = _errors(results, "patched_schedule")
    assert len(got) == 2
    for e in got:
        assert e["type"] == "PlanError", e
        assert "TrainSchedule whose steps() was replaced" in e["message"], e
        assert "uninstall()" in e["message"]


def test_a_patched_train_schedule_runs_when_install_gives_the_order(results: Path) -> None:
    got = _errors(results, "patched_schedule_hint")
    assert len(got) == 2
    assert all(e["type"] == "none" for e in got), got


@pytest.mark.parametrize("four", [False, True])
def test_a_data_iter_that_runs_dry_mid_step_is_a_typed_error_on_every_rank(
    results: Path, four: bool
) -> None:
    got = _errors(results / "four" if four else results, "dry")
    assert len(got) == (4 if four else 2)
    for e in got:
        assert e["module"] == "rrfp_async._errors", e
        assert "data_iter ran out at microbatch 2 of 4" in e["message"], e
        assert "RepeatingLoader" in e["message"]


def test_mismatched_gradient_accumulation_steps_are_refused_on_every_rank(
    results: Path,
) -> None:
    got = _errors(results, "gas_mismatch")
    assert len(got) == 2
    for e in got:
        assert e["type"] == "PlanError", e
        assert "rank 0 has microbatches=2; rank 1 has microbatches=4" in e["message"], e


def test_a_zero_stage_the_pipeline_engine_refuses_is_a_plan_error(results: Path) -> None:
    got = _errors(results, "zero2")
    assert len(got) == 2
    for e in got:
        assert e["type"] == "PlanError", e
        assert "zero_optimization.stage 2" in e["message"], e


def test_tensor_parallel_topologies_are_refused_by_name(results: Path) -> None:
    got = _errors(results / "four", "tensor_parallel")
    assert len(got) == 4
    for e in got:
        assert e["type"] == "PlanError", e
        assert "tensor (model) parallelism" in e["message"], e


def test_install_and_uninstall_switch_the_engine_deepspeed_builds() -> None:
    import deepspeed

    import rrfp_async.deepspeed as rr_ds
    from rrfp_async.errors import PlanError

    stock = deepspeed.PipelineEngine
    assert not rr_ds.installed()
    opts = rr_ds.install(policy="strict", memory_factor=2)
    try:
        assert rr_ds.installed()
        assert deepspeed.PipelineEngine is rr_ds.engine_class()
        assert issubclass(rr_ds.engine_class(), stock)
        assert opts.policy == "strict" and opts.memory_factor == 2
        with pytest.raises(PlanError, match="DualPipeVModule"):
            deepspeed.DualPipeVEngine()
    finally:
        rr_ds.uninstall()
    assert deepspeed.PipelineEngine is stock
    assert not rr_ds.installed()
    with pytest.raises(PlanError, match="memory_factor"):
        rr_ds.install(memory_factor=0)
    with pytest.raises(PlanError, match="step_timeout"):
        rr_ds.install(step_timeout="forever")  # type: ignore[arg-type]
    assert not rr_ds.installed()


def test_deepspeeds_order_is_read_from_its_own_schedule() -> None:
    from rrfp_async.deepspeed import deepspeed_order

    order = deepspeed_order(2, 4)
    # DeepSpeed's 1F1B warms up with P - s forwards (Megatron's with P - s - 1).
    assert [str(t) for t in order[0]] == ["0F0", "0F1", "0B0", "0F2", "0B1", "0F3", "0B2", "0B3"]
    assert [str(t) for t in order[1]] == ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2", "1F3", "1B3"]
    fwd = deepspeed_order(3, 2, forward_only=True)
    assert [str(t) for t in fwd[2]] == ["2F0", "2F1"]
    # It is the runtime's own 1f1b hint, task for task (so the default byte budget, what
    # strict 1f1b holds on the batch, is DeepSpeed's bytes).
    from rrfp_async import StepPlan, Topology
    from rrfp_async.policies import HINTS

    for p, m in [(2, 4), (4, 3), (4, 16), (8, 32)]:
        plan = StepPlan(topology=Topology(stages=p), microbatches=m)
        ours = HINTS["1f1b"](plan, None)
        assert {r: list(t) for r, t in ours.items()} == deepspeed_order(p, m)


def test_the_example_trains_as_deepspeeds_engine_does(tmp_path: Path) -> None:
    """``examples/deepspeed_dropin.py`` (README's table) with the one line, and with
    ``--deepspeed`` (DeepSpeed's own engine): the same losses (the example has no dropout:
    the default learns and may reorder; within tolerance)."""
    import re

    def losses(*args: str) -> list[float]:
        r = subprocess.run(
            [sys.executable, str(ROOT / "examples" / "deepspeed_dropin.py"), *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=400,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
        rows = re.findall(r"(\w+) step (\d): loss (\S+)", r.stdout)
        assert [int(s) for _, s, _ in rows] == [0, 1, 2, 3], r.stdout
        want = "PipelineEngine" if args else "ReadinessFirstPipelineEngine"
        assert {name for name, _, _ in rows} == {want}, rows
        return [float(x) for _, _, x in rows]

    ours, theirs = losses(), losses("--deepspeed")
    assert ours == pytest.approx(theirs, rel=1e-6, abs=1e-6)
    assert ours[-1] < ours[0]
