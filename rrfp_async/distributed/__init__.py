"""The distributed wiring: process layout and groups, :class:`DistributedStage` (a
:class:`~rrfp_async.loop.StageLoop` on gloo/NCCL channels), the torch stage executor, the
local process spawner and the example training harness."""

from ._layout import ProcessLayout, StageGroups, build_groups, pipeline_neighbors
from ._spawn import free_port, spawn
from ._stage import DistributedStage
from ._torch_executor import EmulatedCost, TorchStageExecutor
from ._train import TrainConfig, TrainResult, fixed_microbatches, image_text_cost, train_worker

__all__ = [
    "DistributedStage",
    "EmulatedCost",
    "ProcessLayout",
    "StageGroups",
    "TorchStageExecutor",
    "TrainConfig",
    "TrainResult",
    "build_groups",
    "fixed_microbatches",
    "free_port",
    "image_text_cost",
    "pipeline_neighbors",
    "spawn",
    "train_worker",
]
