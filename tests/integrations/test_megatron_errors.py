"""The megatron-core drop-in's message for a ``data_iterator`` that runs dry, end to end: a
Megatron-LM style ``forward_step_func`` (``next(data_iterator)``) on PP 2, given fewer items
than ``num_microbatches``. Before the fix the item read raised ``StopIteration`` from inside
the task, which PEP 479 turns into a bare ``RuntimeError`` (or a hung future) once it
reaches a coroutine; now the step fails with a ``PlanError`` that says how many items the
iterator gave of how many it needed, and the fix.

The pure part (the counting, the message) is ``tests/test_error_messages.py``.
"""

from __future__ import annotations

import functools
import warnings
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


def _dry_worker(rank: int, world: int) -> dict[str, Any]:
    from tests.integrations import megatron_cpu

    megatron_cpu.install()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state as ps

    from rrfp_async._errors import exception_notes
    from rrfp_async.megatron import get_forward_backward_func

    ps.initialize_model_parallel(pipeline_model_parallel_size=world)
    case = mc.Case("dry", m=M)
    config = mc._config(case, world)
    pp_rank = ps.get_pipeline_model_parallel_rank()
    model = mc.make_mlp(config, pp_rank, world)
    rec = mc.Recorder([model], world, pp_rank)
    fb = get_forward_backward_func(step_timeout=30)
    try:
        fb(
            forward_step_func=functools.partial(mc._forward_step, case, rec),
            data_iterator=iter(mc.mlp_data(case)[:GIVEN]),
            model=model,
            num_microbatches=M,
            seq_length=mc.seq_len(0, False),
            micro_batch_size=mc.B,
            forward_only=False,
        )
    except Exception as e:
        return {
            "type": type(e).__name__,
            "message": str(e),
            "notes": [str(n) for n in exception_notes(e)],
        }
    finally:
        fb.close()
        ps.destroy_model_parallel()
    return {"type": None, "message": "", "notes": []}


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_data_iterator_that_runs_dry_names_the_counts_and_the_fix() -> None:
    res = pooled_spawn(_dry_worker, 2, timeout=240)
    for r, got in enumerate(res):
        assert got["type"] is not None, f"rank {r}: the step did not fail"
        assert got["type"] != "RuntimeError", f"rank {r}: {got}"
    # Every rank reads the data iterator (Megatron-LM's forward_step does on every stage);
    # the first to run dry fails the step, the other learns it from that rank's ABORT.
    assert "PlanError" in {got["type"] for got in res}, res
    for r, got in enumerate(res):
        text = " ".join([got["message"], *got["notes"]])
        assert got["type"] in ("PlanError", "PeerStepError"), (r, got)
        assert f"data_iterator ran out after {GIVEN} of num_microbatches={M}" in text, text
        assert f"give it at least num_microbatches={M}" in text, text
        assert f"rank {r}" in text and "step 0" in text, text  # where (STYLE.md, convention 7)
