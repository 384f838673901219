"""The megatron-core drop-in against Megatron's own 1F1B schedule.

The worker is written the way a megatron-core script is (``parallel_state``, a
``TransformerConfig``, ``forward_step_func(data_iterator, model) -> (output, loss_func)``,
the keyword-only forward-backward call); the only line that differs between the runs is
which ``get_forward_backward_func`` it calls. Every rank runs Megatron's schedule and the
drop-in (strict 1F1B order, then the defaults) on the same stage and data, in one process
pair (megatron's import dominates the cost of a spawn).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import rrfp_async as rr
from tests._pool import pooled_spawn

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

D, M, B = 8, 6, 2  # M = 6: dividing by it is inexact (4 would hide where it happens)

WHICH = ("megatron", "strict", "default")


@pytest.fixture(scope="module", autouse=True)
def _megatron() -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TE / Apex missing
        pytest.importorskip("megatron.core")


def seq_len(m: int, variable: bool) -> int:
    return 3 + 2 * m if variable else 5


def data(variable: bool) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """M microbatches ``(x, y, mask)`` in Megatron's ``[seq, batch, hidden]`` layout."""
    g = torch.Generator().manual_seed(7)
    out = []
    for m in range(M):
        s = seq_len(m, variable)
        x, y = torch.randn(s, B, D, generator=g), torch.randn(s, B, D, generator=g)
        mask = (torch.rand(s, B, generator=g) > 0.3).float()
        out.append((x, y, mask))
    return out


def make_stage(config: Any, rank: int, world: int) -> nn.Module:
    from megatron.core.enums import ModelType
    from megatron.core.transformer.module import MegatronModule

    class Stage(MegatronModule):
        """One pipeline stage: Linear + tanh, taking the received tensor as Megatron's
        stages do (``set_input_tensor``)."""

        def __init__(self) -> None:
            super().__init__(config)
            self.model_type = ModelType.encoder_or_decoder
            self.pre_process = rank == 0
            torch.manual_seed(100 + rank)
            self.lin = nn.Linear(D, D)
            self.input_tensor: torch.Tensor | None = None

        def set_input_tensor(self, input_tensor: Any) -> None:
            self.input_tensor = input_tensor[0] if isinstance(input_tensor, list) else input_tensor

        def forward(self, x: torch.Tensor | None) -> torch.Tensor:
            h = x if self.pre_process else self.input_tensor
            assert h is not None
            return torch.tanh(self.lin(h))

    class Wrapper(nn.Module):  # as DDP wraps: the adapter must unwrap to set_input_tensor
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

        def forward(self, *a: Any) -> Any:
            return self.module(*a)

    return Wrapper(Stage())


def loss_mean(y: torch.Tensor, mask: torch.Tensor, out: torch.Tensor) -> Any:
    loss = ((out - y) ** 2).mean()
    return loss, {"lm loss": loss.detach().clone()}


def loss_tokens(y: torch.Tensor, mask: torch.Tensor, out: torch.Tensor) -> Any:
    loss = (((out - y) ** 2).sum(-1) * mask).sum()
    n = mask.sum().to(torch.int)
    return loss, n, {"lm loss": torch.stack([loss.detach().clone(), n.float()])}


def forward_step(kind: str, data_iterator: Iterator[Any] | None, model: nn.Module) -> Any:
    assert data_iterator is not None
    x, y, mask = next(data_iterator)
    out = model(x)
    return out, functools.partial(loss_mean if kind == "mean" else loss_tokens, y, mask)


VOCAB = 32


def make_gpt(config: Any, rank: int, world: int) -> nn.Module:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from tests.integrations import megatron_cpu

    megatron_cpu.no_op_rng_tracker()
    torch.manual_seed(200 + rank)
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=32,
        pre_process=rank == 0,
        post_process=rank == world - 1,
        share_embeddings_and_output_weights=False,
    )


def gpt_data(variable: bool) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """M microbatches ``(tokens, labels, loss_mask)``, ``[batch, seq]``."""
    g = torch.Generator().manual_seed(7)
    out = []
    for m in range(M):
        s = seq_len(m, variable)
        tokens = torch.randint(0, VOCAB, (B, s + 1), generator=g)
        mask = (torch.rand(B, s, generator=g) > 0.3).float()
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), mask))
    return out


def gpt_forward_step(kind: str, data_iterator: Iterator[Any] | None, model: nn.Module) -> Any:
    assert data_iterator is not None
    tokens, labels, mask = next(data_iterator)
    pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    out = model(tokens, pos, None, labels=labels)  # per-token losses on the last stage

    def loss_func(out: torch.Tensor) -> Any:  # Megatron-LM's three-tuple form
        loss = (out.float() * mask).sum()
        n = mask.sum().to(torch.int)
        return loss, n, {"lm loss": torch.stack([loss.detach().clone(), n.float()])}

    return out, loss_func


def worker(
    rank: int,
    world: int,
    kind: str,
    variable: bool,
    forward_only: bool,
    arch: str = "mlp",
    pp: int | None = None,
) -> Any:
    from tests.integrations import megatron_cpu

    megatron_cpu.install()
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func as megatron_fb
    from megatron.core.transformer.transformer_config import TransformerConfig

    from rrfp_async.megatron import get_forward_backward_func as rr_fb

    pp = world if pp is None else pp
    ps.initialize_model_parallel(pipeline_model_parallel_size=pp)
    events: list[Any] = []
    backwards = [0]

    @contextlib.contextmanager
    def no_sync() -> Iterator[None]:
        events.append(("enter", backwards[0]))
        yield
        events.append(("exit", backwards[0]))  # Megatron: right before the last backward

    finalized: list[Any] = []

    def finalize(models: list[nn.Module], num_tokens: Any, **kw: Any) -> None:
        finalized.append((len(models), None if num_tokens is None else int(num_tokens)))
        if num_tokens is not None and int(num_tokens) > 0:
            for p in models[0].parameters():
                p.grad /= int(num_tokens)

    config = TransformerConfig(
        num_layers=pp,
        hidden_size=D,
        num_attention_heads=2,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        variable_seq_lengths=variable,
        moe_token_dispatcher_type="alltoall",
        calculate_per_token_loss=kind == "tokens",
    )
    config.no_sync_func = no_sync
    config.finalize_model_grads_func = finalize
    config.grad_scale_func = lambda t: t * 3.0
    model = (make_stage if arch == "mlp" else make_gpt)(
        config, ps.get_pipeline_model_parallel_rank(), pp
    )
    weight = next(iter(model.parameters()))  # counts the backwards that reached it
    weight.register_hook(lambda g: (backwards.__setitem__(0, backwards[0] + 1), g)[1])
    init = [p.detach().clone() for p in model.parameters()]
    results: dict[str, Any] = {}
    for which in WHICH:
        with torch.no_grad():
            for p, p0 in zip(model.parameters(), init, strict=True):
                p.copy_(p0)
                p.grad = None
        events.clear()
        finalized.clear()
        backwards[0] = 0
        if which == "megatron":  # the one line that differs
            fb = megatron_fb()
        elif which == "strict":
            fb = rr_fb(policy="strict", hint="1f1b", step_timeout=60)
        else:
            fb = rr_fb(step_timeout=60)
        losses = fb(
            forward_step_func=functools.partial(
                forward_step if arch == "mlp" else gpt_forward_step, kind
            ),
            data_iterator=iter((data if arch == "mlp" else gpt_data)(variable)),
            model=model,
            num_microbatches=M,
            seq_length=seq_len(0, variable),
            micro_batch_size=B,
            forward_only=forward_only,
        )
        results[which] = {
            "losses": [{k: v.clone() for k, v in d.items()} for d in losses],
            "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
            "events": list(events),
            "finalized": list(finalized),
        }
    for which in ("strict", "default"):
        rr_fb(
            **({"policy": "strict", "hint": "1f1b"} if which == "strict" else {}), step_timeout=60
        ).close()
    ps.destroy_model_parallel()
    return results


def check(res: list[Any], *, forward_only: bool) -> None:
    last = len(res) - 1
    for r, got in enumerate(res):
        want = got["megatron"]
        if r == last:
            assert len(want["losses"]) == M
        else:
            assert want["losses"] == []
        for which in ("strict", "default"):
            mine = got[which]
            assert len(mine["losses"]) == len(want["losses"])
            for a, b in zip(mine["losses"], want["losses"], strict=True):
                assert a.keys() == b.keys()
                for k in a:
                    if which == "strict":
                        assert torch.equal(a[k], b[k]), (which, k, a[k], b[k])
                    else:
                        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-5)
            # Megatron leaves no_sync entered after a forward-only step; the drop-in leaves it.
            closed = [("exit", 0)] if forward_only else []
            assert mine["events"] == want["events"] + closed, (r, which)
            assert mine["finalized"] == want["finalized"], (r, which)
            for a, b in zip(mine["grads"], want["grads"], strict=True):
                if forward_only:
                    assert a is None and b is None
                elif which == "strict":
                    assert torch.equal(a, b), (r, (a - b).abs().max())  # bitwise: same order
                else:
                    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("kind", "variable"),
    [("mean", False), ("tokens", True)],
    ids=["loss_mean-fixed_len", "per_token-variable_len"],
)
def test_one_changed_line_same_losses_and_grads_as_megatron(kind: str, variable: bool) -> None:
    res = pooled_spawn(worker, 2, kind, variable, False, timeout=240)
    check(res, forward_only=False)
    want = res[1]["megatron"]
    assert want["events"][0] == ("enter", 0) and want["events"][-1] == ("exit", M - 1)
    assert res[0]["megatron"]["finalized"] == [(1, 0 if kind == "tokens" else None)]


@pytest.mark.parametrize(
    ("kind", "variable"),
    [("tokens_avg", False), ("tokens", True)],
    ids=["three_tuple_averaged-fixed_len", "per_token-variable_len"],
)
def test_gpt_model_local_spec_same_as_megatron(kind: str, variable: bool) -> None:
    """GPTModel (local layer spec): the 3-tuple loss divided by its tokens and M, and the
    per-token path (``calculate_per_token_loss``, tokens to ``finalize_model_grads_func``)."""
    res = pooled_spawn(worker, 2, kind, variable, False, "gpt", timeout=240)
    check(res, forward_only=False)
    assert len(res[0]["megatron"]["grads"]) > 4  # the embedding and a transformer layer


def test_two_data_parallel_pipelines() -> None:
    """PP 2 x DP 2: the layout comes from parallel_state (each rank's place all-gathered)."""
    res = pooled_spawn(worker, 4, "mean", True, False, "mlp", 2, timeout=280)
    # Megatron's default order ("tp-cp-ep-dp-pp"): the pipelines are ranks {0, 2} and {1, 3}.
    check([res[0], res[2]], forward_only=False)
    check([res[1], res[3]], forward_only=False)


def test_forward_only_returns_loss_dicts_and_computes_no_grads() -> None:
    res = pooled_spawn(worker, 2, "mean", True, True, timeout=240)
    check(res, forward_only=True)
    assert res[1]["strict"]["finalized"] == []


class _Configured(nn.Module):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        import warnings

        from megatron.core.transformer.transformer_config import TransformerConfig

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # megatron's own deprecation notes
            self.config = TransformerConfig(num_layers=1, hidden_size=D, num_attention_heads=1)
        for k, v in config.items():
            setattr(self.config, k, v)


def call(fb: Any, **kw: Any) -> Any:
    args: dict[str, Any] = {
        "forward_step_func": functools.partial(forward_step, "mean"),
        "data_iterator": iter([]),
        "num_microbatches": M,
        "seq_length": 5,
        "micro_batch_size": B,
    }
    args.update(kw)
    args.setdefault("model", _Configured(args.pop("config", {})))
    return fb(**args)


@pytest.mark.parametrize(
    ("kw", "named"),
    [
        ({"model": [nn.Linear(1, 1), nn.Linear(1, 1)]}, r"model is a list of 2 model chunks"),
        ({"data_iterator": [iter([]), iter([])]}, r"data_iterator is a list of 2 model chunks"),
        ({"pg_collection": object()}, r"pg_collection: custom process groups"),
        (
            {"p2p_communicator": object(), "pg_collection": object()},
            r"p2p_communicator and pg_collection: custom process groups",
        ),
        ({"collect_non_loss_data": True}, r"collect_non_loss_data=True in a training step"),
        (
            {"config": {"num_microbatches_with_partial_activation_checkpoints": 2}},
            r"config\.num_microbatches_with_partial_activation_checkpoints: partial",
        ),
        (
            {"config": {"defer_embedding_wgrad_compute": True}},
            r"config\.defer_embedding_wgrad_compute",
        ),
        ({"num_microbatches": 0}, r"num_microbatches must be an int >= 1, got 0"),
    ],
    ids=lambda x: "-".join(x) if isinstance(x, dict) else None,
)
def test_unsupported_arguments_are_named(kw: dict[str, Any], named: str) -> None:
    from rrfp_async.megatron import get_forward_backward_func

    with pytest.raises(rr.PlanError, match=named):
        call(get_forward_backward_func(), **kw)


def test_interleaved_is_refused_by_name() -> None:
    from rrfp_async.megatron import get_forward_backward_func

    with pytest.raises(rr.PlanError, match=r"vp_size=2: the interleaved \(virtual pipeline\)"):
        get_forward_backward_func(vp_size=2)


def test_same_keywords_same_function() -> None:
    """Megatron-LM calls get_forward_backward_func() every step: one stage, not one per step."""
    from rrfp_async.megatron import MegatronForwardBackward, get_forward_backward_func

    fb = get_forward_backward_func(policy="strict", hint="1f1b")
    assert isinstance(fb, MegatronForwardBackward)
    assert get_forward_backward_func(policy="strict", hint="1f1b") is fb
    assert get_forward_backward_func() is not fb


def test_import_rrfp_async_does_not_import_megatron() -> None:
    import subprocess
    import sys

    code = "import sys, rrfp_async, rrfp_async.megatron; print('megatron' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
