"""The distributed wiring: process layout and groups, :class:`DistributedStage` (a
:class:`~rrfp_async.loop.StageLoop` on gloo/NCCL channels) and its TP options
(:class:`TPOptions`), the torch stage executor, the local process spawner, the model
splitter (``split_model``: stage modules and the parameters they share;
``split_causal_lm``: a Hugging Face causal LM in one call), and activation bytes learned
from the run (``LearnedBytes``, on an ``ActivationModel`` of a microbatch's
``features_of``; measured by the saved-tensor ``ActivationMeter``, a module's weights
excluded with ``weight_storages``). The example model's training
harness (``TrainConfig``, ``train_worker``) is lab, not runtime: it lives in the lab beside
the runtime, ``rrfp_lab``.

Internal to the package family: imported here for ``integrations/`` and the lab
(``rrfp_lab``), not in ``__all__``:

* ``DEFAULT_STEP_TIMEOUT``: ``DistributedStage``'s default ``step_timeout`` (the drop-ins
  default to the same);
* ``SharedSpec``: where one parameter lives on several stages (tied weights), as the
  drop-ins declare it;
* ``close_quietly``: close a stage from a finalizer or teardown hook, a failure reported as
  a ``RuntimeWarning`` (the drop-ins' schedules release their stage with it).
"""

from .._activation_model import ActivationModel, features_of
from ._activation_meter import ActivationMeter, StorageKey, weight_storages
from ._causal_lm import CausalLMSplit, split_causal_lm
from ._causal_lm_stage import CausalLMStage
from ._dist_stage import DEFAULT_STEP_TIMEOUT as DEFAULT_STEP_TIMEOUT
from ._dist_stage import DistributedStage
from ._emulation import EmulatedCost
from ._layout import ProcessLayout, StageGroups, build_groups, pipeline_neighbors
from ._learned_bytes import LearnedBytes, LearnedDurations
from ._lifetime import close_quietly as close_quietly
from ._nonfinite import NonFinite
from ._spawn import free_port, report_progress, spawn
from ._split import StageModule, StageSplit, from_pipe, from_stage_modules, split_model
from ._stage_io import SharedSpec as SharedSpec
from ._torch_executor import TorchStageExecutor
from ._tp_keywords import TPOptions

__all__ = [
    "ActivationMeter",
    "ActivationModel",
    "CausalLMSplit",
    "CausalLMStage",
    "DistributedStage",
    "EmulatedCost",
    "LearnedBytes",
    "LearnedDurations",
    "NonFinite",
    "ProcessLayout",
    "StageGroups",
    "StageModule",
    "StageSplit",
    "StorageKey",
    "TPOptions",
    "TorchStageExecutor",
    "build_groups",
    "features_of",
    "free_port",
    "from_pipe",
    "from_stage_modules",
    "pipeline_neighbors",
    "report_progress",
    "spawn",
    "split_causal_lm",
    "split_model",
    "weight_storages",
]
