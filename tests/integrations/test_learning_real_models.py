"""The torch drop-in with no argument on real models: a Hugging Face decoder (Llama, split by
``rr.split_causal_lm``) and the lab's image-text model, 2 gloo processes, microbatches of
different sizes. Each step after the fit is planned within a byte budget; what the step
really held (the saved-tensor meter) must stay within it, and the gradients must be plain
autograd's. The prediction errors are in docs/memory.md ("Measured on real models")."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests._pool import pooled_spawn

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

M = 6


# --- the Hugging Face decoder ----------------------------------------------------------------

# Tokens per microbatch, one unpadded sequence each: every step's six lengths are distinct
# (the first identifies the fit: 1, tokens, tokens**2), and each later step is new.
HF_STEPS = [
    [30, 4, 26, 6, 3, 28],
    [12, 40, 7, 33, 18, 2],
    [25, 3, 18, 60, 9, 14],
    [5, 44, 27, 11, 36, 20],
]


def hf_batch(step: int) -> list[dict[str, torch.Tensor]]:
    from tests.distributed._hf import VOCAB

    g = torch.Generator().manual_seed(100 + step)
    out = []
    for n in HF_STEPS[step]:
        ids = torch.randint(1, VOCAB, (1, n), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def hf_model() -> Any:
    from tests.distributed import _hf_causal_lm

    return _hf_causal_lm.build("llama")


# --- the image-text model --------------------------------------------------------------------

# (images, text tokens) per microbatch: 16 patches an image, so 0-4 images and 8-40 text
# tokens make sequences of 8-104 tokens; images and text vary independently.
IT_STEPS = [
    [(0, 30), (2, 9), (1, 40), (3, 12), (4, 20), (1, 8)],
    [(2, 33), (0, 11), (4, 9), (1, 25), (3, 38), (0, 40)],
    [(3, 18), (1, 14), (0, 22), (4, 31), (2, 16), (2, 27)],
    [(1, 36), (4, 13), (2, 21), (0, 17), (3, 29), (1, 10)],
]


def it_config() -> Any:
    from rrfp_lab.models import ImageTextConfig

    return ImageTextConfig(n_layers=4, max_text=40)


def it_batch(step: int) -> list[dict[str, torch.Tensor]]:
    cfg = it_config()
    g = torch.Generator().manual_seed(200 + step)
    out = []
    for k, n in IT_STEPS[step]:
        images = torch.rand((k, cfg.channels, cfg.image_size, cfg.image_size), generator=g)
        text = torch.randint(0, cfg.vocab, (n,), generator=g)
        out.append({"images": images, "text": text})
    return out


def it_loss(logits: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
    # The lab's loss_fn without its Microbatch: the text comes last, each text position
    # predicts the next text token.
    n = text.shape[0]
    return F.cross_entropy(logits[0, -n:-1], text[1:])


# --- the run ---------------------------------------------------------------------------------


def worker(rank: int, world: int, kind: str) -> dict[str, Any]:
    """The steps of ``kind`` through the no-argument drop-in, every step measured."""
    from rrfp_async.integrations import _torch_learning

    # Every step measured (by default one in LEARN_EVERY once fitted), so that each step's
    # measured peak can be checked against its budget; restored (the process is pooled).
    every, _torch_learning.LEARN_EVERY = _torch_learning.LEARN_EVERY, 1
    try:
        return _steps(rank, world, kind)
    finally:
        _torch_learning.LEARN_EVERY = every


def _stage_module(rank: int, world: int, kind: str) -> tuple[nn.Module, Any]:
    if kind == "hf":
        import rrfp_async as rr

        split = rr.split_causal_lm(hf_model(), world)
        return split.modules[rank], lambda out, labels: split.loss_fn(out, {"labels": labels})
    from rrfp_lab.models import build_stage_modules

    return build_stage_modules(it_config(), world, [rank])[rank], it_loss


def _steps(rank: int, world: int, kind: str) -> dict[str, Any]:
    from torch.distributed.pipelining import PipelineStage

    from rrfp_async.pipelining import ScheduleReadinessFirst

    torch.set_num_threads(1)
    module, loss_fn = _stage_module(rank, world, kind)
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    schedule = ScheduleReadinessFirst(stage, M, loss_fn=loss_fn)
    out: dict[str, Any] = {"steps": [], "grads": []}
    for k in range(len(HF_STEPS if kind == "hf" else IT_STEPS)):
        mbs = hf_batch(k) if kind == "hf" else it_batch(k)
        args: list[tuple[Any, ...]]
        if kind == "hf":
            args = [(mb["input_ids"],) for mb in mbs]
            targets = [mb["labels"] for mb in mbs]
        else:
            # Stage 0 takes the data dict as its one positional input: as keywords it would
            # reach every stage (torch's rule), and stage 1 takes the hidden state alone.
            args = [(mb,) for mb in mbs]
            targets = [mb["text"] for mb in mbs]
        schedule.step_microbatches(
            arg_mbs=args if rank == 0 else None,
            target_mbs=targets if rank == world - 1 else None,
        )
        st = schedule.last_stats
        assert st is not None
        measured = schedule.activation_bytes()
        learned = schedule.learned_bytes
        assert learned is not None
        out["grads"].append(
            {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
        )
        out["steps"].append(
            {
                "budget": st.budget_bytes,
                "planned_peak": st.peak_bytes,
                "measured_peak": st.held_peak(measured),
                "measured": dict(measured),
                "error": learned.error(schedule.plan),
            }
        )
        module.zero_grad(set_to_none=True)
    schedule.close()
    return out


def reference_grads(kind: str, steps: int) -> list[dict[str, torch.Tensor]]:
    """Plain single-process autograd on the whole model: each step's gradients, each
    microbatch's loss / M (torch's ``scale_grads``)."""
    out = []
    if kind == "hf":
        model = hf_model()
        for k in range(steps):
            for mb in hf_batch(k):
                (model(**mb).loss / M).backward()
            out.append({n: p.grad.clone() for n, p in model.named_parameters()})
            model.zero_grad(set_to_none=True)
        return out
    from rrfp_lab.models import full_model

    whole = full_model(it_config())
    for k in range(steps):
        for mb in it_batch(k):
            (it_loss(whole(mb), mb["text"]) / M).backward()
        out.append({n: p.grad.clone() for n, p in whole.named_parameters()})
        whole.zero_grad(set_to_none=True)
    return out


def _plain_fit_error(res: list[dict[str, Any]]) -> float:
    """The largest out-of-sample error of a fit of the image-text run's measured bytes on
    the sizes as auto learning reads them, without the products of two sizes."""
    from rrfp_async.distributed import ActivationModel
    from rrfp_async.integrations._torch_learning import _NAMES, chunk_sizes
    from rrfp_async.integrations._torch_step_inputs import Chunk

    model = ActivationModel()
    for k in range(len(IT_STEPS)):
        sizes = [
            dict(zip(_NAMES, chunk_sizes(Chunk((mb,), {}, None, None)), strict=True))
            for mb in it_batch(k)
        ]
        for r in range(2):
            measured = res[r]["steps"][k]["measured"]
            model.observe_many(r, [(sizes[i], measured[(r, i)]) for i in range(M)])
    return max(model.error(r) for r in range(2))


@pytest.mark.parametrize("kind", ["hf", "image_text"])
def test_a_real_model_holds_its_measured_budget(kind: str) -> None:
    res = pooled_spawn(worker, 2, kind, timeout=280)
    for r in range(2):
        steps = res[r]["steps"]
        # The first step runs before anything was measured: 1F1B's count bound (2 forwards
        # held on rank 0, 1 on rank 1). Its six sizes identify every stage's fit, so from
        # the second step on each step is planned in bytes, and what it really held stays
        # within them. On CPU the saved-tensor bytes are exact and a polynomial of degree 2
        # in the sizes: the predictions are the measurements (errors ~1e-14).
        assert steps[0]["budget"] == 2 - r, steps[0]
        for s in steps[1:]:
            assert s["budget"] is not None and s["budget"] > 1000, s  # bytes, not a count
            assert s["measured_peak"] <= s["budget"], (kind, r, s)
            assert s["planned_peak"] == s["measured_peak"], (kind, r, s)
            assert s["error"] < 1e-9, (kind, r, s["error"])
        print(
            f"{kind} rank {r}: error {steps[-1]['error']:.1e}; measured peak / budget"
            f" {[(s['measured_peak'], s['budget']) for s in steps[1:]]}"
        )
    if kind == "image_text":
        # Not vacuous: this model's bytes are no polynomial of degree 2 in the first size read
        # (the images' rows) alone, nor are they once the text's tokens are added as a plain
        # column: its attention's square is of their sum. The same measurements, fitted
        # without the products of the sizes, are far off (11% here; the run
        # planned with such a fit went over its budget).
        plain = _plain_fit_error(res)
        assert plain > 0.05, plain
    # Training is unchanged: each step's gradients are plain autograd's on the whole model
    # (the stages hold the model's modules under its names).
    want = reference_grads(kind, len(res[0]["steps"]))
    for k, ref in enumerate(want):
        got = {**res[0]["grads"][k], **res[1]["grads"][k]}
        assert got.keys() == ref.keys(), sorted(set(got) ^ set(ref))
        for n, g in got.items():
            torch.testing.assert_close(g, ref[n], rtol=0, atol=1e-6, msg=f"step {k} {n}")
