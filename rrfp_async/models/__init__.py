"""Small, deterministic models to train with the pipeline runtime.

``image_text``: an image-text decoder-only transformer that splits into pipeline stages and,
optionally, tensor-parallel (Megatron-style) shards, plus a single-process reference trainer
to check distributed runs against.
"""

from .image_text import (
    COLUMN_SUFFIX,
    ROW_SUFFIX,
    ColumnParallelLinear,
    ImageTextConfig,
    ImageTextStage,
    RowParallelLinear,
    TPContext,
    build_stage_modules,
    copy_to_tp,
    full_model,
    loss_fn,
    make_microbatches,
    parallel_kind,
    reduce_from_tp,
    reference_train,
    shard_dim,
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
