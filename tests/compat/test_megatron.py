"""The megatron-core drop-in against megatron-core 0.19's own schedules (the compat tier).

The same cases, worker and comparison as the main suite's (``tests/integrations/
megatron_cases``), here over 0.19's API: ``backward_step`` without ``model_type``, the
factory's ``schedule_pg_collection``, the cross-grid (multi-module) collections it refuses.
Every call style (megatron-core's README, Megatron-LM's ``training.py``, Megatron-Bridge's
``train.py`` / ``eval.py`` with its own process groups and with ``parallel_state``'s) x
1F1B and interleaved (VPP 2) x training, variable lengths and forward-only, at PP 2 and
PP 4: parameters and losses bitwise Megatron's under the strict policy, within 1e-6 under
readiness-first. One spawn per pipeline size serves all its cases.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import pytest

import rrfp_async as rr
from tests._pool import pooled_spawn
from tests.integrations import megatron_cases as mc
from tests.integrations.megatron_cases import Case

# The drop-in's learning (sizes read ahead, bytes and times fitted, the cost-aware plan within
# megatron's bytes), the main suite's tests run here on megatron-core 0.19 too.
from tests.integrations.test_megatron_learning import (  # noqa: F401
    test_one_size_runs_megatrons_order_and_stops_reading_ahead,
    test_variable_lengths_are_learned_and_planned_within_megatrons_bytes,
)


@pytest.fixture(scope="module", autouse=True)
def _megatron() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TE / Apex missing
        pytest.importorskip("megatron.core")


def matrix(pp: int) -> list[Case]:
    """Call styles x schedules x modes at pipeline size ``pp``."""
    m = 8 if pp == 4 else 6
    out: list[Case] = []
    for vp in (None, 2):
        tag = f"pp{pp}-" + ("vpp2" if vp else "1f1b")
        out += [
            Case(f"{tag}-readme-loss_mean-fixed_len", vp=vp, m=m),
            Case(f"{tag}-readme-per_token-variable_len", vp=vp, m=m, kind="tokens", variable=True),
            Case(
                f"{tag}-readme-forward_only-variable_len",
                vp=vp,
                m=m,
                variable=True,
                forward_only=True,
            ),
            Case(
                f"{tag}-training-gpt-per_token-variable_len",
                style="training",
                vp=vp,
                m=m,
                arch="gpt",
                kind="tokens",
                variable=True,
            ),
            Case(
                f"{tag}-training-gpt-forward_only",
                style="training",
                vp=vp,
                m=m,
                arch="gpt",
                kind="tokens_avg",
                forward_only=True,
            ),
            Case(f"{tag}-bridge-mpu_groups-loss_mean", style="bridge", vp=vp, m=m),
            Case(
                f"{tag}-bridge-own_groups-per_token-variable_len-grad_sync",
                style="bridge",
                vp=vp,
                m=m,
                own_groups=True,
                kind="tokens",
                variable=True,
                grad_sync=True,
            ),
            Case(
                f"{tag}-bridge-own_groups-forward_only-variable_len",
                style="bridge",
                vp=vp,
                m=m,
                own_groups=True,
                variable=True,
                forward_only=True,
            ),
        ]
    if pp == 2:  # a group size other than megatron's default (PP), honoured
        out.append(Case("pp2-vpp2-readme-group_size_3", vp=2, m=6, group=3, kind="tokens"))
        # A byte budget (activation_bytes=, memory_budget=) on megatron's 1F1B and interleaved.
        out.append(
            Case("pp2-bytes-per_token-variable_len", kind="tokens", variable=True, nbytes=True)
        )
        out.append(Case("pp2-vpp2-bytes-variable_len", vp=2, m=6, variable=True, nbytes=True))
    return out


PP2, PP4 = matrix(2), matrix(4)
_RUNS: dict[int, Any] = {}


def _results(pp: int, cases: list[Case]) -> Any:
    if pp not in _RUNS:
        _RUNS[pp] = pooled_spawn(mc.worker, pp, pp, cases, timeout=560)
    return _RUNS[pp]


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", PP2, ids=lambda c: c.name)
def test_pp2_same_as_megatron(case: Case) -> None:
    mc.check(_results(2, PP2), case, 2)


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", PP4, ids=lambda c: c.name)
def test_pp4_same_as_megatron(case: Case) -> None:
    mc.check(_results(4, PP4), case, 4)


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_the_comparisons_are_not_vacuous() -> None:
    """Megatron's own runs exercised what is compared, and readiness-first ran out of
    Megatron's order somewhere (while matching it within 1e-6)."""
    res = _results(2, PP2)
    gs = [r["pp2-vpp2-bridge-own_groups-per_token-variable_len-grad_sync"]["megatron"] for r in res]
    assert sorted(gs[0]["grad_syncs"]) == [(0, 6), (1, 6)] and gs[0]["param_syncs"] == [0, 1]
    assert gs[1]["finalized"][0][0] == 2 and gs[1]["finalized"][0][1] > 0
    assert sum(r[c.name]["default"]["deviations"] for r in res for c in PP2) > 0


# ------------------------------------------------------------------ without processes


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", mc.REFUSALS)
def test_unsupported_arguments_are_named(name: str) -> None:
    from rrfp_async.megatron import get_forward_backward_func

    fkw, ckw, named = mc.refusal(name)
    with pytest.raises(rr.PlanError, match=named):
        mc.call_refused(get_forward_backward_func, fkw, ckw)


@pytest.mark.timeout(120)
def test_signatures_are_megatrons() -> None:
    mc.check_signatures()
    params = inspect.signature(mc.megatron_schedules().get_forward_backward_func).parameters
    assert "schedule_pg_collection" in params  # 0.19's factory argument, ours too


@pytest.mark.timeout(120)
def test_megatron_order_is_megatrons_documented_order() -> None:
    mc.check_documented_order()


@pytest.mark.timeout(120)
def test_backward_step_without_model_type() -> None:
    """0.19 dropped ``model_type``: the drop-in calls ``backward_step`` with four arguments."""
    from rrfp_async.integrations._megatron_peer import peer

    assert not peer().backward_takes_model_type
    assert list(inspect.signature(mc.megatron_schedules().backward_step).parameters) == [
        "input_tensor",
        "output_tensor",
        "output_tensor_grad",
        "config",
    ]


@pytest.mark.timeout(120)
def test_cross_grid_collections_are_refused_by_name() -> None:
    from megatron.core.pipeline_parallel.multimodule_communicator import (
        MultiModulePipelineCommunicator,
    )
    from megatron.core.process_groups_config import MultiModuleProcessGroupCollection

    from rrfp_async.megatron import get_forward_backward_func

    mm = object.__new__(MultiModuleProcessGroupCollection)
    with pytest.raises(rr.PlanError, match=r"schedule_pg_collection is a MultiModuleProcess"):
        get_forward_backward_func(schedule_pg_collection=mm)
    comm = object.__new__(MultiModulePipelineCommunicator)
    for kw, named in (
        ({"p2p_communicator": comm, "pg_collection": mc.fake_groups()[1]}, "p2p_communicator"),
        ({"p2p_communicator": mc.fake_groups()[0], "pg_collection": mm}, "pg_collection"),
    ):
        with pytest.raises(rr.PlanError, match=rf"{named} is a MultiModule.*not supported"):
            mc.call_refused(get_forward_backward_func, {"pp_size": 2}, kw)


@pytest.mark.timeout(120)
def test_a_plain_schedule_pg_collection_is_accepted() -> None:
    """training.py passes ``schedule_pg_collection=pg_collection``; megatron ignores a plain
    ``ProcessGroupCollection`` there, and so does the drop-in."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from rrfp_async.megatron import MegatronForwardBackward, get_forward_backward_func

    fb = get_forward_backward_func(2, schedule_pg_collection=ProcessGroupCollection())
    assert isinstance(fb, MegatronForwardBackward) and not fb.interleaved
