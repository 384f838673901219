"""The megatron drop-in's call, checked as megatron's schedules take it (the call styles).

The function takes exactly the keywords of the installed megatron-core's schedule function
(read off its signature: 0.16 and 0.19 differ); a keyword this adapter does not serve, given
a value other than megatron's default, is refused by name, as is each config feature whose
schedule differs from 1F1B's or the interleaved one's (``REFUSED_CONFIG``). The model comes
as megatron's factory picked the schedule: one module (or a list of one) without
interleaving; a list of chunks, with one data iterator (or None) per chunk, for the
interleaved (virtual pipeline) schedule, whose ``microbatch_group_size_per_vp_stage``
constraints are megatron's. Megatron-Bridge's ``p2p_communicator=`` and ``pg_collection=``
are served (``_megatron_groups``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from .._errors import PlanError
from ._megatron_peer import MegatronPeer

__all__ = [
    "REFUSED_CONFIG",
    "SERVED",
    "WHO",
    "bind_call",
    "check_config",
    "model_chunks",
    "vp_group_size",
]

WHO = "the readiness-first get_forward_backward_func"

# config attribute -> (is it on?, what it is): megatron features whose schedule differs.
REFUSED_CONFIG: dict[str, tuple[Callable[[Any], bool], str]] = {
    "num_microbatches_with_partial_activation_checkpoints": (
        lambda v: v is not None,
        "partial activation checkpointing per microbatch (its window is 1F1B's in-flight count)",
    ),
    "defer_embedding_wgrad_compute": (bool, "deferred embedding weight-gradient compute"),
    "fine_grained_activation_offloading": (bool, "fine-grained activation offloading"),
    "overlap_moe_expert_parallel_comm": (
        bool,
        "the combined 1F1B schedule (MoE expert-parallel communication overlap)",
    ),
    "moe_paged_stash": (bool, "the MoE paged stash"),
    "cuda_graph_impl": (lambda v: v == "local", "local CUDA graphs (cuda_graph_impl='local')"),
}

# The call's keywords this adapter serves (what megatron's schedules take, 0.16 - 0.19).
SERVED = frozenset(
    {
        "forward_step_func",
        "data_iterator",
        "model",
        "num_microbatches",
        "seq_length",
        "micro_batch_size",
        "decoder_seq_length",
        "forward_only",
        "collect_non_loss_data",
        "first_val_step",
        "adjust_tensor_shapes_fn",
        "p2p_communicator",
        "pg_collection",
        "force_all_reduce",
    }
)


def bind_call(
    signature: inspect.Signature, kwargs: dict[str, Any], peer: MegatronPeer, fn_name: str
) -> dict[str, Any]:
    """The call's arguments, defaults applied, bound as megatron's ``fn_name`` binds them;
    PlanError for a keyword it does not take (or a required one missing) and for one this
    adapter does not serve."""
    try:
        bound = signature.bind(**kwargs)
    except TypeError as e:
        raise PlanError(f"{peer.name}'s {fn_name}: {e}") from None
    bound.apply_defaults()
    a = bound.arguments
    for name, param in signature.parameters.items():
        if name not in SERVED and a.get(name, param.default) is not param.default:
            raise PlanError(
                f"{name}: {peer.name}'s {fn_name} keyword {name}= is not supported by {WHO}"
            )
    return dict(a)


def model_chunks(
    model: Any, data_iterator: Any, *, interleaved: bool, vp_size: int | None
) -> tuple[list[Any], list[Any]]:
    """The model chunks and their data iterators, as this schedule takes them."""
    if not interleaved:
        one = []
        for name, x in (("model", model), ("data_iterator", data_iterator)):
            if isinstance(x, list):
                if len(x) != 1:
                    raise PlanError(
                        f"{name} is a list of {len(x)} model chunks, but"
                        " get_forward_backward_func picked the non-interleaved schedule"
                        " (vp_size=None): pass vp_size= (or set parallel_state's"
                        " virtual_pipeline_model_parallel_size) for the interleaved one"
                    )
                x = x[0]
            one.append(x)
        return [one[0]], [one[1]]
    if not isinstance(model, list) or not model:
        raise PlanError(
            "the interleaved (virtual pipeline) schedule takes model as a list of model"
            f" chunks, got {type(model).__name__}"
        )
    if not all(isinstance(c, torch.nn.Module) for c in model):
        raise PlanError("model must be a list of torch.nn.Module chunks")
    if not isinstance(data_iterator, list) or len(data_iterator) != len(model):
        got = len(data_iterator) if isinstance(data_iterator, list) else None
        raise PlanError(
            "the interleaved (virtual pipeline) schedule takes data_iterator as a list of"
            f" one iterator (or None) per model chunk ({len(model)}), got"
            f" {type(data_iterator).__name__}" + (f" of {got}" if got is not None else "")
        )
    if vp_size is not None and vp_size != len(model):
        raise PlanError(
            f"get_forward_backward_func(vp_size={vp_size}), but model has {len(model)} chunks"
        )
    return list(model), list(data_iterator)


def check_config(
    config: Any,
    models: list[Any],
    a: dict[str, Any],
    forward_only: bool,
    *,
    interleaved: bool,
    peer: MegatronPeer,
) -> None:
    """PlanError for a config feature (or call argument) the picked schedule refuses."""
    for attr, (on, what) in REFUSED_CONFIG.items():
        # Fields a megatron-core version's config may lack (older versions lack the newer ones).
        if on(getattr(config, attr, None)):
            raise PlanError(f"config.{attr}: {what} is not supported by {WHO}")
    if a["collect_non_loss_data"] and not forward_only:
        raise PlanError(
            f"collect_non_loss_data=True in a training step (forward_only=False) is not"
            f" supported by {WHO}"
        )
    if not interleaved:
        return
    if a["adjust_tensor_shapes_fn"] is not None:
        raise PlanError(
            "adjust_tensor_shapes_fn with the interleaved schedule: megatron's interleaved"
            f" schedule does not take it ({peer.name}), nor does {WHO}"
        )
    vp = config.virtual_pipeline_model_parallel_size
    if vp != len(models):
        raise PlanError(
            f"config.virtual_pipeline_model_parallel_size={vp}, but model has"
            f" {len(models)} chunks: megatron's interleaved schedule needs them equal"
        )
    if not peer.forward_takes_vp_stage:
        raise PlanError(
            f"{peer.name}'s forward_step takes no vp_stage: its interleaved schedule"
            f" is not supported by {WHO}"
        )


def vp_group_size(config: Any, pp: int, m: int, *, interleaved: bool) -> int:
    """``microbatch_group_size_per_vp_stage``, with megatron's interleaved constraints."""
    # Newer megatron-core configs have this field; without it the group is the pipeline size.
    g = getattr(config, "microbatch_group_size_per_vp_stage", None)
    g = pp if g is None else int(g)
    if not interleaved:
        return pp  # megatron's 1F1B does not read it
    if g > m or g < pp:
        raise PlanError(
            f"config.microbatch_group_size_per_vp_stage={g}: megatron's interleaved"
            f" schedule needs it in [PP={pp}, M={m}] (the microbatches a virtual stage"
            " runs in a row)"
        )
    rest = m % g
    if 0 < rest < pp:
        raise PlanError(
            f"num_microbatches={m} with microbatch_group_size_per_vp_stage={g} leaves a"
            f" last group of {rest} < PP={pp}: megatron's interleaved schedule refuses it"
            " (dependency bubbles)"
        )
    return g
