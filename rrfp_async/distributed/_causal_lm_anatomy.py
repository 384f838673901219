"""What ``split_causal_lm`` reads of a Hugging Face causal LM before it splits it: the
``Anatomy`` (which modules run before, between and after the decoder layers, how a layer is
called, which mask each layer gets, the router loss of a mixture of experts) and the checks
that refuse a model a stage could not call as its own forward does.

Design note: what runs where is read from the model, not from a list of classes.
transformers describes each decoder's running order for pipeline parallelism itself:
``config.base_model_pp_plan`` (``embed_tokens -> layers -> norm``; GPT-NeoX:
``embed_in -> emb_dropout -> layers -> final_layer_norm``) and the causal LM's ``_pp_plan``
(``lm_head``). The first stage runs the plan's modules before the layer list, the last the
ones after it and the head. A model without these plans, with a child that neither plan
places (other than ``rotary_emb``), whose attention is not causal (``is_causal``), or whose
decoder layer takes an argument we do not build, is refused with a ``PlanError`` naming that
thing. transformers is imported here, lazily (``read_anatomy``), never by ``import
rrfp_async``.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, cast

import torch
from torch import nn

from .._errors import PlanError

__all__ = ["Anatomy", "RouterAux", "read_anatomy", "refuse"]

#: The decoder layer's arguments a stage builds and passes (by keyword).
_BUILT = ("attention_mask", "position_ids", "position_embeddings")
#: The layer's arguments left at their defaults: the KV cache and what only generation or
#: debugging uses. A training forward passes no cache (its outputs do not depend on one).
_DEFAULTED = frozenset(
    {"cache", "past_key_values", "layer_past", "use_cache", "cache_position", "output_attentions"}
)


def _transformers() -> tuple[ModuleType, ModuleType]:
    """``transformers`` and its ``masking_utils``, or a PlanError saying how to get them."""
    try:
        tf = importlib.import_module("transformers")
        masking = importlib.import_module("transformers.masking_utils")
    except ImportError as e:
        raise PlanError(
            "split_causal_lm needs transformers >= 5 (pip install 'transformers>=5'); "
            f"importing it failed: {e}"
        ) from e
    return tf, masking


@dataclass(frozen=True)
class RouterAux:
    """The router load-balancing loss the model adds to its loss."""

    router_class: type[nn.Module]
    index: int
    loss: Callable[..., torch.Tensor]  # the model's own load_balancing_loss_func
    coef: float
    num_experts: int
    top_k: int


@dataclass(frozen=True)
class Anatomy:
    """What a stage needs to know of the model, read once by ``split_causal_lm``."""

    name: str  # the causal LM's class name, for messages
    config: Any  # the base model's config
    pre: tuple[tuple[str, nn.Module], ...]  # (name in the model, module) before the layers
    layers_name: str  # "model.layers"
    layers: tuple[nn.Module, ...]
    post: tuple[tuple[str, nn.Module], ...]  # after the layers: the final norm
    head: tuple[str, nn.Module]  # the LM head
    rotary: tuple[str, nn.Module] | None
    takes: frozenset[str]  # which of _BUILT the layers take
    mask_keys: tuple[str, ...] | None  # per layer, its key into the mask mapping
    masks: Callable[..., Any]  # create_masks_for_generate
    cache: Callable[..., Any]  # DynamicCache, what the forward makes when use_cache
    base: nn.Module  # the base model (its gradient_checkpointing flag)
    aux: RouterAux | None


def refuse(name: str, why: str) -> PlanError:
    return PlanError(f"split_causal_lm: {name} cannot be split: {why}")


def _plan_children(
    owner: nn.Module, plan: Mapping[str, Any], prefix: str, what: str, name: str
) -> list[tuple[str, nn.Module]]:
    out = []
    for key in plan:
        child = getattr(owner, key, None)
        if not isinstance(child, nn.Module):
            raise refuse(name, f"{what} names {key!r}, which is no submodule of the model")
        out.append((f"{prefix}{key}", child))
    return out


def _layer_params(layer: nn.Module, name: str, where: str) -> frozenset[str]:
    """Which of the built arguments the layer takes; refuses a call we cannot make."""
    try:
        sig = inspect.signature(layer.forward)
    except (TypeError, ValueError) as e:
        raise refuse(name, f"the signature of {where}.forward cannot be read ({e})") from None
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not positional:
        raise refuse(name, f"{where}.forward takes no hidden states argument")
    unknown = []
    for p in params:
        if p is positional[0] or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) or p.name in _BUILT:
            continue
        if p.name in _DEFAULTED and p.default is not p.empty:
            continue
        unknown.append(p.name if p.default is not p.empty else f"{p.name} (required)")
    if unknown:
        raise refuse(
            name,
            f"its decoder layer ({where}: {type(layer).__name__}.forward) takes "
            f"{', '.join(unknown)}, which split_causal_lm does not build (it builds "
            f"{', '.join(_BUILT)} and leaves {', '.join(sorted(_DEFAULTED))} at their defaults)",
        )
    return frozenset(p.name for p in params if p.name in _BUILT)


def _aux(model: nn.Module, base: nn.Module, name: str) -> RouterAux | None:
    """The router loss, if the model's loss includes it (``config.output_router_logits``)."""
    # Only mixture-of-experts configs have output_router_logits.
    if not getattr(model.config, "output_router_logits", False):
        return None
    missing = [
        a
        for a in ("router_aux_loss_coef", "num_experts", "num_experts_per_tok")
        if not hasattr(model, a)
    ]
    module = inspect.getmodule(type(model))
    loss = getattr(module, "load_balancing_loss_func", None)
    if loss is None:
        missing.append(f"load_balancing_loss_func in {getattr(module, '__name__', '?')}")
    recorders = getattr(type(base), "_can_record_outputs", None) or {}
    spec = recorders.get("router_logits")
    if spec is None:
        missing.append(f'{type(base).__name__}._can_record_outputs["router_logits"]')
    if missing:
        raise refuse(
            name,
            "config.output_router_logits adds a router loss to its loss, but the model has no "
            + ", ".join(missing),
        )
    cls: Any
    if isinstance(spec, type) and issubclass(spec, nn.Module):
        cls, index = spec, 1  # transformers' rule for a bare class (not "hidden_states")
    else:
        # transformers' OutputRecorder fields (target_class, index, layer_name, class_name).
        cls = getattr(spec, "target_class", None)
        index = getattr(spec, "index", 0)
        if (
            not (isinstance(cls, type) and issubclass(cls, nn.Module))
            or getattr(spec, "layer_name", None) is not None
            or getattr(spec, "class_name", None) is not None
        ):
            raise refuse(
                name,
                f"its router outputs are recorded as {spec!r}; split_causal_lm reads only a "
                "router class and an output index",
            )
    return RouterAux(
        router_class=cls,
        index=int(index),
        loss=loss,  # type: ignore[arg-type]
        coef=float(model.router_aux_loss_coef),  # type: ignore[arg-type]
        num_experts=int(model.num_experts),  # type: ignore[arg-type]
        top_k=int(model.num_experts_per_tok),  # type: ignore[arg-type]
    )


def _mask_builder(tf: ModuleType, masking: ModuleType) -> Callable[..., Any]:
    """transformers' ``create_masks_for_generate``, if it has the 5.x signature."""
    # Older transformers lack create_masks_for_generate (or its 5.x signature, checked below).
    masks = getattr(masking, "create_masks_for_generate", None)
    want = {"config", "inputs_embeds", "attention_mask", "cache", "position_ids"}
    if masks is None or not want <= set(inspect.signature(masks).parameters):
        raise PlanError(
            "split_causal_lm needs transformers >= 5 (its masking_utils.create_masks_for_"
            "generate(config, inputs_embeds, attention_mask, cache, position_ids)); "
            f"transformers {tf.__version__} has none"
        )
    return masks  # type: ignore[no-any-return]


def _check_causal(name: str, layers_name: str, layers: Sequence[nn.Module]) -> None:
    """Every attention module of the layers says it is causal (``is_causal``)."""
    causal = [
        (f"{layers_name}.{i}.{k}" if k else f"{layers_name}.{i}", m.is_causal)
        for i, layer in enumerate(layers)
        for k, m in layer.named_modules()
        # Attention modules declare is_causal; other submodules do not.
        if isinstance(getattr(m, "is_causal", None), bool)
    ]
    where = next((w for w, c in causal if not c), None)
    if where is not None:
        raise refuse(name, f"its attention is not causal ({where}.is_causal is False): an encoder")
    if not causal:
        raise refuse(name, "no module of its layers says whether its attention is causal")


def _layer_call(
    name: str, layers_name: str, layers: Sequence[nn.Module], rotary: Any, prefix: str
) -> frozenset[str]:
    """What every layer takes of ``_BUILT``, the same for all, with the rotary module the
    ``position_embeddings`` come from."""
    takes = _layer_params(layers[0], name, f"{layers_name}.0")
    for i, layer in enumerate(layers[1:], 1):
        if _layer_params(layer, name, f"{layers_name}.{i}") != takes:
            raise refuse(name, f"{layers_name}.{i} takes other arguments than layer 0")
    if ("position_embeddings" in takes) != isinstance(rotary, nn.Module):
        raise refuse(
            name,
            f"its layers take position_embeddings but {prefix} has no rotary_emb module"
            if rotary is None
            else f"{prefix}.rotary_emb exists but its layers take no position_embeddings",
        )
    if rotary is not None and "position_ids" not in inspect.signature(rotary.forward).parameters:
        raise refuse(name, f"{prefix}.rotary_emb.forward takes no position_ids")
    return takes


def _mask_keys(name: str, config: Any, masking: ModuleType, n: int) -> tuple[str, ...] | None:
    """Per layer, its entry of the mask mapping (``config.layer_types``), or None when one
    mask serves every layer."""
    # Only models with per-layer attention kinds (sliding/full) have layer_types.
    types = getattr(config, "layer_types", None)
    if types is None:
        return None
    known = getattr(masking, "LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING", {})
    odd = sorted({t for t in types if t not in known})
    if odd or len(types) < n:
        raise refuse(
            name,
            f"config.layer_types has {odd}, for which transformers has no mask"
            if odd
            else f"config.layer_types names {len(types)} layers, not {n}",
        )
    return tuple(types[:n])


def read_anatomy(model: nn.Module) -> Anatomy:
    """Read the model's parts and check that a stage can call them as its forward does."""
    tf, masking = _transformers()
    name = type(model).__name__
    if not isinstance(model, tf.PreTrainedModel):
        raise PlanError(
            f"split_causal_lm: expected a Hugging Face *ForCausalLM model "
            f"(transformers.PreTrainedModel), got a {name}"
        )
    masks = _mask_builder(tf, masking)
    base = model.base_model
    prefix = getattr(model, "base_model_prefix", "")
    if base is model or not prefix:
        raise refuse(
            name,
            "it is a base model without a head; pass the *ForCausalLM model around it (the "
            "split needs its lm_head and its loss)",
        )
    config = base.config
    # transformers' pipeline plans; a version or model without them is refused below.
    plan = getattr(config, "base_model_pp_plan", None)
    head_plan = getattr(type(model), "_pp_plan", None)
    if not plan:
        raise refuse(
            name,
            f"its config ({type(config).__name__}) has no base_model_pp_plan, transformers' "
            "description of which modules run in what order, so what runs between the "
            "embedding and the first layer is unknown; split it by hand (docs/hf_models.md)",
        )
    if not head_plan or not any(list(outs) == ["logits"] for _, outs in head_plan.values()):
        raise refuse(
            name,
            f"{name}._pp_plan names no head that produces logits: it is no causal LM "
            "(split_causal_lm splits *ForCausalLM models)",
        )
    pp = _plan_children(base, plan, f"{prefix}.", "config.base_model_pp_plan", name)
    lists = [i for i, (_, m) in enumerate(pp) if isinstance(m, nn.ModuleList)]
    if len(lists) != 1:
        raise refuse(
            name,
            f"config.base_model_pp_plan ({', '.join(plan)}) must name one list of decoder "
            f"layers, names {len(lists)}",
        )
    (at,) = lists
    layers_name, layer_list = pp[at]
    layers: tuple[nn.Module, ...] = tuple(cast(nn.ModuleList, layer_list))
    # Most configs name their depth num_hidden_layers; one that does not is taken as is.
    n = getattr(config, "num_hidden_layers", len(layers))
    if not layers or n != len(layers):
        raise refuse(
            name, f"{layers_name} holds {len(layers)} layers but config.num_hidden_layers is {n}"
        )
    head = _plan_children(model, head_plan, "", f"{name}._pp_plan", name)
    if len(head) != 1:
        raise refuse(name, f"{name}._pp_plan names {len(head)} heads; one is known")
    # Every child the forward may use is placed: by a plan, or as the rotary tables.
    rotary = getattr(base, "rotary_emb", None)
    placed = {id(m) for _, m in pp} | {id(rotary)}
    stray = [f"{prefix}.{k}" for k, m in base.named_children() if id(m) not in placed]
    placed = {id(base)} | {id(m) for _, m in head}
    stray += [k for k, m in model.named_children() if id(m) not in placed]
    if stray:
        raise refuse(
            name,
            f"{', '.join(stray)} is placed by neither config.base_model_pp_plan nor "
            f"{name}._pp_plan, so what its forward does with it is unknown",
        )
    _check_causal(name, layers_name, layers)
    takes = _layer_call(name, layers_name, layers, rotary, prefix)
    # Only Gemma-2-like configs have final_logit_softcapping.
    if getattr(config, "final_logit_softcapping", None) is not None:
        # Gemma 2 caps the logits in the causal LM's forward, not in a module.
        raise refuse(name, "its forward soft-caps the logits (config.final_logit_softcapping)")
    return Anatomy(
        name=name,
        config=config,
        pre=tuple(pp[:at]),
        layers_name=layers_name,
        layers=layers,
        post=tuple(pp[at + 1 :]),
        head=head[0],
        rotary=(f"{prefix}.rotary_emb", rotary) if rotary is not None else None,
        takes=takes,
        mask_keys=_mask_keys(name, config, masking, len(layers)),
        masks=masks,
        cache=tf.DynamicCache,
        base=base,
        aux=_aux(model, base, name),
    )
