"""Hugging Face causal LMs split into pipeline stages in one call: ``split_causal_lm``.

Design note
-----------
A Hugging Face decoder (transformers 5.x) is not its children in sequence: its own
``forward`` builds, between the embedding and the first decoder layer, what every layer
needs (the position ids, the causal or sliding-window mask from the padding mask, the rotary
tables), and the ``*ForCausalLM`` around it computes the loss (plus, for a mixture of
experts, the router load-balancing loss over *every* layer's router logits). A split that
runs only the children hands a layer ``attention_mask=None`` and no rotary tables, and the
layer fails inside transformers. So a stage here does, for its own layers, what the model's
forward does for all of them:

* **What runs where, read from the model, not from a list of classes.** transformers
  describes each decoder's running order for pipeline parallelism itself:
  ``config.base_model_pp_plan`` (``embed_tokens -> layers -> norm``; GPT-NeoX:
  ``embed_in -> emb_dropout -> layers -> final_layer_norm``) and the causal LM's
  ``_pp_plan`` (``lm_head``). The first stage runs the plan's modules before the layer list,
  the last the ones after it and the head. A model without these plans, with a child that
  neither plan places (other than ``rotary_emb``), whose attention is not causal
  (``is_causal``), or whose decoder layer takes an argument we do not build, is refused with
  a ``PlanError`` naming that thing.
* **Masks, positions and rotary tables on every stage, from the microbatch.** Each stage
  gets the padding mask (and the position ids, if the microbatch has them) as side inputs
  from its own rank's microbatch, and builds the masks with transformers' own
  ``create_masks_for_generate`` (its docstring: it "mimics how we create the masks in the
  modeling files": one mask per ``config.layer_types`` entry, else sliding-window when
  ``config.sliding_window`` is set, else causal) and the rotary tables with the model's own
  ``rotary_emb`` (every stage holds it: it has buffers only, no parameters). The masks see
  an empty cache exactly when the model's forward makes one (``use_cache``), since
  transformers' packed-sequence masks depend on it. Nothing but the hidden states crosses a
  stage boundary, so no rotary table or mask is ever sent.
* **MoE router logits travel with the hidden states.** When the model's loss includes the
  router loss (``config.output_router_logits``), each stage records its routers' logits the
  way transformers' output capture does (the model's ``_can_record_outputs["router_logits"]``
  names the router class and the output index) and sends them on, with the earlier stages'
  ones, as ``rr.Args(hidden, router_logits=(...))``; the last stage's loss calls the model's
  own ``load_balancing_loss_func`` on all of them, so its gradient reaches every router.
* **A probe before anyone trains.** The plans say which modules run, not everything a
  forward does (a scale, a soft cap, a different mask rule). Unless ``check=False``, the
  split runs small probe batches (padded rows; packed sequences with and without a cache)
  through its stages and through the model's own ``forward`` (eval mode, no grad) and
  refuses the model, naming the difference, unless the logits and the loss agree; an error
  raised inside transformers on the way becomes a ``PlanError`` too.

The stage modules hold the model's own module objects under the model's own names
(``model.layers.3.mlp.up_proj.weight``), so a tied ``lm_head.weight`` *is*
``model.embed_tokens.weight``: ``from_stage_modules`` finds the tie, and ``shared`` declares
it to the executors. transformers is imported here, lazily, never by ``import rrfp_async``.
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

from .._costs import Microbatch
from .._errors import PlanError
from .._pytree import Args, call_module
from ._split import StageSplit, from_stage_modules, register_block
from ._torch_executor import TorchStageExecutor

__all__ = ["CausalLMSplit", "CausalLMStage", "split_causal_lm"]

#: The decoder layer's arguments a stage builds and passes (by keyword).
_BUILT = ("attention_mask", "position_ids", "position_embeddings")
#: The layer's arguments left at their defaults: the KV cache and what only generation or
#: debugging uses. A training forward passes no cache (its outputs do not depend on one).
_DEFAULTED = frozenset(
    {"cache", "past_key_values", "layer_past", "use_cache", "cache_position", "output_attentions"}
)
#: The microbatch keys each stage reads from its own rank's microbatch.
_SIDE_KEYS = ("attention_mask", "position_ids", "use_cache")


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


def _data(mb: Any) -> Mapping[str, Any]:
    data = mb.data if isinstance(mb, Microbatch) else mb
    if not isinstance(data, Mapping):
        raise PlanError(
            "split_causal_lm: a microbatch is a mapping of the model's keyword inputs "
            f"(input_ids, attention_mask, labels, ...) or an rr.Microbatch whose data is one; "
            f"got {type(data).__name__}"
        )
    return data


def _which(mb: Any) -> str:
    return f"microbatch {mb.index}" if isinstance(mb, Microbatch) else "the microbatch"


def causal_lm_input(mb: Any) -> torch.Tensor:
    """The first stage's input: the microbatch's ``input_ids``."""
    ids = _data(mb).get("input_ids")
    if not isinstance(ids, torch.Tensor):
        raise PlanError(
            f"split_causal_lm: {_which(mb)} has no input_ids tensor (keys: {sorted(_data(mb))})"
        )
    return ids


def causal_lm_side_inputs(stage: int, mb: Any) -> dict[str, Any]:
    """Every stage's own keyword inputs: the microbatch's ``attention_mask``,
    ``position_ids`` and ``use_cache``, those it has."""
    data = _data(mb)
    return {k: data[k] for k in _SIDE_KEYS if data.get(k) is not None}


# ------------------------------------------------------------------------------ the anatomy


@dataclass(frozen=True)
class _Aux:
    """The router load-balancing loss the model adds to its loss."""

    router_class: type[nn.Module]
    index: int
    loss: Callable[..., torch.Tensor]  # the model's own load_balancing_loss_func
    coef: float
    num_experts: int
    top_k: int


@dataclass(frozen=True)
class _Anatomy:
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
    aux: _Aux | None


def _refuse(name: str, why: str) -> PlanError:
    return PlanError(f"split_causal_lm: {name} cannot be split: {why}")


def _plan_children(
    owner: nn.Module, plan: Mapping[str, Any], prefix: str, what: str, name: str
) -> list[tuple[str, nn.Module]]:
    out = []
    for key in plan:
        child = getattr(owner, key, None)
        if not isinstance(child, nn.Module):
            raise _refuse(name, f"{what} names {key!r}, which is no submodule of the model")
        out.append((f"{prefix}{key}", child))
    return out


def _layer_params(layer: nn.Module, name: str, where: str) -> frozenset[str]:
    """Which of the built arguments the layer takes; refuses a call we cannot make."""
    try:
        sig = inspect.signature(layer.forward)
    except (TypeError, ValueError) as e:
        raise _refuse(name, f"the signature of {where}.forward cannot be read ({e})") from None
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not positional:
        raise _refuse(name, f"{where}.forward takes no hidden states argument")
    unknown = []
    for p in params:
        if p is positional[0] or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) or p.name in _BUILT:
            continue
        if p.name in _DEFAULTED and p.default is not p.empty:
            continue
        unknown.append(p.name if p.default is not p.empty else f"{p.name} (required)")
    if unknown:
        raise _refuse(
            name,
            f"its decoder layer ({where}: {type(layer).__name__}.forward) takes "
            f"{', '.join(unknown)}, which split_causal_lm does not build (it builds "
            f"{', '.join(_BUILT)} and leaves {', '.join(sorted(_DEFAULTED))} at their defaults)",
        )
    return frozenset(p.name for p in params if p.name in _BUILT)


def _aux(model: nn.Module, base: nn.Module, name: str) -> _Aux | None:
    """The router loss, if the model's loss includes it (``config.output_router_logits``)."""
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
        raise _refuse(
            name,
            "config.output_router_logits adds a router loss to its loss, but the model has no "
            + ", ".join(missing),
        )
    cls: Any
    if isinstance(spec, type) and issubclass(spec, nn.Module):
        cls, index = spec, 1  # transformers' rule for a bare class (not "hidden_states")
    else:
        cls = getattr(spec, "target_class", None)
        index = getattr(spec, "index", 0)
        if (
            not (isinstance(cls, type) and issubclass(cls, nn.Module))
            or getattr(spec, "layer_name", None) is not None
            or getattr(spec, "class_name", None) is not None
        ):
            raise _refuse(
                name,
                f"its router outputs are recorded as {spec!r}; split_causal_lm reads only a "
                "router class and an output index",
            )
    return _Aux(
        router_class=cls,
        index=int(index),
        loss=loss,  # type: ignore[arg-type]
        coef=float(model.router_aux_loss_coef),  # type: ignore[arg-type]
        num_experts=int(model.num_experts),  # type: ignore[arg-type]
        top_k=int(model.num_experts_per_tok),  # type: ignore[arg-type]
    )


def _mask_builder(tf: ModuleType, masking: ModuleType) -> Callable[..., Any]:
    """transformers' ``create_masks_for_generate``, if it has the 5.x signature."""
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
        if isinstance(getattr(m, "is_causal", None), bool)
    ]
    where = next((w for w, c in causal if not c), None)
    if where is not None:
        raise _refuse(name, f"its attention is not causal ({where}.is_causal is False): an encoder")
    if not causal:
        raise _refuse(name, "no module of its layers says whether its attention is causal")


def _layer_call(
    name: str, layers_name: str, layers: Sequence[nn.Module], rotary: Any, prefix: str
) -> frozenset[str]:
    """What every layer takes of ``_BUILT``, the same for all, with the rotary module the
    ``position_embeddings`` come from."""
    takes = _layer_params(layers[0], name, f"{layers_name}.0")
    for i, layer in enumerate(layers[1:], 1):
        if _layer_params(layer, name, f"{layers_name}.{i}") != takes:
            raise _refuse(name, f"{layers_name}.{i} takes other arguments than layer 0")
    if ("position_embeddings" in takes) != isinstance(rotary, nn.Module):
        raise _refuse(
            name,
            f"its layers take position_embeddings but {prefix} has no rotary_emb module"
            if rotary is None
            else f"{prefix}.rotary_emb exists but its layers take no position_embeddings",
        )
    if rotary is not None and "position_ids" not in inspect.signature(rotary.forward).parameters:
        raise _refuse(name, f"{prefix}.rotary_emb.forward takes no position_ids")
    return takes


def _mask_keys(name: str, config: Any, masking: ModuleType, n: int) -> tuple[str, ...] | None:
    """Per layer, its entry of the mask mapping (``config.layer_types``), or None when one
    mask serves every layer."""
    types = getattr(config, "layer_types", None)
    if types is None:
        return None
    known = getattr(masking, "LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING", {})
    odd = sorted({t for t in types if t not in known})
    if odd or len(types) < n:
        raise _refuse(
            name,
            f"config.layer_types has {odd}, for which transformers has no mask"
            if odd
            else f"config.layer_types names {len(types)} layers, not {n}",
        )
    return tuple(types[:n])


def _anatomy(model: nn.Module) -> _Anatomy:
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
        raise _refuse(
            name,
            "it is a base model without a head; pass the *ForCausalLM model around it (the "
            "split needs its lm_head and its loss)",
        )
    config = base.config
    plan = getattr(config, "base_model_pp_plan", None)
    head_plan = getattr(type(model), "_pp_plan", None)
    if not plan:
        raise _refuse(
            name,
            f"its config ({type(config).__name__}) has no base_model_pp_plan, transformers' "
            "description of which modules run in what order, so what runs between the "
            "embedding and the first layer is unknown; split it by hand (docs/hf_models.md)",
        )
    if not head_plan or not any(list(outs) == ["logits"] for _, outs in head_plan.values()):
        raise _refuse(
            name,
            f"{name}._pp_plan names no head that produces logits: it is no causal LM "
            "(split_causal_lm splits *ForCausalLM models)",
        )
    pp = _plan_children(base, plan, f"{prefix}.", "config.base_model_pp_plan", name)
    lists = [i for i, (_, m) in enumerate(pp) if isinstance(m, nn.ModuleList)]
    if len(lists) != 1:
        raise _refuse(
            name,
            f"config.base_model_pp_plan ({', '.join(plan)}) must name one list of decoder "
            f"layers, names {len(lists)}",
        )
    (at,) = lists
    layers_name, layer_list = pp[at]
    layers: tuple[nn.Module, ...] = tuple(cast(nn.ModuleList, layer_list))
    n = getattr(config, "num_hidden_layers", len(layers))
    if not layers or n != len(layers):
        raise _refuse(
            name, f"{layers_name} holds {len(layers)} layers but config.num_hidden_layers is {n}"
        )
    head = _plan_children(model, head_plan, "", f"{name}._pp_plan", name)
    if len(head) != 1:
        raise _refuse(name, f"{name}._pp_plan names {len(head)} heads; one is known")
    # Every child the forward may use is placed: by a plan, or as the rotary tables.
    rotary = getattr(base, "rotary_emb", None)
    placed = {id(m) for _, m in pp} | {id(rotary)}
    stray = [f"{prefix}.{k}" for k, m in base.named_children() if id(m) not in placed]
    placed = {id(base)} | {id(m) for _, m in head}
    stray += [k for k, m in model.named_children() if id(m) not in placed]
    if stray:
        raise _refuse(
            name,
            f"{', '.join(stray)} is placed by neither config.base_model_pp_plan nor "
            f"{name}._pp_plan, so what its forward does with it is unknown",
        )
    _check_causal(name, layers_name, layers)
    takes = _layer_call(name, layers_name, layers, rotary, prefix)
    if getattr(config, "final_logit_softcapping", None) is not None:
        # Gemma 2 caps the logits in the causal LM's forward, not in a module.
        raise _refuse(name, "its forward soft-caps the logits (config.final_logit_softcapping)")
    return _Anatomy(
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


# ------------------------------------------------------------------------------ the stages


class CausalLMStage(nn.Module):
    """One pipeline stage of a Hugging Face causal LM: decoder layers ``lo .. hi - 1``, with
    the embedding on the first stage and the final norm and LM head on the last.

    Every stage builds what the model's forward builds for its layers: the position ids
    (``0 .. seq - 1`` unless given), the masks (``create_masks_for_generate`` from the
    padding mask) and the rotary tables (the model's ``rotary_emb``). The modules are the
    model's own objects, registered under the model's names (``model.layers.3``), so the
    stage's parameter and ``state_dict`` names are the model's.

    Called as ``stage(x, attention_mask=None, position_ids=None, router_logits=(),
    use_cache=None)``: ``x`` is the token ids on the first stage and the hidden states
    elsewhere; ``router_logits`` are the earlier stages' router logits (a model whose loss
    includes the router loss). Returns
    the hidden states (or ``rr.Args(hidden, router_logits=...)``) to the next stage; the last
    stage returns the logits (or ``{"logits": ..., "router_logits": ...}``). Build stages with
    :func:`split_causal_lm`.
    """

    def __init__(self, anatomy: _Anatomy, lo: int, hi: int, *, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.layer_range = (lo, hi)
        self._model_name = anatomy.name
        self._config = anatomy.config
        self._masks = anatomy.masks
        self._cache = anatomy.cache
        self._base = (anatomy.base,)  # a tuple: not registered, its gradient_checkpointing flag
        self._takes = anatomy.takes
        self._mask_keys = None if anatomy.mask_keys is None else anatomy.mask_keys[lo:hi]
        self._aux = anatomy.aux
        run: list[tuple[str, nn.Module]] = [*anatomy.pre] if first else []
        if anatomy.rotary is not None:
            run.append(anatomy.rotary)
        run += [(f"{anatomy.layers_name}.{i}", anatomy.layers[i]) for i in range(lo, hi)]
        if last:
            run += [*anatomy.post, anatomy.head]
        for name, module in run:
            register_block(self, name, module)
        # What runs, in order, as plain tuples (a module attribute would register it twice).
        self._pre = tuple(m for _, m in anatomy.pre) if first else ()
        self._rotary = () if anatomy.rotary is None else (anatomy.rotary[1],)
        self._layer_names = tuple(f"{anatomy.layers_name}.{i}" for i in range(lo, hi))
        self._layers = anatomy.layers[lo:hi]
        self._post = (*(m for _, m in anatomy.post), anatomy.head[1]) if last else ()
        self._routers: tuple[nn.Module, ...] = ()
        if self._aux is not None:
            cls = self._aux.router_class
            self._routers = tuple(
                m for layer in self._layers for m in layer.modules() if isinstance(m, cls)
            )

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        router_logits: Sequence[torch.Tensor] = (),
        use_cache: bool | None = None,
    ) -> Any:
        """Run the stage (see the class docstring).

        Args:
            x: Token ids ``[batch, seq]`` on the first stage, else hidden states.
            attention_mask: The padding mask ``[batch, seq]`` (1 = token, 0 = padding), or
                None (no padding).
            position_ids: Positions ``[batch or 1, seq]``; default ``0 .. seq - 1``.
            router_logits: The earlier stages' router logits, in layer order.
            use_cache: The model's ``use_cache`` (default ``config.use_cache``): its forward
                then builds the masks with an empty cache, which turns transformers'
                packed-sequence masks (from restarting ``position_ids``) off.

        Returns:
            The next stage's input, or on the last stage the logits (with the router logits
            when the loss needs them).

        Raises:
            PlanError: a decoder layer returned something other than a tensor.
        """
        h = x
        for module in self._pre:
            h = module(h)
        if position_ids is None:
            position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        masks = self._masks(
            config=self._config,
            inputs_embeds=h,
            attention_mask=attention_mask,
            cache=self._cache(config=self._config) if self._uses_cache(use_cache) else None,
            position_ids=position_ids,
        )
        kwargs: dict[str, Any] = {}
        if "position_ids" in self._takes:
            kwargs["position_ids"] = position_ids
        for rotary in self._rotary:
            kwargs["position_embeddings"] = rotary(h, position_ids=position_ids)
        got: list[torch.Tensor] = []
        hooks = [r.register_forward_hook(self._recorder(got)) for r in self._routers]
        try:
            for k, layer in enumerate(self._layers):
                if "attention_mask" in self._takes:
                    kwargs["attention_mask"] = (
                        masks if self._mask_keys is None else masks[self._mask_keys[k]]
                    )
                h = layer(h, **kwargs)
                if not isinstance(h, torch.Tensor):
                    raise PlanError(
                        f"split_causal_lm: {self._model_name}'s {self._layer_names[k]} returned"
                        f" a {type(h).__name__}, not the hidden states tensor (a transformers"
                        " 4.x layer? split_causal_lm needs transformers >= 5)"
                    )
        finally:
            for hook in hooks:
                hook.remove()
        # The earlier stages' router logits pass through (their gradient comes back from
        # the last stage's router loss), this stage's own follow, in layer order.
        routers = (*router_logits, *got)
        if not self.last:
            return h if self._aux is None else Args(h, router_logits=routers)
        for module in self._post:  # the final norm, then the head: the logits
            h = module(h)
        if self._aux is None:
            return h
        return {"logits": h, "router_logits": routers}

    def _uses_cache(self, use_cache: bool | None) -> bool:
        """Whether the model's forward would make a cache (its ``merge_with_config_defaults``
        rule: the argument, else ``config.use_cache``; off under gradient checkpointing in
        training). The layers never get it; only the masks depend on it."""
        if use_cache is None:
            use_cache = bool(getattr(self._config, "use_cache", False))
        checkpointing = getattr(self._base[0], "gradient_checkpointing", False)
        if checkpointing and self.training and torch.is_grad_enabled():
            return False
        return use_cache

    def _recorder(self, got: list[torch.Tensor]) -> Callable[..., None]:
        """A forward hook that keeps a router's logits, as transformers' output capture
        does (the output itself, or its ``index`` item when it is a tuple)."""
        assert self._aux is not None
        index = self._aux.index

        def hook(_m: nn.Module, _args: Any, out: Any) -> None:
            value = out[index] if isinstance(out, tuple) else out
            if value is not None:
                got.append(value)

        return hook


class CausalLMLoss:
    """The loss a Hugging Face causal LM computes from ``labels``: its own
    ``loss_function`` on the last stage's logits, plus ``router_aux_loss_coef`` times its
    own ``load_balancing_loss_func`` over every layer's router logits when the model's loss
    includes it (``config.output_router_logits``).

    Args:
        model: The causal LM.
        aux: The router loss, if any.
    """

    def __init__(self, model: nn.Module, aux: _Aux | None = None) -> None:
        self._model = model
        self._vocab = int(model.config.vocab_size)  # type: ignore[union-attr, arg-type]
        self._aux = aux

    def __call__(self, output: Any, mb: Any) -> torch.Tensor:
        """The microbatch's loss.

        Args:
            output: The last stage's output.
            mb: The microbatch (its ``labels``; the ``attention_mask`` for the router loss).

        Returns:
            The scalar loss, as the model's ``forward(**data).loss`` computes it.

        Raises:
            PlanError: the microbatch has no ``labels``.
        """
        data = _data(mb)
        labels = data.get("labels")
        if not isinstance(labels, torch.Tensor):
            raise PlanError(
                f"split_causal_lm: the loss needs the labels of {_which(mb)} (keys: {sorted(data)})"
            )
        logits = output["logits"] if self._aux is not None else output
        fn: Any = self._model.loss_function
        loss: torch.Tensor = fn(logits=logits, labels=labels, vocab_size=self._vocab)
        if self._aux is not None:
            aux = self._aux.loss(
                tuple(output["router_logits"]),
                self._aux.num_experts,
                self._aux.top_k,
                data.get("attention_mask"),
            )
            loss = loss + self._aux.coef * aux.to(loss.device)
        return loss


@dataclass(frozen=True)
class CausalLMSplit(StageSplit):
    """A Hugging Face causal LM split into stages, with how to feed and score them.

    A :class:`~rrfp_async.StageSplit` (``modules``, ``shared``, ``modules_of``) whose
    modules are :class:`CausalLMStage`; a microbatch is the model's keyword inputs (a mapping,
    or an ``rr.Microbatch`` whose ``data`` is one): ``input_ids``, ``labels``, and optionally
    ``attention_mask``, ``position_ids`` and ``use_cache``.

    Attributes:
        loss_fn: The model's own loss (:class:`CausalLMLoss`), for the last stage.
        layers: Per stage, its decoder layers ``(first, end)``.
        input_fn: The first stage's input (the ``input_ids``).
        side_inputs: Each stage's keyword inputs from its own rank's microbatch (the
            ``attention_mask``, ``position_ids`` and ``use_cache``, those it has).
    """

    loss_fn: CausalLMLoss
    layers: tuple[tuple[int, int], ...]
    input_fn = staticmethod(causal_lm_input)
    side_inputs = staticmethod(causal_lm_side_inputs)

    def executor(self, stages: Sequence[int], **kwargs: Any) -> TorchStageExecutor:
        """A ``TorchStageExecutor`` for some of the stages (those a rank holds), with the
        split's loss, input, side inputs and ties.

        Args:
            stages: The virtual stages this rank holds.
            **kwargs: More ``TorchStageExecutor`` arguments (``rank``, ``loss_scale``, ...).

        Returns:
            The executor.

        Raises:
            PlanError: a stage outside the split, or what ``TorchStageExecutor`` raises.
        """
        return TorchStageExecutor(
            self.modules_of(stages),
            self.loss_fn,
            input_fn=causal_lm_input,
            side_inputs=causal_lm_side_inputs,
            shared=self.shared,
            **kwargs,
        )


def _starts(split_spec: int | Sequence[str], anatomy: _Anatomy) -> list[int]:
    """The first layer of each stage."""
    n = len(anatomy.layers)
    if (
        isinstance(split_spec, bool)
        or not isinstance(split_spec, int | Sequence)
        or isinstance(split_spec, str | bytes)
    ):
        raise PlanError(
            "split_spec: expected a number of stages or the names of the layers where stages "
            f"begin (['{anatomy.layers_name}.2']), got {split_spec!r}"
        )
    if isinstance(split_spec, int):
        if not 1 <= split_spec <= n:
            raise PlanError(
                f"split_spec: {split_spec} stages; {anatomy.name} has {n} decoder layers, so 1 "
                f"to {n} stages"
            )
        size, extra = divmod(n, split_spec)
        return [v * size + min(v, extra) for v in range(split_spec)]
    full = anatomy.layers_name
    short = full.partition(".")[2]
    starts = [0]
    for name in split_spec:
        i = None
        if isinstance(name, str):
            for stem in (full, short):
                head, dot, tail = name.rpartition(".")
                if head == stem and dot and tail.isdigit():
                    i = int(tail)
        if i is None or not 0 < i < n:
            raise PlanError(
                f"split_spec: {name!r} is no layer a stage can begin at; they are "
                f"{full}.1 .. {full}.{n - 1} (or {short}.1 ..): the first stage begins with "
                "the embedding"
            )
        if i <= starts[-1]:
            raise PlanError(
                f"split_spec: layer names must increase; {name!r} does not come after layer "
                f"{starts[-1]}"
            )
        starts.append(i)
    return starts


def split_causal_lm(
    model: nn.Module, split_spec: int | Sequence[str], *, check: bool = True
) -> CausalLMSplit:
    """Split a Hugging Face causal LM (``LlamaForCausalLM``, ``Qwen2ForCausalLM``,
    ``MistralForCausalLM``, ``GPTNeoXForCausalLM``, ``MixtralForCausalLM``, ...) into
    pipeline stages that compute what its own ``forward`` and loss compute.

    The first stage embeds, every stage runs its decoder layers with the masks, position ids
    and rotary tables the model's forward would give them, the last stage normalises and
    projects to the vocabulary; ``loss_fn`` is the model's own loss (with the router
    load-balancing loss when ``config.output_router_logits`` is set). Tied input and output
    embeddings are found (``shared``). See ``docs/hf_models.md``.

    Args:
        model: The causal LM (a transformers >= 5 ``PreTrainedModel`` with a head), the
            whole model on every rank (each rank keeps its stages).
        split_spec: A number of stages (the decoder layers split evenly, the first stages
            one more when they do not divide), or the layers where stages 1, 2, ... begin:
            ``["model.layers.2"]`` (or ``["layers.2"]``).
        check: Run small probe batches (padded rows, packed sequences) through the stages
            and through the model's own ``forward`` (eval mode, no grad) and refuse the
            model unless logits and loss agree.

    Returns:
        The split: stage modules, tied parameters, loss, input and side-input functions.

    Raises:
        PlanError: transformers is missing or older than 5; the model is no causal LM
            (encoder, no head), has no ``base_model_pp_plan``, holds a module neither plan
            places, has a decoder layer whose call is unknown, soft-caps its logits, or its
            forward and the stages disagree on the probe; a bad ``split_spec``.
    """
    anatomy = _anatomy(model)
    starts = _starts(split_spec, anatomy)
    ends = [*starts[1:], len(anatomy.layers)]
    last = len(starts) - 1
    stages = [
        CausalLMStage(anatomy, lo, hi, first=v == 0, last=v == last)
        for v, (lo, hi) in enumerate(zip(starts, ends, strict=True))
    ]
    found = from_stage_modules(stages)
    split = CausalLMSplit(
        found.modules,
        found.shared,
        loss_fn=CausalLMLoss(model, anatomy.aux),
        layers=tuple(zip(starts, ends, strict=True)),
    )
    if check:
        _probe(model, split, anatomy)
    return split


# ------------------------------------------------------------------------------ the probe


def _probe_batches(anatomy: _Anatomy) -> dict[str, dict[str, Any]]:
    """The probes: two rows of token ids, the second left-padded (mask 0, label -100); one
    row of two packed sequences (positions restart, no padding mask), with the model's
    default cache rule and without a cache (then transformers masks the sequences from
    each other). Long enough for a small sliding window."""
    window = getattr(anatomy.config, "sliding_window", None)
    n = window + 4 if isinstance(window, int) and 8 <= window + 4 <= 64 else 12
    vocab = int(anatomy.config.vocab_size)
    emb = next(iter(anatomy.pre[0][1].parameters()), None) if anatomy.pre else None
    device = emb.device if emb is not None else torch.device("cpu")
    ids = (torch.arange(2 * n, device=device).reshape(2, n) * 7 + 3) % max(vocab - 1, 1) + 1
    mask = torch.ones(2, n, dtype=torch.long, device=device)
    mask[1, :3] = 0
    k = n // 2
    pos = torch.cat([torch.arange(k, device=device), torch.arange(n - k, device=device)])
    return {
        "padded": {
            "input_ids": ids,
            "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100),
        },
        "packed": {"input_ids": ids[:1], "position_ids": pos.unsqueeze(0), "labels": ids[:1]},
        "packed without cache": {
            "input_ids": ids[:1],
            "position_ids": pos.unsqueeze(0),
            "use_cache": False,
            "labels": ids[:1],
        },
    }


def _run_probe(
    model: nn.Module, split: CausalLMSplit, name: str, data: Mapping[str, Any]
) -> tuple[Any, Any, torch.Tensor]:
    """The model's own output and the stages' (output, loss) on one probe, under no_grad;
    an error on the way is a PlanError naming where it arose."""
    with torch.no_grad():
        try:
            ref = model(**data)
        except Exception as e:
            raise _refuse(
                name, f"its own forward failed on a probe batch: {type(e).__name__}: {e}"
            ) from e
        try:
            out: Any = causal_lm_input(data)
            for v, stage in enumerate(split.modules):
                out = call_module(stage, out, causal_lm_side_inputs(v, data))
            return ref, out, split.loss_fn(out, data)
        except PlanError:
            raise
        except Exception as e:
            raise _refuse(
                name,
                "its layers failed when called as split_causal_lm calls them: "
                f"{type(e).__name__}: {e}",
            ) from e


def _probe(model: nn.Module, split: CausalLMSplit, anatomy: _Anatomy) -> None:
    """Refuse the model unless its stages compute what its forward computes (a PlanError
    naming the difference), in eval mode (no dropout), the modules' modes restored after."""
    name = anatomy.name
    if any(p.is_meta for p in model.parameters()):
        raise _refuse(
            name,
            "its parameters are on the meta device, so the check against its own forward "
            "cannot run; materialise them first, or pass check=False",
        )
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        runs = {k: _run_probe(model, split, name, d) for k, d in _probe_batches(anatomy).items()}
    finally:
        for m, mode in modes:
            m.training = mode
    for probe, (ref, out, loss) in runs.items():
        logits = out["logits"] if isinstance(out, dict) else out
        want = ref.logits
        if not isinstance(want, torch.Tensor) or logits.shape != want.shape:
            raise _refuse(
                name,
                f"its forward returns logits of shape {getattr(want, 'shape', None)}, the "
                f"stages {tuple(logits.shape)}",
            )
        # The same modules on the same values: equal up to kernels that are not
        # deterministic (none on CPU); a missed scale or mask differs by far more.
        tol = 64 * torch.finfo(want.dtype).eps
        for what, a, b in (("logits", logits, want), ("loss", loss, ref.loss)):
            if not isinstance(b, torch.Tensor):
                raise _refuse(name, f"its forward computes no {what} from labels")
            scale = max(1.0, float(b.abs().max()))
            diff = float((a.float() - b.float()).abs().max())
            if not diff <= tol * scale:  # also catches NaN
                raise _refuse(
                    name,
                    f"on the {probe} probe batch the stages' {what} differ from its own "
                    f"forward's by {diff:.3g}: its forward does something the stages do not "
                    "(a scale, a cap, another mask rule); split it by hand "
                    "(docs/hf_models.md), or pass check=False if you know why",
                )
