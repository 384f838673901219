"""The probe ``split_causal_lm`` runs before anyone trains (``probe_split``).

Design note: the plans say which modules run, not everything a forward does (a scale, a
soft cap, a different mask rule). Unless ``check=False``, the split runs small probe batches
(padded rows; packed sequences with and without a cache) through its stages and through the
model's own ``forward`` (eval mode, no grad) and refuses the model, naming the difference,
unless the logits and the loss agree; an error raised inside transformers on the way
becomes a ``PlanError`` too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .._errors import PlanError
from .._pytree import call_module
from ._causal_lm_anatomy import Anatomy, refuse
from ._causal_lm_stage import causal_lm_input, causal_lm_side_inputs

__all__ = ["probe_split"]


def _probe_batches(anatomy: Anatomy) -> dict[str, dict[str, Any]]:
    """The probes: two rows of token ids, the second left-padded (mask 0, label -100); one
    row of two packed sequences (positions restart, no padding mask), with the model's
    default cache rule and without a cache (then transformers masks the sequences from
    each other). Long enough for a small sliding window."""
    # Only sliding-window models (Mistral, Gemma 2, ...) configure sliding_window.
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
    model: nn.Module,
    modules: Sequence[nn.Module],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    name: str,
    data: Mapping[str, Any],
) -> tuple[Any, Any, torch.Tensor]:
    """The model's own output and the stages' (output, loss) on one probe, under no_grad;
    an error on the way is a PlanError naming where it arose."""
    with torch.no_grad():
        try:
            ref = model(**data)
        except Exception as e:
            raise refuse(
                name, f"its own forward failed on a probe batch: {type(e).__name__}: {e}"
            ) from e
        try:
            out: Any = causal_lm_input(data)
            for v, stage in enumerate(modules):
                out = call_module(stage, out, causal_lm_side_inputs(v, data))
            return ref, out, loss_fn(out, data)
        except PlanError:
            raise
        except Exception as e:
            raise refuse(
                name,
                "its layers failed when called as split_causal_lm calls them: "
                f"{type(e).__name__}: {e}",
            ) from e


def probe_split(
    model: nn.Module,
    modules: Sequence[nn.Module],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    anatomy: Anatomy,
) -> None:
    """Refuse the model unless its stages compute what its forward computes (a PlanError
    naming the difference), in eval mode (no dropout), the modules' modes restored after."""
    name = anatomy.name
    if any(p.is_meta for p in model.parameters()):
        raise refuse(
            name,
            "its parameters are on the meta device, so the check against its own forward "
            "cannot run; materialise them first, or pass check=False",
        )
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        probes = _probe_batches(anatomy)
        runs = {k: _run_probe(model, modules, loss_fn, name, d) for k, d in probes.items()}
    finally:
        for m, mode in modes:
            m.training = mode
    for probe, (ref, out, loss) in runs.items():
        logits = out["logits"] if isinstance(out, dict) else out
        want = ref.logits
        if not isinstance(want, torch.Tensor) or logits.shape != want.shape:
            raise refuse(
                name,
                f"its forward returns logits of shape {getattr(want, 'shape', None)}, the "
                f"stages {tuple(logits.shape)}",
            )
        # The same modules on the same values: equal up to kernels that are not
        # deterministic (none on CPU); a missed scale or mask differs by far more.
        tol = 64 * torch.finfo(want.dtype).eps
        for what, a, b in (("logits", logits, want), ("loss", loss, ref.loss)):
            if not isinstance(b, torch.Tensor):
                raise refuse(name, f"its forward computes no {what} from labels")
            scale = max(1.0, float(b.abs().max()))
            diff = float((a.float() - b.float()).abs().max())
            if not diff <= tol * scale:  # also catches NaN
                raise refuse(
                    name,
                    f"on the {probe} probe batch the stages' {what} differ from its own "
                    f"forward's by {diff:.3g}: its forward does something the stages do not "
                    "(a scale, a cap, another mask rule); split it by hand "
                    "(docs/hf_models.md), or pass check=False if you know why",
                )
