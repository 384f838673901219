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
forward does for all of them, in four parts (each module's note says how):

* what runs where, read from the model (its pipeline plans), not from a list of classes,
  and the model refused where a stage could not call it: ``_causal_lm_anatomy``;
* masks, positions and rotary tables built on every stage from its own microbatch, MoE
  router logits travelling with the hidden states, the model's own loss:
  ``_causal_lm_stage``;
* a probe against the model's own ``forward`` before anyone trains: ``_causal_lm_probe``;
* here: where the stages begin (``split_spec``) and the split itself (``CausalLMSplit``).

The stage modules hold the model's own module objects under the model's own names
(``model.layers.3.mlp.up_proj.weight``), so a tied ``lm_head.weight`` *is*
``model.embed_tokens.weight``: ``from_stage_modules`` finds the tie, and ``shared`` declares
it to the executors. transformers is imported lazily, never by ``import rrfp_async``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from .._errors import PlanError
from ._causal_lm_anatomy import Anatomy, read_anatomy
from ._causal_lm_probe import probe_split
from ._causal_lm_stage import CausalLMLoss, CausalLMStage, causal_lm_input, causal_lm_side_inputs
from ._split import StageSplit, from_stage_modules
from ._torch_executor import TorchStageExecutor

__all__ = ["CausalLMSplit", "split_causal_lm"]


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


def _starts(split_spec: int | Sequence[str], anatomy: Anatomy) -> list[int]:
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
    anatomy = read_anatomy(model)
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
        probe_split(model, split.modules, split.loss_fn, anatomy)
    return split
