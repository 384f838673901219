"""torch.distributed.pipelining's schedule API, readiness-first: change one line.

::

    from torch.distributed.pipelining import PipelineStage
    from rrfp_async.pipelining import ScheduleReadinessFirst

    stage = PipelineStage(stage_module, rank, world_size, device)
    schedule = ScheduleReadinessFirst(stage, n_microbatches=8, loss_fn=loss_fn)
    if rank == 0:
        schedule.step(x)
    elif rank == world_size - 1:
        losses = []
        output = schedule.step(target=y, losses=losses)
    else:
        schedule.step()

See ``rrfp_async.integrations._torch_pipelining`` for what is supported.
"""

from .integrations._torch_pipelining import (
    ScheduleInterleavedReadinessFirst,
    ScheduleReadinessFirst,
)

__all__ = ["ScheduleInterleavedReadinessFirst", "ScheduleReadinessFirst"]
