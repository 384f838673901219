"""Small, deterministic models to train with the pipeline runtime: the lab's example model.

Until 0.2, ``rrfp_lab.models`` (and its modules) still resolve here, with a
``DeprecationWarning``: the runtime ships no model.

* ``_tp``: generic Megatron-style tensor parallelism: ``TPContext``, the collectives with
  autograd (``copy_to_tp``, ``reduce_from_tp``), ``ColumnParallelLinear`` /
  ``RowParallelLinear`` and the naming rule that recognises them (``parallel_kind``,
  ``shard_dim``).
* ``image_text``: the example model, an image-text decoder-only transformer that splits
  into pipeline stages and, with ``_tp``'s layers, tensor-parallel shards, plus a
  single-process reference trainer to check distributed runs against.
"""

from ._tp import (
    COLUMN_SUFFIX,
    ROW_SUFFIX,
    ColumnParallelLinear,
    RowParallelLinear,
    TPContext,
    copy_to_tp,
    parallel_kind,
    reduce_from_tp,
    shard_dim,
)
from .image_text import (
    ImageTextConfig,
    ImageTextStage,
    build_stage_modules,
    full_model,
    loss_fn,
    make_microbatches,
    reference_train,
    stage_layers,
    unshard,
)

__all__ = [
    "COLUMN_SUFFIX",
    "ROW_SUFFIX",
    "ColumnParallelLinear",
    "ImageTextConfig",
    "ImageTextStage",
    "RowParallelLinear",
    "TPContext",
    "build_stage_modules",
    "copy_to_tp",
    "full_model",
    "loss_fn",
    "make_microbatches",
    "parallel_kind",
    "reduce_from_tp",
    "reference_train",
    "shard_dim",
    "stage_layers",
    "unshard",
]
