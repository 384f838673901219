"""rrfp_async.torchtitan without torchtitan: the names, the override factory, the patching.

The schedule names and the factory need torch only; ``install`` is run against stand-in
torchtitan modules (what it patches, what it refuses when a feature is missing). torchtitan
itself trains through them in tests/compat/test_torchtitan.py.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import types
from typing import Any

import pytest
import torch.distributed.pipelining as tp
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

import rrfp_async as rr
from rrfp_async.integrations import _torchtitan as tt
from rrfp_async.pipelining import ScheduleInterleavedReadinessFirst, ScheduleReadinessFirst

pytestmark = pytest.mark.timeout(60)


def test_names_resolve_to_our_kinds_with_their_hints_bound() -> None:
    single = tt.schedule_class("ReadinessFirst")
    assert issubclass(single, ScheduleReadinessFirst)
    assert issubclass(single, PipelineScheduleSingle) and single._default_hint is None
    multi = tt.schedule_class("InterleavedReadinessFirst")
    assert issubclass(multi, ScheduleInterleavedReadinessFirst)
    assert issubclass(multi, PipelineScheduleMulti)
    # torch's orders: torch's class as the hint, in torch's kind
    assert tt.schedule_class("ReadinessFirst1F1B")._default_hint is tp.Schedule1F1B
    loop = tt.schedule_class("ReadinessFirstInterleaved1F1B")
    assert loop._default_hint is tp.ScheduleInterleaved1F1B
    assert issubclass(loop, ScheduleInterleavedReadinessFirst)
    # ours, by name or alias, any case, with or without separators: one class per name
    bfw = tt.schedule_class("InterleavedReadinessFirstBFW")
    assert bfw._default_hint == "bfw" and issubclass(bfw, ScheduleInterleavedReadinessFirst)
    assert tt.schedule_class("interleaved_readiness_first-bfw") is bfw
    assert tt.schedule_class("READINESSFIRSTBREADTHFIRSTWEIGHTED")._default_hint == (
        "breadth_first_weighted"
    )
    assert tt.schedule_class("ReadinessFirst") is single


def test_every_listed_name_resolves_and_others_go_to_torch() -> None:
    names = tt.schedule_names()
    assert {"ReadinessFirst", "InterleavedReadinessFirst", "ReadinessFirstBFW"} <= set(names)
    for name in names:
        cls = tt.schedule_class(name)
        assert cls.rrfp_schedule_name == name
    assert tt.schedule_class("1F1B") is tp.Schedule1F1B
    assert tt.schedule_class("interleaved1f1b") is tp.ScheduleInterleaved1F1B
    with pytest.raises(ValueError, match="Unknown schedule name"):  # torch's own refusal
        tt.schedule_class("Nope")


def test_names_that_name_nothing_or_v_shape_are_refused() -> None:
    with pytest.raises(rr.PlanError, match=r"no schedule of that name.*ReadinessFirstBFW"):
        tt.schedule_class("ReadinessFirstNope")
    # our gpipe orders one stage per rank: not a multi-stage name
    with pytest.raises(rr.PlanError, match="no schedule of that name"):
        tt.schedule_class("InterleavedReadinessFirstGPipe")
    for v in ("ReadinessFirstZBVZeroBubble", "readinessfirstdualpipev"):
        with pytest.raises(rr.PlanError, match=r"V-shape placement is not offered.*FSDP"):
            tt.schedule_class(v)
        assert v not in tt.schedule_names()


def test_a_hint_that_needs_the_split_backward_gets_it() -> None:
    cls = tt.schedule_class("ReadinessFirstZBH1")
    assert cls._default_hint == "zb_h1"


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tt, "_options", {})
    monkeypatch.setattr(tt, "_applied", False)
    monkeypatch.setattr(tt, "_installed", False)


@pytest.mark.usefixtures("fresh")
def test_the_factory_records_checked_options_and_returns_the_config() -> None:
    node = object()
    assert tt.readiness_first(node, policy="strict", memory_factor=2, step_timeout=None) is node
    assert tt.schedule_options() == {"policy": "strict", "memory_factor": 2, "step_timeout": None}
    assert tt.readiness_first(node) is node
    assert tt.schedule_options() == {}  # each application starts afresh
    tt.readiness_first(node, policy=None, hint=None, step_timeout=None)  # JSON null
    assert tt.schedule_options() == {"step_timeout": None}  # the default, or no watchdog
    with pytest.raises(rr.PlanError, match=r"unknown option\(s\) \['polcy', 'x'\]"):
        tt.readiness_first(node, polcy="strict", x=1)
    with pytest.raises(rr.PlanError, match="memory_factor must be > 0"):
        tt.readiness_first(node, memory_factor=-1)
    with pytest.raises(rr.PlanError, match="split_backward must be True or False"):
        tt.readiness_first(node, split_backward="yes")
    with pytest.raises(rr.errors.PolicyError, match="unknown policy"):
        tt.readiness_first(node, policy="nope")
    with pytest.raises(rr.PlanError, match="neither an rrfp_async hint nor a torch schedule"):
        tt.readiness_first(node, hint="nope")
    tt.readiness_first(node, hint="Interleaved1F1B")  # torch's name: accepted
    tt.readiness_first(node, hint="BFW")


@pytest.mark.usefixtures("fresh")
def test_the_factory_takes_a_byte_budget_checked_as_the_torch_drop_in_checks_it() -> None:
    assert "memory_budget" in tt.OPTIONS
    for budget in (1.5, 4096, "24GiB", "512 MB", [1.0, "2GiB"], [None, 2.0]):
        tt.readiness_first(None, memory_budget=budget)
        assert tt.schedule_options() == {"memory_budget": budget}
    tt.readiness_first(None, memory_budget=None)  # JSON null: the default (no byte budget)
    assert tt.schedule_options() == {}
    for bad, words in [
        ("lots", r"memory_budget='lots' is no size"),
        ("24 GiBs", r"memory_budget='24 GiBs' is no size"),
        (0, r"memory_budget=0: a budget must be a finite number > 0"),
        (-1.5, r"memory_budget=-1.5: a budget must be"),
        (float("nan"), r"memory_budget=nan: a budget must be"),
        (True, r"memory_budget must be a float factor .* got True"),
        ({"a": 1}, r"memory_budget must be a float factor"),
        ([], r"memory_budget needs one value per rank \(>= 1\), got 0"),
        ([1.0, "x"], r"memory_budget\[1\]='x' is no size"),
    ]:
        with pytest.raises(rr.PlanError, match=words):
            tt.readiness_first(None, memory_budget=bad)
        assert tt.schedule_options() == {}  # a refused application records nothing
    with pytest.raises(rr.PlanError, match=r"memory_budget .* or memory_factor .* not both"):
        tt.readiness_first(None, memory_budget=1.5, memory_factor=2)


@pytest.mark.usefixtures("fresh")
def test_schedules_made_by_name_are_built_with_the_options(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: dict[str, Any] = {}

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        seen.update(kwargs, args=args)

    monkeypatch.setattr(ScheduleReadinessFirst, "__init__", init)
    tt.readiness_first(None, policy="strict", memory_factor=2.0)
    tt.schedule_class("ReadinessFirst")("stage", n_microbatches=4, scale_grads=False)
    assert seen == {
        "args": ("stage",),
        "n_microbatches": 4,
        "scale_grads": False,
        "policy": "strict",
        "memory_factor": 2.0,
        "step_timeout": tt.TITAN_STEP_TIMEOUT,
    }
    seen.clear()
    tt.schedule_class("ReadinessFirstZBH1")("stage", n_microbatches=4)
    assert seen["split_backward"] is True
    # the byte budget reaches the torch drop-in as given (it learns the bytes there)
    tt.readiness_first(None, memory_budget="24GiB")
    seen.clear()
    tt.schedule_class("ReadinessFirstBFW")("stage", n_microbatches=4)
    assert seen["memory_budget"] == "24GiB" and "memory_factor" not in seen
    # a hint in the name and another in the options contradict each other
    tt.readiness_first(None, hint="gpipe")
    with pytest.raises(rr.PlanError, match="has its hint in its name"):
        tt.schedule_class("ReadinessFirst1F1B")("stage", n_microbatches=4)


def fake_torchtitan(monkeypatch: pytest.MonkeyPatch, *, lookup: bool = True) -> types.ModuleType:
    """Stand-ins for the torchtitan modules ``install`` reads (the shapes of 0.3.0)."""
    mods: dict[str, types.ModuleType] = {}
    for name in (
        "torchtitan",
        "torchtitan.distributed",
        "torchtitan.distributed.pipeline_parallel",
        "torchtitan.config",
        "torchtitan.config.override",
        "torchtitan.tools",
        "torchtitan.tools.profiler",
        "torchtitan.trainer",
    ):
        mods[name] = types.ModuleType(name)
        monkeypatch.setitem(sys.modules, name, mods[name])
    mods["torchtitan"].__version__ = "9.9.9"  # type: ignore[attr-defined]
    pp = mods["torchtitan.distributed.pipeline_parallel"]
    if lookup:

        def get_schedule_class(schedule_name: str) -> Any:
            return {"1f1b": tp.Schedule1F1B}[schedule_name.lower()]

        pp.get_schedule_class = get_schedule_class  # type: ignore[attr-defined]
    registry: dict[str, Any] = {}

    def override(*, target: type, fqns: list[str], description: str) -> Any:
        def deco(fn: Any) -> Any:
            registry[f"{fn.__module__}.{fn.__name__}"] = (target, fqns, fn)
            return fn

        return deco

    ov = mods["torchtitan.config.override"]
    ov.override = override  # type: ignore[attr-defined]
    ov._REGISTRY = registry  # type: ignore[attr-defined]

    class Profiler:
        @dataclasses.dataclass
        class Config:
            enable: bool = False

    mods["torchtitan.tools.profiler"].Profiler = Profiler  # type: ignore[attr-defined]

    class Trainer:
        @dataclasses.dataclass
        class Config:
            profiler: Any = None

        closed = 0

        def close(self) -> None:
            Trainer.closed += 1

    mods["torchtitan.trainer"].Trainer = Trainer  # type: ignore[attr-defined]
    return pp


@pytest.mark.usefixtures("fresh")
def test_install_patches_the_lookup_and_registers_the_factory_by_the_faces_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pp = fake_torchtitan(monkeypatch)
    tt.install()
    lookup = pp.get_schedule_class
    assert lookup("1F1B") is tp.Schedule1F1B  # torch's names unchanged
    with pytest.raises(
        rr.PlanError, match=r"never applied rrfp_async\.torchtitan\.readiness_first"
    ):
        lookup("ReadinessFirst")
    reg = sys.modules["torchtitan.config.override"]._REGISTRY
    target, fqns, fn = reg["rrfp_async.torchtitan.readiness_first"]
    assert target is sys.modules["torchtitan.tools.profiler"].Profiler.Config
    assert fqns == ["profiler"] and fn is tt.readiness_first
    fn(None)  # what torchtitan's apply_overrides does
    assert issubclass(lookup("ReadinessFirst"), ScheduleReadinessFirst)
    tt.install()  # idempotent
    assert pp.get_schedule_class is lookup

    # Trainer.close closes a schedule of ours first (torchtitan never closes its schedule)
    Trainer = sys.modules["torchtitan.trainer"].Trainer
    closed: list[str] = []
    sched = ScheduleReadinessFirst.__new__(ScheduleReadinessFirst)
    monkeypatch.setattr(ScheduleReadinessFirst, "close", lambda self: closed.append("ours"))
    trainer = Trainer()
    trainer.pp_schedule = sched
    trainer.close()
    assert closed == ["ours"] and Trainer.closed == 1


@pytest.mark.usefixtures("fresh")
def test_a_torchtitan_without_what_is_patched_is_refused_naming_its_version(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_torchtitan(monkeypatch, lookup=False)
    with pytest.raises(rr.PlanError, match=r"torchtitan 9\.9\.9 has no .*get_schedule_class"):
        tt.install()


def test_without_torchtitan_the_face_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchtitan", None)  # not importable
    monkeypatch.delitem(sys.modules, "rrfp_async.torchtitan", raising=False)
    monkeypatch.setattr(tt, "_installed", False)
    with pytest.raises(rr.errors.ExtraMissingError, match="needs torchtitan installed"):
        importlib.import_module("rrfp_async.torchtitan")
