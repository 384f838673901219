"""The megatron-core drop-in's message for a ``data_iterator`` that runs dry, end to end: a
Megatron-LM style ``forward_step_func`` (``next(data_iterator)``) on PP 2, given fewer items
than ``num_microbatches``. Before the fix the item read raised ``StopIteration`` from inside
the task, which PEP 479 turns into a bare ``RuntimeError`` (or a hung future) once it
reaches a coroutine; now the step fails with a ``PlanError`` that says how many items the
iterator gave of how many it needed, and the fix, on every rank (issue 41: the other rank's
``PeerPlanError`` is a ``PlanError`` too).

The two paths where a ``StopIteration`` still escaped (issue 41): a ``data_iterator`` that is
a generator whose body lets an inner iterator's ``StopIteration`` out (PEP 479's bare
``RuntimeError: generator raised StopIteration``), and a ``forward_step_func`` that reads an
iterator of its own, not its ``data_iterator`` argument (the compute thread's ``RuntimeError:
StopIteration raised``).

The pure part (the counting, the message) is ``tests/test_error_messages.py``.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

from tests._pool import pooled_spawn
from tests.integrations import megatron_cases as mc


@pytest.fixture(scope="module", autouse=True)
def _megatron() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TE / Apex missing
        pytest.importorskip("megatron.core")


M, GIVEN = 6, 3  # num_microbatches, items the data iterator holds


def _generator(items: list[Any]) -> Iterator[Any]:
    """A data iterator written with a classic slip: ``next(inner)`` in a ``while True``
    generator lets the inner iterator's ``StopIteration`` out of the generator's body."""
    inner = iter(items)
    while True:
        yield next(inner)


def _foreign_step(
    own: Iterator[Any],
    case: mc.Case,
    rec: mc.Recorder,
    data_iterator: Iterator[Any] | None,
    model: Any,
) -> Any:
    """A forward_step_func that reads an iterator of its own, not its argument."""
    return mc._forward_step(case, rec, own, model)


def _dry_worker(rank: int, world: int, how: str) -> dict[str, Any]:
    from tests.integrations import megatron_cpu

    megatron_cpu.install()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state as ps

    from rrfp_async._errors import PlanError, exception_notes
    from rrfp_async.megatron import get_forward_backward_func

    ps.initialize_model_parallel(pipeline_model_parallel_size=world)
    case = mc.Case("dry", m=M)
    config = mc._config(case, world)
    pp_rank = ps.get_pipeline_model_parallel_rank()
    model = mc.make_mlp(config, pp_rank, world)
    rec = mc.Recorder([model], world, pp_rank)
    fb = get_forward_backward_func(step_timeout=30)
    data = mc.mlp_data(case)
    step: Any = functools.partial(mc._forward_step, case, rec)
    if how == "foreign":
        step = functools.partial(_foreign_step, iter(data[:GIVEN]), case, rec)
    it = {"dry": iter(data[:GIVEN]), "generator": _generator(data[:GIVEN])}.get(how, iter(data))
    try:
        fb(
            forward_step_func=step,
            data_iterator=it,
            model=model,
            num_microbatches=M,
            seq_length=mc.seq_len(0, False),
            micro_batch_size=mc.B,
            forward_only=False,
        )
    except Exception as e:
        return {
            "type": type(e).__name__,
            "plan": isinstance(e, PlanError),
            "message": str(e),
            "notes": [str(n) for n in exception_notes(e)],
        }
    finally:
        fb.close()
        ps.destroy_model_parallel()
    return {"type": None, "message": "", "notes": []}


_SAYS = {
    "dry": (f"data_iterator ran out after {GIVEN} of num_microbatches={M}",),
    "generator": (
        f"data_iterator ran out after {GIVEN} of num_microbatches={M} microbatches (a"
        " generator whose body let an inner iterator's StopIteration out",
        "generator raised StopIteration",
    ),
    "foreign": (
        f"forward_step_func _foreign_step raised StopIteration in the forward of microbatch"
        f" {GIVEN} of num_microbatches={M}",
        "not the data_iterator argument",
        f"give the other iterator at least num_microbatches={M} items",
    ),
}


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["dry", "generator", "foreign"])
def test_data_iterator_that_runs_dry_names_the_counts_and_the_fix(how: str) -> None:
    # "generator" and "foreign" fail without the fix: a bare RuntimeError ("generator raised
    # StopIteration", "StopIteration raised: StopIteration()") on the rank that read it.
    res = pooled_spawn(_dry_worker, 2, how, timeout=240)
    for r, got in enumerate(res):
        assert got["type"] is not None, f"rank {r}: the step did not fail"
        assert got["type"] != "RuntimeError", f"rank {r}: {got}"
    # Every rank reads its data (Megatron-LM's forward_step does on every stage); the first
    # to run dry fails the step, the other learns it from that rank's ABORT: a PlanError
    # everywhere (a PeerPlanError there).
    assert "PlanError" in {got["type"] for got in res}, res
    for r, got in enumerate(res):
        text = " ".join([got["message"], *got["notes"]])
        assert got["plan"] and got["type"] in ("PlanError", "PeerPlanError"), (r, got)
        for part in _SAYS[how]:
            assert part in text, (part, text)
        if how != "foreign":
            assert f"give it at least num_microbatches={M}" in text, text
        assert f"rank {r}" in text and "step 0" in text, text  # where (STYLE.md, convention 7)
