"""The megatron drop-in learns from the run with no argument (``_megatron_learning``).

Several training calls of new variable lengths through ``get_forward_backward_func()`` with
nothing but a step timeout, beside megatron's own schedule on a copy of the same model and
data: once the bytes and times are fitted, each call is planned with the cost-aware hint
within the bytes megatron's 1F1B order holds on it, its measured peak never exceeds that
budget, and losses and gradients stay within 1e-6 of megatron's. Calls of one size run
megatron's own order, and after two of them from the start the first stage's data is no
longer read ahead. PP 2 and PP 2 x VPP 2, main environment (megatron-core 0.16).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from rrfp_async import StepPlan, Topology
from rrfp_async.policies import reference_orders
from tests._pool import pooled_spawn
from tests.integrations import megatron_cases as mc
from tests.integrations.megatron_cases import Case

STEPS = 7
M = 8


@pytest.fixture(scope="module", autouse=True)
def _megatron() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TE / Apex missing
        pytest.importorskip("megatron.core")


def _data(
    step: int, uniform: bool, replica: int = 0
) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(mb, x, y, mask)`` per microbatch, megatron's ``[seq, batch, hidden]``; new lengths
    (2-40) every step unless ``uniform``; each data-parallel replica its own."""
    g = torch.Generator().manual_seed(1000 + step + 100 * replica)
    lengths = torch.randint(2, 41, (M,), generator=g).tolist()
    out = []
    for m in range(M):
        s = 12 if uniform else lengths[m]
        x, y = torch.randn(s, mc.B, mc.D, generator=g), torch.randn(s, mc.B, mc.D, generator=g)
        mask = (torch.rand(s, mc.B, generator=g) > 0.3).float()
        out.append((m, x, y, mask))
    return out


class _Reads:
    """The data iterator, noting each ``next`` and each forward in one log."""

    def __init__(self, items: list[Any], log: list[str]) -> None:
        self._items, self._log = iter(items), log

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        item = next(self._items)
        self._log.append("next")
        return item


def _forward_step(log: list[str], dropout: float = 0.0) -> Any:
    def forward_step(data_iterator: Any, model: Any) -> Any:
        _, x, y, mask = next(data_iterator)
        log.append("forward")
        out = model(x)
        if dropout:  # (draws from the global generator in the order the forwards run)
            out = torch.nn.functional.dropout(out, dropout, training=True)

        def loss_func(out: torch.Tensor) -> Any:
            loss = (((out - y) ** 2).sum(-1) * mask).sum()
            n = mask.sum().to(torch.int)
            return loss, n, {"lm loss": torch.stack([loss.detach().clone(), n.float()])}

        return out, loss_func

    return forward_step


def _worker(
    rank: int, world: int, vp: int | None, uniform: bool, pp: int = 2, dropout: float = 0.0
) -> dict[str, Any]:
    from tests.integrations import megatron_cpu

    megatron_cpu.install()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import schedules as mod

    from rrfp_async.megatron import get_forward_backward_func as rr_fb

    ps.initialize_model_parallel(
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp
    )
    pp_rank, replica = ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank()
    case = Case("learn", vp=vp, kind="tokens", variable=True, m=M)
    config = mc._config(case, pp)
    chunks = vp or 1
    nv = pp * chunks
    ours = [mc.make_mlp(config, c * pp + pp_rank, nv) for c in range(chunks)]
    theirs = copy.deepcopy(ours)
    fb = rr_fb(step_timeout=60, measure_activations=True)
    meg = mod.get_forward_backward_func()
    steps: list[dict[str, Any]] = []
    caught: list[str] = []
    for step in range(STEPS):
        data = _data(step, uniform, replica)
        got: dict[str, Any] = {}
        for name, f, models in (("megatron", meg, theirs), ("ours", fb, ours)):
            for mdl in models:
                mdl.zero_grad(set_to_none=True)
            log: list[str] = []
            its: Any = [_Reads(data, log) for _ in models] if vp else _Reads(data, log)
            torch.manual_seed(100 + step)  # (both schedules start from the same state)
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always", RuntimeWarning)
                losses = f(
                    forward_step_func=_forward_step(log, dropout),
                    data_iterator=its,
                    model=models if vp else models[0],
                    num_microbatches=M,
                    seq_length=12,
                    micro_batch_size=mc.B,
                    forward_only=False,
                )
            caught += [str(x.message) for x in w if issubclass(x.category, RuntimeWarning)]
            got[name] = {
                "losses": [d["lm loss"] for d in losses],
                "grads": [p.grad.clone() for mdl in models for p in mdl.parameters()],
                "log": log,
            }
        stats = fb.last_stats
        measured = fb.measured_bytes()
        learned = fb.learned_bytes
        steps.append(
            {
                **got,
                "hint": stats.hint,
                "deviations": stats.deviations,
                "budget": stats.budget_bytes,
                "planned_peak": stats.peak_bytes,
                "measured_peak": stats.held_peak(measured) if measured else None,
                "fitted": learned is not None
                and learned.ready(
                    StepPlan(topology=Topology(stages=pp, chunks=chunks), microbatches=M)
                ),
                "order": [(t.task.kind, t.task.stage, t.task.mb) for t in stats.executed],
            }
        )
    off = fb.learning_off
    fb.close()
    ps.destroy_model_parallel()
    return {
        "rank": pp_rank,
        "replica": replica,
        "steps": steps,
        "learning_off": off,
        "warnings": [c for c in caught if "rrfp_async" in c],
    }


def _close(a: torch.Tensor, b: torch.Tensor, where: Any) -> None:
    """Within 1e-6 of the larger of 1 and the reference's largest magnitude: readiness-first
    changes only the order gradients are summed in (float32 sums of up to 8 x 80 terms)."""
    d = (a - b).abs().max().item()
    scale = max(1.0, b.abs().max().item())
    assert d <= mc.ATOL * scale, (*where, d, scale)


def _check_same_results(res: list[dict[str, Any]]) -> None:
    for r in res:
        for i, s in enumerate(r["steps"]):
            where = (r["rank"], i)
            for a, b in zip(s["ours"]["losses"], s["megatron"]["losses"], strict=True):
                _close(a, b, where)
            for a, b in zip(s["ours"]["grads"], s["megatron"]["grads"], strict=True):
                _close(a, b, where)


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("vp", [None, 2], ids=["pp2", "pp2-vpp2"])
def test_variable_lengths_are_learned_and_planned_within_megatrons_bytes(vp: int | None) -> None:
    res = pooled_spawn(_worker, 2, vp, False, timeout=560)
    _check_same_results(res)
    fitted_steps = 0
    for r in res:
        steps = r["steps"]
        # The first call measures and learns, in megatron's order (nothing fitted yet).
        assert steps[0]["hint"].startswith("megatron"), steps[0]["hint"]
        for i, s in enumerate(steps):
            if s["budget"] is None:
                continue
            assert s["hint"] == "breadth_first_weighted", (r["rank"], i, s["hint"])
            fitted_steps += 1
            # Planned within the budget, and what was measured is what was planned.
            assert s["measured_peak"] is not None and s["planned_peak"] is not None
            assert 0 < s["measured_peak"] <= s["budget"], (r["rank"], i, s)
            assert s["measured_peak"] == s["planned_peak"], (r["rank"], i, s)
        assert steps[-1]["fitted"], r["rank"]
        # The first stage's data was read ahead (all M items before the first forward)
        # on the rank that reads the sizes, and only there.
        log = steps[-1]["ours"]["log"]
        if r["rank"] == 0:
            assert log[: M + 1] == ["next"] * M + ["forward"], log
        # A model that draws no random numbers learns on (nothing said), and its learned
        # plans run the first stage's forwards out of microbatch order.
        assert r["learning_off"] is None and not r["warnings"], r
        if r["rank"] == 0:
            reordered = [
                i
                for i, s in enumerate(steps)
                if _forwards(s["order"]) != sorted(_forwards(s["order"]), key=lambda t: t[1])
            ]
            assert reordered, "no learned plan reordered the forwards"
    assert fitted_steps >= 2 * (STEPS - 3), fitted_steps


def _forwards(order: list[tuple[str, int, int]]) -> list[tuple[int, int]]:
    return [(v, m) for k, v, m in order if k == "F"]


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_a_model_with_dropout_keeps_megatrons_forward_order_and_its_draws() -> None:
    # The learned plan runs heavy microbatches first; a forward that draws (dropout) would
    # then take another microbatch's mask: a result unlike megatron's, with no error. The
    # watch stops learning before any call is planned by it, and says so once.
    res = pooled_spawn(_worker, 2, None, False, 2, 0.2, timeout=560)
    _check_same_results(res)
    for r in res:
        assert r["learning_off"] is not None and "dropout" in r["learning_off"], r
        assert "Megatron's order" in r["learning_off"], r["learning_off"]
        assert len(r["warnings"]) == 1 and "dropout" in r["warnings"][0], r["warnings"]
        for i, s in enumerate(r["steps"]):
            assert s["hint"].startswith("megatron") and s["budget"] is None, (r["rank"], i)
            fs = _forwards(s["order"])
            assert fs == sorted(fs, key=lambda t: t[1]), (r["rank"], i, fs)


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_one_size_runs_megatrons_order_and_stops_reading_ahead() -> None:
    res = pooled_spawn(_worker, 2, None, True, timeout=560)
    _check_same_results(res)
    for r in res:
        for i, s in enumerate(r["steps"]):
            assert s["hint"] == "megatron_1f1b" and s["budget"] is None, (r["rank"], i)
            assert not s["fitted"]
        if r["rank"] == 0:
            first, later = r["steps"][0]["ours"]["log"], r["steps"][-1]["ours"]["log"]
            assert first[: M + 1] == ["next"] * M + ["forward"], first  # read ahead ...
            assert later[:2] == ["next", "forward"], later  # ... only in the first two calls


@pytest.mark.parametrize(
    ("pp", "chunks", "m"), [(2, 1, 8), (4, 1, 8), (3, 1, 5), (2, 2, 4), (4, 2, 8), (4, 2, 12)]
)
def test_megatrons_order_holds_what_the_default_budget_is_taken_from(
    pp: int, chunks: int, m: int
) -> None:
    """The default byte budget is what ``reference_orders`` holds; at megatron's default
    microbatch group size (the pipeline size) megatron's order is that order, task for task
    (so the budget is what megatron's own schedule holds)."""
    from rrfp_async.integrations._megatron_peer import megatron_order

    ref = reference_orders(StepPlan(topology=Topology(stages=pp, chunks=chunks), microbatches=m))
    got = megatron_order(pp, chunks, m, pp, interleaved=chunks > 1)
    assert {r: list(o) for r, o in got.items()} == {r: list(o) for r, o in ref.items()}


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_data_parallel_replicas_learn_together_and_plan_their_own_calls() -> None:
    """PP 2 x DP 2, each replica its own lengths: one fit for the job, each replica's calls
    planned on its own sizes within the bytes megatron's order holds on them."""
    res = pooled_spawn(_worker, 4, None, False, 2, timeout=560)
    _check_same_results(res)
    assert sorted((r["replica"], r["rank"]) for r in res) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in res:
        steps = r["steps"]
        assert steps[-1]["fitted"]
        fitted = [s for s in steps if s["budget"] is not None]
        assert len(fitted) >= STEPS - 3, (r["replica"], r["rank"], len(fitted))
        for s in fitted:
            assert s["hint"] == "breadth_first_weighted"
            assert 0 < s["measured_peak"] <= s["budget"], (r["replica"], r["rank"], s)
            assert s["measured_peak"] == s["planned_peak"], (r["replica"], r["rank"], s)
    first = {r["replica"]: r["steps"] for r in res if r["rank"] == 0}
    assert any(
        (a["order"], a["budget"]) != (b["order"], b["budget"])
        for a, b in zip(first[0], first[1], strict=True)
        if a["budget"] is not None
    )
