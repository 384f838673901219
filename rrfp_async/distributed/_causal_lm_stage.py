"""The stages of a split Hugging Face causal LM (``CausalLMStage``), what each reads from its
own rank's microbatch (``causal_lm_input``, ``causal_lm_side_inputs``) and the last stage's
loss (``CausalLMLoss``).

Design note:

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

The stage modules hold the model's own module objects under the model's own names
(``model.layers.3.mlp.up_proj.weight``), so a tied ``lm_head.weight`` *is*
``model.embed_tokens.weight``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .._costs import Microbatch
from .._errors import PlanError
from .._pytree import Args
from ._causal_lm_anatomy import Anatomy, RouterAux
from ._split import register_block

__all__ = ["CausalLMLoss", "CausalLMStage", "causal_lm_input", "causal_lm_side_inputs"]

#: The microbatch keys each stage reads from its own rank's microbatch.
_SIDE_KEYS = ("attention_mask", "position_ids", "use_cache")


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

    def __init__(self, anatomy: Anatomy, lo: int, hi: int, *, first: bool, last: bool) -> None:
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
            # Not every config has use_cache; gradient_checkpointing is PreTrainedModel's.
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

    def __init__(self, model: nn.Module, aux: RouterAux | None = None) -> None:
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
