"""The objects the drop-ins return look like their peer's (issue 38).

Megatron: the forward-backward function has megatron's function's ``__name__``,
``__qualname__``, ``__module__``, ``__doc__``, ``__annotations__``, ``__wrapped__`` and
signature, so logging, ``functools.wraps`` and ``inspect`` treat it as megatron's; checked
against a stand-in megatron (no megatron-core needed) and against the installed one.

torch: the schedules carry what torch's schedules carry and users read (the audit is in
docs/dropins.md), with torch's values; ``pipeline_order`` is the hint's order, task for task
torch's own when the hint is a torch schedule.
"""

from __future__ import annotations

import functools
import inspect
import types
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rrfp_async.integrations import _megatron_forward_backward as mfb
from rrfp_async.integrations._megatron_peer import MegatronPeer
from tests._pool import pooled_spawn

pytestmark = pytest.mark.timeout(60)

_FACE = ("__module__", "__name__", "__qualname__", "__doc__", "__annotations__")


# ---------------------------------------------------------------------- megatron


def stand_in_1f1b(
    *, forward_step_func: Any, model: Any, num_microbatches: int, forward_only: bool = False
) -> list[Any]:
    """A stand-in megatron 1F1B schedule: only its face is read."""
    raise AssertionError("never called")


def stand_in_interleaved(
    *, forward_step_func: Any, model: list[Any], num_microbatches: int
) -> list[Any]:
    """A stand-in megatron interleaved schedule: only its face is read."""
    raise AssertionError("never called")


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """megatron's schedules module, as far as the forward-backward function reads it."""
    schedules = types.SimpleNamespace(
        forward_backward_pipelining_without_interleaving=stand_in_1f1b,
        forward_backward_pipelining_with_interleaving=stand_in_interleaved,
    )
    fake = MegatronPeer(
        version="stand-in",
        schedules=schedules,
        factory=inspect.Signature(),
        one_f_one_b=inspect.signature(stand_in_1f1b),
        interleaved=inspect.signature(stand_in_interleaved),
        backward_takes_model_type=False,
        forward_takes_vp_stage=True,
    )
    monkeypatch.setattr(mfb, "peer", lambda: fake)
    return schedules


def _made(interleaved: bool) -> mfb.MegatronForwardBackward:
    return mfb.MegatronForwardBackward(
        interleaved=interleaved, pp_size=2, vp_size=2 if interleaved else None
    )


@pytest.mark.parametrize("interleaved", [False, True], ids=["1f1b", "interleaved"])
def test_the_function_wears_the_stand_ins_face(
    stand_in: types.SimpleNamespace, interleaved: bool
) -> None:
    fn = stand_in_interleaved if interleaved else stand_in_1f1b
    fb = _made(interleaved)
    for name in _FACE:
        assert getattr(fb, name) == getattr(fn, name), name
    assert fb.__wrapped__ is fn and inspect.unwrap(fb) is fn
    assert inspect.signature(fb) == inspect.signature(fn)
    assert f"{fb.__module__}.{fb.__qualname__}" == f"{__name__}.{fn.__name__}"


def test_the_class_keeps_its_own_docs(stand_in: types.SimpleNamespace) -> None:
    fb = _made(False)
    cls = mfb.MegatronForwardBackward
    assert cls.__doc__ is not None and cls.__doc__.startswith("The function ``get_forward")
    assert fb.__doc__ == stand_in_1f1b.__doc__
    assert (cls.__name__, cls.__module__) == ("MegatronForwardBackward", mfb.__name__)


def test_functools_wraps_copies_the_face_and_none_of_the_state(
    stand_in: types.SimpleNamespace,
) -> None:
    fb = _made(False)

    @functools.wraps(fb)
    def logged(**kwargs: Any) -> Any:
        return fb(**kwargs)

    for name in _FACE:
        assert getattr(logged, name) == getattr(stand_in_1f1b, name), name
    assert logged.__wrapped__ is fb
    assert inspect.signature(logged) == inspect.signature(stand_in_1f1b)
    # the runtime's state stays on the object: a wrapper gets no stale copy of it
    assert not hasattr(logged, "last_stats") and not hasattr(logged, "interleaved")
    part = functools.update_wrapper(functools.partial(fb), fb)
    assert part.__name__ == "stand_in_1f1b"


def test_repr_says_what_it_is(stand_in: types.SimpleNamespace) -> None:
    text = repr(_made(True))
    assert text.startswith("<MegatronForwardBackward"), text
    assert f"{__name__}.stand_in_interleaved" in text and "policy='readiness_first'" in text


@pytest.mark.parametrize("vp", [None, 2], ids=["1f1b", "interleaved"])
def test_the_function_wears_megatrons_face(vp: int | None) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TE / Apex missing
        schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    from rrfp_async.megatron import get_forward_backward_func

    fn = (
        schedules.forward_backward_pipelining_without_interleaving
        if vp is None
        else schedules.forward_backward_pipelining_with_interleaving
    )
    fb = get_forward_backward_func(2, vp)
    for name in _FACE:
        assert getattr(fb, name) == getattr(fn, name), name
    assert fb.__wrapped__ is fn and inspect.signature(fb) == inspect.signature(fn)
    assert f"{fb.__name__}" == fn.__name__  # what a log line reads


# ---------------------------------------------------------------------- torch


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


# What torch's schedules carry and users read (docs/dropins.md has the audit).
_TORCH_ATTRS = (
    "scale_grads",
    "_n_microbatches",
    "_has_backward",
    "_num_stages",
    "pp_group_size",
    "rank",
    "stage_index_to_group_rank",
    "n_local_stages",
    "num_stages",
    "_backward_requires_autograd",
)
_MISSING = "<missing>"


_COMPUTE = ("FORWARD", "FULL_BACKWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT")


def _face(sched: Any) -> dict[str, Any]:
    out = {a: getattr(sched, a, _MISSING) for a in _TORCH_ATTRS}
    order = sched.pipeline_order
    out["pipeline_order"] = order and {  # compute actions (torch's has REDUCE_GRAD too)
        r: [str(a) for a in acts if a is not None and a.computation_type.name in _COMPUTE]
        for r, acts in order.items()
    }
    stages = getattr(sched, "_stages", None) or [sched._stage]
    out["_stages"] = sorted(s.stage_index for s in stages)
    return out


def faces_worker(rank: int, world: int) -> dict[str, Any]:
    """Each of our schedules next to torch's of the same order, on the same stages."""
    import torch.distributed.pipelining as tp
    from torch.distributed.pipelining import PipelineStage

    from rrfp_async.integrations import _torchtitan as tt
    from rrfp_async.pipelining import ScheduleInterleavedReadinessFirst, ScheduleReadinessFirst
    from rrfp_async.policies import hint_from_torch

    torch.manual_seed(0)
    n = 2 * world
    blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(n)])

    def stages(idx: list[int], total: int) -> list[Any]:
        return [PipelineStage(blocks[i], i, total, torch.device("cpu")) for i in idx]

    one = stages([rank], world)[0]
    loop = stages([rank, rank + world], n)
    vee = stages([rank, n - 1 - rank], n)
    titan = tt.schedule_class("ReadinessFirstInterleaved1F1B")
    cases: dict[str, tuple[Any, Callable[[], Any]]] = {
        "1f1b": (
            tp.Schedule1F1B(one, 4, loss_fn=_loss),
            lambda: ScheduleReadinessFirst(one, 4, loss_fn=_loss, hint=tp.Schedule1F1B),
        ),
        "interleaved": (
            tp.ScheduleInterleaved1F1B(loop, 4, loss_fn=_loss),
            lambda: ScheduleInterleavedReadinessFirst(
                loop, 4, loss_fn=_loss, hint=tp.ScheduleInterleaved1F1B
            ),
        ),
        "zbv": (  # V-shape stages: the default hint is torch's ZB-V order
            tp.ScheduleZBVZeroBubble(vee, 4, loss_fn=_loss),
            lambda: ScheduleInterleavedReadinessFirst(vee, 4, loss_fn=_loss),
        ),
        "titan": (
            tp.ScheduleInterleaved1F1B(loop, 4, loss_fn=_loss),
            lambda: titan(loop, 4, loss_fn=_loss),
        ),
    }
    got: dict[str, Any] = {}
    for name, (theirs, make) in cases.items():
        ours = make()
        got[name] = {"torch": _face(theirs), "ours": _face(ours)}
        if name == "interleaved":
            try:
                ours._load_csv("schedule.csv")
            except Exception as e:
                got["load_csv"] = f"{type(e).__name__}: {e}"
        ours.close()
    default = ScheduleReadinessFirst(one, 4, loss_fn=_loss)
    got["default"] = _face(default)
    default.close()
    _, hint = hint_from_torch(tp.Schedule1F1B, stages=world, microbatches=4)
    got["1f1b_hint"] = {r: [str(t) for t in tasks] for r, tasks in hint.items()}
    return got


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_torch_schedules_carry_torchs_attributes() -> None:
    for r in pooled_spawn(faces_worker, 2, timeout=120):
        # torch 2.13's Schedule1F1B.pipeline_order drops the last rank's F0 (torch never
        # runs that table): a single stage's order is compared with the hint's instead.
        r["1f1b"]["torch"]["pipeline_order"] = r["1f1b_hint"]
        for name in ("1f1b", "interleaved", "zbv", "titan"):
            want, got = r[name]["torch"], r[name]["ours"]
            for attr, value in want.items():
                if value != _MISSING:  # what torch's schedule has, ours has, with its value
                    assert got[attr] == value, (name, attr, got[attr], value)
        assert r["zbv"]["ours"]["pipeline_order"][0][-1].startswith("0W")  # the split kept
        # the default hint without durations is cost-blind: 1F1B's order
        assert r["default"]["pipeline_order"] == r["1f1b_hint"]
        assert r["load_csv"].startswith("PlanError") and "hint=" in r["load_csv"], r["load_csv"]
