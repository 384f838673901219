"""The megatron-core drop-in against Megatron's own schedules, on the main environment's
megatron-core (0.16): 1F1B and interleaved (VPP 2), PP 2 and 4, PP 2 x DP 2, the README,
``training.py`` and Megatron-Bridge call styles, forward-only and variable lengths.

The cases, the worker and the comparison live in ``megatron_cases`` (shared with the compat
tier, which runs the same against megatron-core 0.19); one spawn per process layout serves
all its cases (megatron's import dominates a spawn's cost).
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


@pytest.fixture(scope="module", autouse=True)
def _megatron() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TE / Apex missing
        pytest.importorskip("megatron.core")


PP2 = [
    Case("loss_mean-fixed_len"),
    Case("per_token-variable_len", kind="tokens", variable=True),
    Case("gpt-three_tuple_averaged-fixed_len", arch="gpt", kind="tokens_avg"),
    Case("gpt-per_token-variable_len", style="training", arch="gpt", kind="tokens", variable=True),
    Case("forward_only-variable_len", variable=True, forward_only=True),
    Case("training-gpt-forward_only", style="training", arch="gpt", forward_only=True),
    Case("grad_sync_func", kind="tokens", grad_sync=True),
    Case("bytes-per_token-variable_len", kind="tokens", variable=True, nbytes=True),
    Case("bridge-own_groups", style="bridge", own_groups=True, kind="tokens", variable=True),
    Case("vpp2-loss_mean-fixed_len", vp=2),
    Case(
        "vpp2-training-gpt-per_token-variable_len",
        style="training",
        vp=2,
        arch="gpt",
        kind="tokens",
        variable=True,
    ),
    Case("vpp2-forward_only-variable_len", vp=2, variable=True, forward_only=True),
    Case(
        "vpp2-training-forward_only-variable_len",
        style="training",
        vp=2,
        variable=True,
        forward_only=True,
    ),
    Case("vpp2-bridge-mpu_groups", style="bridge", vp=2),
    Case("vpp2-group_size_3", vp=2, group=3, kind="tokens"),
    Case("vpp2-bytes-variable_len", vp=2, variable=True, nbytes=True),
    Case(
        "vpp2-bridge-own_groups-grad_sync",
        style="bridge",
        vp=2,
        own_groups=True,
        grad_sync=True,
        variable=True,
    ),
]
PP4 = [
    Case(
        "pp4-training-per_token-variable_len", style="training", m=8, kind="tokens", variable=True
    ),
    Case("pp4-vpp2-loss_mean-fixed_len", vp=2, m=8),
    Case("pp4-vpp2-gpt-per_token", style="training", vp=2, m=8, arch="gpt", kind="tokens"),
    Case(
        "pp4-vpp2-bridge-own_groups-forward_only",
        style="bridge",
        vp=2,
        m=8,
        own_groups=True,
        forward_only=True,
        variable=True,
    ),
]
DP2 = [
    Case("dp2-per_token-variable_len", kind="tokens", variable=True),
    Case("dp2-vpp2-bridge-own_groups", style="bridge", vp=2, own_groups=True, kind="tokens"),
]

_RUNS: dict[str, Any] = {}


def _results(name: str, world: int, pp: int, cases: list[Case]) -> Any:
    """One spawn per layout, shared by its cases' tests."""
    if name not in _RUNS:
        _RUNS[name] = pooled_spawn(mc.worker, world, pp, cases, timeout=560)
    return _RUNS[name]


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", PP2, ids=lambda c: c.name)
def test_pp2_same_as_megatron(case: Case) -> None:
    mc.check(_results("pp2", 2, 2, PP2), case, 2)


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", PP4, ids=lambda c: c.name)
def test_pp4_same_as_megatron(case: Case) -> None:
    mc.check(_results("pp4", 4, 4, PP4), case, 4)


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", DP2, ids=lambda c: c.name)
def test_two_data_parallel_pipelines(case: Case) -> None:
    """PP 2 x DP 2: the layout comes from the groups (each rank's groups all-gathered)."""
    res = _results("dp2", 4, 2, DP2)
    # Megatron's default order ("tp-cp-ep-dp-pp") and the Bridge grid's (pp slowest) both
    # make the pipelines ranks {0, 2} and {1, 3}.
    mc.check([res[0], res[2]], case, 2)
    mc.check([res[1], res[3]], case, 2)


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_the_comparisons_are_not_vacuous() -> None:
    """Megatron's own runs exercised what is compared, and readiness-first ran out of
    Megatron's order somewhere (while matching it within 1e-6)."""
    res = _results("pp2", 2, 2, PP2)
    tok = [r["per_token-variable_len"]["megatron"] for r in res]
    assert tok[0]["finalized"] == [(1, 0)] and tok[1]["finalized"][0][1] > 0
    assert tok[1]["events"][0][0] == "enter" and tok[1]["events"][-1][0] == "exit"
    vpp = [r["vpp2-bridge-own_groups-grad_sync"]["megatron"] for r in res]
    assert sorted(vpp[0]["grad_syncs"]) == [(0, 6), (1, 6)] and vpp[0]["param_syncs"] == [0, 1]
    assert all(any(g is not None and g.abs().sum() > 0 for g in r["grads"]) for r in tok)
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


@pytest.mark.timeout(120)
def test_megatron_order_is_megatrons_documented_order() -> None:
    mc.check_documented_order()


def test_schedule_pg_collection_is_refused_where_megatron_has_none() -> None:
    from rrfp_async.megatron import get_forward_backward_func

    params = inspect.signature(mc.megatron_schedules().get_forward_backward_func).parameters
    if "schedule_pg_collection" in params:
        pytest.skip("this megatron-core has schedule_pg_collection (the compat tier tests it)")
    with pytest.raises(rr.PlanError, match=r"schedule_pg_collection: megatron-core .* no such"):
        get_forward_backward_func(pp_size=2, schedule_pg_collection=object())


def test_same_arguments_same_function() -> None:
    """Megatron-LM calls get_forward_backward_func() every step: one stage, not one per step."""
    from rrfp_async.megatron import MegatronForwardBackward, get_forward_backward_func

    fb = get_forward_backward_func(2, policy="strict")
    assert isinstance(fb, MegatronForwardBackward) and not fb.interleaved
    assert get_forward_backward_func(2, policy="strict") is fb
    assert get_forward_backward_func(2) is not fb
    vpp = get_forward_backward_func(2, 2, policy="strict")
    assert vpp.interleaved and vpp is not fb


def test_one_stage_is_megatrons_own_no_pipelining() -> None:
    from rrfp_async.megatron import get_forward_backward_func

    assert get_forward_backward_func(pp_size=1) is (
        mc.megatron_schedules().forward_backward_no_pipelining
    )


def test_import_rrfp_async_does_not_import_megatron() -> None:
    import subprocess
    import sys

    code = "import sys, rrfp_async, rrfp_async.megatron; print('megatron' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
