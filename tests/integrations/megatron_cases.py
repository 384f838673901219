"""The megatron-core drop-in against Megatron's own schedules: one worker, many cases.

Shared by ``tests/integrations/test_megatron.py`` (the main suite, megatron-core 0.16) and
``tests/compat/test_megatron.py`` (the compat tier, 0.19). The worker is written the way a
megatron-core script is (``parallel_state`` or Megatron-Bridge's process groups, a
``TransformerConfig``, ``forward_step_func(data_iterator, model) -> (output, loss_func)``,
the keyword-only forward-backward call of the case's call style); the only thing that
differs between the runs of one case is which ``get_forward_backward_func`` it calls. Every
rank runs each case with Megatron's own schedule, the drop-in under ``policy="strict"`` and
under the defaults, on the same model and data, in one process group (megatron's import
dominates the cost of a spawn, so one spawn serves many cases).

What is compared (``check``): losses and gradients (bitwise under strict, within 1e-6 under
readiness-first), the task order each rank ran (strict = Megatron's, recorded from
Megatron's own calls of ``forward_step_func`` and ``backward_step``), the ``no_sync`` /
``grad_sync_func`` / ``param_sync_func`` / ``finalize_model_grads_func`` calls.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

D, B, VOCAB = 8, 2, 32
WHICH = ("megatron", "strict", "default")
ATOL = 1e-6  # readiness-first: only the floating-point summation order differs


@dataclass(frozen=True)
class Case:
    """One configuration, run three ways (``WHICH``).

    Attributes:
        name: Its key in the results.
        style: ``"readme"`` (``get_forward_backward_func()``, megatron-core's README),
            ``"training"`` (Megatron-LM's ``training.py``: the factory with
            ``schedule_pg_collection=`` where megatron has it, the call with every keyword
            ``train_step`` passes), ``"bridge"`` (Megatron-Bridge's ``train.py`` /
            ``eval.py``: ``pp_size=``, ``vp_size=``, a list of chunks,
            ``p2p_communicator=P2PCommunicator(pp_group=, config=)``, ``pg_collection=``).
        vp: Virtual pipeline size (None: no interleaving).
        arch: ``"mlp"`` (a Linear + tanh stage) or ``"gpt"`` (megatron's ``GPTModel``, local
            layer spec).
        kind: ``"mean"`` (a 2-tuple loss), ``"tokens"`` (3-tuple, per-token loss), or
            ``"tokens_avg"`` (3-tuple, averaged by megatron).
        variable: Variable sequence lengths (``config.variable_seq_lengths``).
        forward_only: An evaluation step.
        m: Microbatches.
        group: ``config.microbatch_group_size_per_vp_stage`` (None: megatron's default, PP).
        grad_sync: Set ``config.grad_sync_func`` (and, with vp, ``param_sync_func``).
        own_groups: Bridge style with groups of its own (``HyperCommGrid``) and
            ``parallel_state`` not initialised: nothing may come from it.
        nbytes: The default run bounds activation bytes (``activation_bytes=`` from the
            microbatches' sequence lengths, ``memory_budget=1.0``): its budget must hold.
    """

    name: str
    style: str = "readme"
    vp: int | None = None
    arch: str = "mlp"
    kind: str = "mean"
    variable: bool = False
    forward_only: bool = False
    m: int = 6
    group: int | None = None
    grad_sync: bool = False
    own_groups: bool = False
    nbytes: bool = False


def seq_len(m: int, variable: bool) -> int:
    return 3 + 2 * m if variable else 5


def mlp_data(case: Case) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(mb, x, y, mask)`` per microbatch, megatron's ``[seq, batch, hidden]`` layout."""
    g = torch.Generator().manual_seed(7)
    out = []
    for m in range(case.m):
        s = seq_len(m, case.variable)
        x, y = torch.randn(s, B, D, generator=g), torch.randn(s, B, D, generator=g)
        mask = (torch.rand(s, B, generator=g) > 0.3).float()
        out.append((m, x, y, mask))
    return out


def gpt_data(case: Case) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(mb, tokens, labels, loss_mask)`` per microbatch, ``[batch, seq]``."""
    g = torch.Generator().manual_seed(7)
    out = []
    for m in range(case.m):
        s = seq_len(m, case.variable)
        tokens = torch.randint(0, VOCAB, (B, s + 1), generator=g)
        mask = (torch.rand(B, s, generator=g) > 0.3).float()
        out.append((m, tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), mask))
    return out


def make_mlp(config: Any, vstage: int, nvirtual: int) -> nn.Module:
    from megatron.core.enums import ModelType
    from megatron.core.transformer.module import MegatronModule

    class Stage(MegatronModule):
        """One virtual stage: Linear + tanh, taking the received tensor as Megatron's stages
        do (``set_input_tensor``)."""

        def __init__(self) -> None:
            super().__init__(config)
            self.model_type = ModelType.encoder_or_decoder
            self.pre_process = vstage == 0
            torch.manual_seed(100 + vstage)
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


def make_gpt(config: Any, vstage: int, nvirtual: int, chunk: int | None) -> nn.Module:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from tests.integrations import megatron_cpu

    megatron_cpu.no_op_rng_tracker()
    torch.manual_seed(200 + vstage)
    kw = {} if chunk is None else {"vp_stage": chunk}
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=32,
        pre_process=vstage == 0,
        post_process=vstage == nvirtual - 1,
        share_embeddings_and_output_weights=False,
        **kw,
    )


class Recorder:
    """The task order a rank runs, from the calls any schedule makes: ``forward_step_func``
    (the chunk is the model it gets, the microbatch the item it reads) and
    ``backward_step`` (patched in megatron's schedules module, which both megatron's
    schedules and the drop-in call; the output tensor names its forward)."""

    def __init__(self, models: list[nn.Module], pp: int, pp_rank: int) -> None:
        self.models, self.pp, self.pp_rank = models, pp, pp_rank
        self.order: list[str] = []
        self._outputs: dict[int, str] = {}
        self.counts = [0] * len(models)  # backwards that reached each chunk's weights

    def vstage(self, model: nn.Module) -> int:
        c = next(i for i, x in enumerate(self.models) if x is model)
        return c * self.pp + self.pp_rank

    def forward(self, model: nn.Module, mb: int, out: Any) -> None:
        v = self.vstage(model)
        self.order.append(f"{v}F{mb}")
        self._outputs[id(out)] = f"{v}B{mb}"

    def loss(self, out: Any, task: str) -> None:
        self._outputs[id(out)] = task

    def backward(self, output_tensor: Any) -> None:
        out = output_tensor[0] if isinstance(output_tensor, list) else output_tensor
        self.order.append(self._outputs.pop(id(out)))

    current: Recorder | None = None

    @staticmethod
    def install(schedules: Any) -> None:
        """Record every ``backward_step`` call in ``Recorder.current`` (once per process)."""
        original = schedules.backward_step
        if getattr(original, "recorded", False):
            return

        @functools.wraps(original)
        def backward_step(*args: Any) -> Any:
            assert Recorder.current is not None
            Recorder.current.backward(args[1])
            return original(*args)

        backward_step.recorded = True  # type: ignore[attr-defined]
        schedules.backward_step = backward_step


def _forward_step(
    case: Case, rec: Recorder, data_iterator: Iterator[Any] | None, model: nn.Module
) -> Any:
    assert data_iterator is not None
    item = next(data_iterator)
    if case.arch == "mlp":
        mb, x, y, mask = item
        out = model(x)

        def loss_func(out: torch.Tensor) -> Any:
            if case.kind == "mean":
                loss = ((out - y) ** 2).mean()
                res: tuple[Any, ...] = (loss, {"lm loss": loss.detach().clone()})
            else:
                loss = (((out - y) ** 2).sum(-1) * mask).sum()
                n = mask.sum().to(torch.int)
                res = (loss, n, {"lm loss": torch.stack([loss.detach().clone(), n.float()])})
            rec.loss(loss, f"{rec.vstage(model)}B{mb}")
            return res

    else:
        mb, tokens, labels, mask = item
        pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        out = model(tokens, pos, None, labels=labels)  # per-token losses on the last stage

        def loss_func(out: torch.Tensor) -> Any:  # Megatron-LM's three-tuple form
            loss = (out.float() * mask).sum()
            n = mask.sum().to(torch.int)
            rec.loss(loss, f"{rec.vstage(model)}B{mb}")
            return loss, n, {"lm loss": torch.stack([loss.detach().clone(), n.float()])}

    rec.forward(model, mb, out)
    return out, loss_func


class _Hooks:
    """The config hooks of a case, recording every call with the backwards done so far."""

    def __init__(self, rec: Recorder, chunks: int) -> None:
        self.rec = rec
        self.events: list[Any] = []
        self.finalized: list[Any] = []
        self.grad_syncs: list[Any] = []
        self.param_syncs: list[int] = []
        self.chunks = chunks

    def no_sync(self, chunk: int) -> Any:
        @contextlib.contextmanager
        def ctx() -> Iterator[None]:
            self.events.append(("enter", chunk, tuple(self.rec.counts)))
            yield
            self.events.append(("exit", chunk, tuple(self.rec.counts)))

        return ctx

    def grad_sync(self, chunk: int) -> Any:
        def f(params: Any) -> None:
            self.grad_syncs.append((chunk, self.rec.counts[chunk]))

        return f

    def param_sync(self, chunk: int) -> Any:
        def f(params: Any) -> None:
            self.param_syncs.append(chunk)

        return f

    def finalize(self, models: list[nn.Module], num_tokens: Any, **kw: Any) -> None:
        assert "pg_collection" in kw and "force_all_reduce" in kw
        self.finalized.append((len(models), None if num_tokens is None else int(num_tokens)))
        if num_tokens is not None and int(num_tokens) > 0:
            for model in models:
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad /= int(num_tokens)


def _config(case: Case, pp: int) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    nv = pp * (case.vp or 1)
    kw: dict[str, Any] = {}
    if case.vp is not None:
        kw["virtual_pipeline_model_parallel_size"] = case.vp
        # Megatron-LM's interleaved setting (it asserts PP > 2 without it: batched p2p
        # between the same two ranks mixes up the two directions' messages).
        kw.update(overlap_p2p_comm=True, batch_p2p_comm=False)
        if case.group is not None:
            kw["microbatch_group_size_per_vp_stage"] = case.group
    return TransformerConfig(
        num_layers=nv,
        hidden_size=D,
        num_attention_heads=2,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        variable_seq_lengths=case.variable,
        moe_token_dispatcher_type="alltoall",
        calculate_per_token_loss=case.kind == "tokens",
        **kw,
    )


def _own_groups(pp: int) -> Any:
    """Megatron-Bridge's decentralised groups (``use_decentralized_pg``): groups of their own,
    laid out as its ``HyperCommGrid(shape=[tp, cp, dp, pp])`` lays them (pp slowest, so a
    pipeline is ranks ``d, d + dp, ...``: not megatron's default order), and a
    ``ProcessGroupCollection`` of them; ``parallel_state`` stays uninitialised. (Built with
    ``new_group`` directly: ``HyperCommGrid`` needs einops, which the main environment
    lacks.)"""
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection

    world, rank = dist.get_world_size(), dist.get_rank()
    dp = world // pp

    def mine(groups: list[list[int]]) -> Any:
        out = None
        for ranks in groups:  # every rank creates every group, in the same order
            g = dist.new_group(ranks, backend="gloo")
            if rank in ranks:
                out = g
        return out

    pgc = ProcessGroupCollection()
    singles = [[r] for r in range(world)]
    pgc.tp = mine(singles)
    pgc.cp = mine(singles)
    pgc.pp = mine([[d + p * dp for p in range(pp)] for d in range(dp)])
    pgc.dp = mine([[d + p * dp for d in range(dp)] for p in range(pp)])
    pgc.dp_cp = pgc.dp
    pgc.embd = None
    pgc.pos_embd = None
    return pgc


def _factory(which: str, mod: Any, rr_fb: Any, case: Case, pgc: Any, pp: int) -> Any:
    """The case's style of ``get_forward_backward_func(...)``: megatron's or ours."""
    get = mod.get_forward_backward_func if which == "megatron" else rr_fb
    ours: dict[str, Any] = {}
    if which == "strict":
        ours = {"policy": "strict", "step_timeout": 60}
    elif which == "default":
        ours = {"step_timeout": 60}
        if case.nbytes:
            import rrfp_async as rr

            ours["activation_bytes"] = lambda plan: rr.ActivationBytes.from_sizes(
                plan, [seq_len(i, case.variable) for i in range(plan.microbatches)], 4096
            )
            ours["memory_budget"] = 1.0
    if case.style == "readme":
        return get(**ours)
    if case.style == "training":
        params = inspect.signature(mod.get_forward_backward_func).parameters
        if "schedule_pg_collection" in params:  # training.py (0.19)
            return get(schedule_pg_collection=pgc, **ours)
        return get(**ours)  # training.py (0.16) calls it bare
    return get(pp_size=pgc.pp.size(), vp_size=case.vp, **ours)  # Megatron-Bridge


def _call_kwargs(
    case: Case, config: Any, models: list[nn.Module], data: Any, pgc: Any
) -> dict[str, Any]:
    """The case's style of the forward-backward call's keywords."""
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    n = len(models)
    iters: Any = [iter(data) for _ in range(n)] if case.vp is not None else iter(data)
    kw: dict[str, Any] = {
        "data_iterator": iters,
        "num_microbatches": case.m,
        "seq_length": seq_len(0, case.variable),
        "micro_batch_size": B,
        "forward_only": case.forward_only,
    }
    if case.style == "readme":
        kw["model"] = models if case.vp is not None else models[0]
    elif case.style == "training":  # train_step / evaluate: model is always a list
        kw.update(
            model=models,
            decoder_seq_length=None,
            adjust_tensor_shapes_fn=None,
            p2p_communicator=None,
            pg_collection=None,
        )
        if not case.forward_only:
            kw["force_all_reduce"] = False
    else:  # Megatron-Bridge's train_step / evaluate
        kw.update(
            model=models,
            decoder_seq_length=kw["seq_length"] if not case.forward_only else None,
            adjust_tensor_shapes_fn=None,
            p2p_communicator=P2PCommunicator(pp_group=pgc.pp, config=config),
            pg_collection=pgc,
        )
        if case.forward_only:
            del kw["decoder_seq_length"]
    return kw


def _run_case(case: Case, pp: int, pp_rank: int, pgc: Any, rr_fb: Any, mod: Any) -> dict[str, Any]:
    config = _config(case, pp)
    nv = pp * (case.vp or 1)
    chunks = case.vp or 1
    vstages = [c * pp + pp_rank for c in range(chunks)]
    if case.arch == "mlp":
        models = [make_mlp(config, v, nv) for v in vstages]
    else:
        models = [
            make_gpt(config, v, nv, None if case.vp is None else c) for c, v in enumerate(vstages)
        ]
    rec = Recorder(models, pp, pp_rank)
    Recorder.current = rec
    for c, model in enumerate(models):  # counts the backwards that reached each chunk
        weight = next(iter(model.parameters()))
        weight.register_hook(lambda g, c=c: (rec.counts.__setitem__(c, rec.counts[c] + 1), g)[1])
    hooks = _Hooks(rec, chunks)
    config.no_sync_func = (
        [hooks.no_sync(c) for c in range(chunks)] if case.vp is not None else hooks.no_sync(0)
    )
    config.finalize_model_grads_func = hooks.finalize
    config.grad_scale_func = lambda t: t * 3.0
    if case.grad_sync:
        if case.vp is not None:
            config.grad_sync_func = [hooks.grad_sync(c) for c in range(chunks)]
            config.param_sync_func = [hooks.param_sync(c) for c in range(chunks)]
        else:
            config.grad_sync_func = hooks.grad_sync(0)
    init = [[p.detach().clone() for p in m.parameters()] for m in models]
    data = (mlp_data if case.arch == "mlp" else gpt_data)(case)
    results: dict[str, Any] = {}
    for which in WHICH:
        with torch.no_grad():
            for model, ps0 in zip(models, init, strict=True):
                for p, p0 in zip(model.parameters(), ps0, strict=True):
                    p.copy_(p0)
                    p.grad = None
        hooks.events.clear()
        hooks.finalized.clear()
        hooks.grad_syncs.clear()
        hooks.param_syncs.clear()
        rec.order.clear()
        rec.counts[:] = [0] * chunks
        fb = _factory(which, mod, rr_fb, case, pgc, pp)
        losses = fb(
            forward_step_func=functools.partial(_forward_step, case, rec),
            **_call_kwargs(case, config, models, data, pgc),
        )
        results[which] = {
            "losses": [{k: v.clone() for k, v in d.items()} for d in losses],
            "grads": [
                None if p.grad is None else p.grad.clone()
                for model in models
                for p in model.parameters()
            ],
            "events": list(hooks.events),
            "finalized": list(hooks.finalized),
            "grad_syncs": list(hooks.grad_syncs),
            "param_syncs": list(hooks.param_syncs),
            "order": list(rec.order),
            "deviations": None if which == "megatron" else fb.last_stats.deviations,
            "bytes": None
            if which == "megatron"
            else (fb.last_stats.peak_bytes, fb.last_stats.budget_bytes),
        }
        if which != "megatron":
            fb.close()
    return results


def worker(rank: int, world: int, pp: int, cases: list[Case]) -> dict[str, Any]:
    """Run every case (grouped by virtual pipeline size) three ways; results by case name."""
    import warnings

    from tests.integrations import megatron_cpu

    megatron_cpu.install()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import schedules as mod
        from megatron.core.process_groups_config import ProcessGroupCollection

    from rrfp_async.megatron import get_forward_backward_func as rr_fb

    Recorder.install(mod)
    out: dict[str, Any] = {}
    for vp in sorted({c.vp or 0 for c in cases}):
        mine = [c for c in cases if (c.vp or 0) == vp and not c.own_groups]
        if not mine:
            continue
        ps.initialize_model_parallel(
            pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp or None
        )
        pgc = ProcessGroupCollection.use_mpu_process_groups()
        for case in mine:
            out[case.name] = _run_case(
                case, pp, ps.get_pipeline_model_parallel_rank(), pgc, rr_fb, mod
            )
        ps.destroy_model_parallel()
    own = [c for c in cases if c.own_groups]
    if own:
        pgc = _own_groups(pp)
        assert not ps.model_parallel_is_initialized()
        for case in own:
            out[case.name] = _run_case(case, pp, pgc.pp.rank(), pgc, rr_fb, mod)
    return out


def check(res: list[dict[str, Any]], case: Case, pp: int) -> None:
    """The three runs of ``case`` on the ranks of one pipeline (``res[r]`` = pipeline rank
    ``r``'s results) agree as the module docstring says."""
    last = pp - 1
    for r in range(pp):
        got = res[r][case.name]
        want = got["megatron"]
        assert len(want["losses"]) == (case.m if r == last else 0), (case.name, r)
        # Megatron leaves no_sync entered after a forward-only step; the drop-in leaves it.
        chunks = case.vp or 1
        closed = (
            [("exit", c, (0,) * chunks) for c in reversed(range(chunks))]
            if case.forward_only
            else []
        )
        for which in ("strict", "default"):
            mine = got[which]
            where = (case.name, which, r)
            assert len(mine["losses"]) == len(want["losses"]), where
            for a, b in zip(mine["losses"], want["losses"], strict=True):
                assert a.keys() == b.keys(), where
                for k in a:
                    if which == "strict":
                        assert torch.equal(a[k], b[k]), (*where, k, a[k], b[k])
                    else:
                        torch.testing.assert_close(a[k], b[k], rtol=0, atol=ATOL)
            for a, b in zip(mine["grads"], want["grads"], strict=True):
                if case.forward_only:
                    assert a is None and b is None, where
                elif which == "strict":
                    assert torch.equal(a, b), (*where, (a - b).abs().max())  # same order
                else:
                    torch.testing.assert_close(a, b, rtol=0, atol=ATOL)
            assert mine["finalized"] == want["finalized"], where
            assert sorted(mine["grad_syncs"]) == sorted(want["grad_syncs"]), where
            assert mine["param_syncs"] == want["param_syncs"], where
            assert sorted(mine["order"]) == sorted(want["order"]), where
            if which == "strict":
                assert mine["order"] == want["order"], where  # Megatron's order, task for task
            if case.nbytes and which == "default":
                peak, budget = mine["bytes"]
                assert budget is not None and 0 < peak <= budget, (*where, peak, budget)
            if case.grad_sync:
                # grad_sync_func runs right after a chunk's last backward (megatron's waits
                # P - 1 - r backwards more): only the calls themselves are compared.
                _balanced(mine["events"], chunks, where)
            elif which == "strict":
                assert mine["events"] == want["events"] + closed, where
            else:
                assert len(mine["events"]) == len(want["events"] + closed), where


def _balanced(events: list[Any], chunks: int, where: Any) -> None:
    """Every chunk's no_sync entered and left in turn, left at the end."""
    inside = [False] * chunks
    for kind, c, _ in events:
        assert inside[c] == (kind == "exit"), (*where, events)
        inside[c] = kind == "enter"
    assert not any(inside), (*where, events)


# ---------------------------------------------------------------------------- no processes
# What the drop-in refuses, by name, before anything opens: shared by both tiers. Each entry
# is (id, factory keywords, call keywords, regex of the message); the message names what is
# refused (and, for megatron's own arguments, the installed megatron-core).


class FakeGroup:
    """A process group as the checks before a step read it (size and rank only)."""

    def __init__(self, size: int, rank: int = 0) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def fake_groups(pp: int = 2, cp: int = 1) -> tuple[Any, Any]:
    """A ``P2PCommunicator``-like object and a ``ProcessGroupCollection`` of fake groups."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    class Comm:
        pp_group = FakeGroup(pp)
        config = None

    pgc = ProcessGroupCollection()
    pgc.tp = FakeGroup(1)
    pgc.cp = FakeGroup(cp)
    return Comm(), pgc


def configured(**config: Any) -> nn.Module:
    """A model whose ``config`` is a ``TransformerConfig`` with ``config`` set on it."""
    import warnings

    from megatron.core.transformer.transformer_config import TransformerConfig

    m = nn.Linear(1, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron's own deprecation notes
        m.config = TransformerConfig(  # type: ignore[assignment]
            num_layers=2,
            hidden_size=D,
            num_attention_heads=1,
            pipeline_model_parallel_size=2,
            pipeline_dtype=torch.float32,
        )
    for k, v in config.items():
        setattr(m.config, k, v)
    return m


REFUSALS = (
    "unknown_keyword",
    "missing_seq_length",
    "p2p_without_pg",
    "pg_without_p2p",
    "pg_without_tp",
    "context_parallel",
    "pp_size_mismatch",
    "two_chunks_1f1b",
    "num_microbatches_0",
    "collect_non_loss_data_training",
    "partial_checkpoints",
    "defer_embedding_wgrad",
    "combined_1f1b",
    "local_cuda_graphs",
    "vpp_model_not_list",
    "vpp_iterators",
    "vpp_size_mismatch",
    "vpp_config_mismatch",
    "vpp_adjust_tensor_shapes_fn",
    "vpp_group_below_pp",
    "vpp_last_group_below_pp",
)
"""The ids of ``refusal`` entries (constant, so that collecting tests imports no megatron)."""


def refusal(name: str) -> tuple[dict[str, Any], dict[str, Any], str]:
    """Refusal table entry ``name`` (see above) for the installed megatron-core."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        table = {k: (f, c, n) for k, f, c, n in _refusals(megatron_version())}
    assert tuple(table) == REFUSALS
    return table[name]


def _refusals(version: str) -> list[tuple[str, dict[str, Any], dict[str, Any], str]]:
    v = version.replace(".", r"\.")
    one = {"pp_size": 2}
    vpp = {"pp_size": 2, "vp_size": 2}
    two = [configured(virtual_pipeline_model_parallel_size=2) for _ in range(2)]
    comm, pgc = fake_groups()
    groups = {"p2p_communicator": comm, "pg_collection": pgc}
    out: list[tuple[str, dict[str, Any], dict[str, Any], str]] = [
        ("unknown_keyword", one, {"foo": 1}, rf"megatron-core {v}'s .*unexpected keyword.*'foo'"),
        (
            "missing_seq_length",
            one,
            {"seq_length": None},
            rf"megatron-core {v}'s .*missing a required argument: 'seq_length'",
        ),
        (
            "p2p_without_pg",
            one,
            {"p2p_communicator": comm},
            "p2p_communicator without pg_collection",
        ),
        ("pg_without_p2p", one, {"pg_collection": pgc}, "pg_collection without p2p_communicator"),
        (
            "pg_without_tp",
            one,
            {"p2p_communicator": comm, "pg_collection": _without_tp(pgc)},
            "pg_collection has no tp group",
        ),
        (
            "context_parallel",
            one,
            dict(zip(("p2p_communicator", "pg_collection"), fake_groups(cp=2), strict=True)),
            r"context parallelism \(context_parallel_size=2\)",
        ),
        ("pp_size_mismatch", {"pp_size": 4}, groups, r"pp_size=4\), but .* has 2 ranks"),
        ("two_chunks_1f1b", one, {"model": two}, r"model is a list of 2 model chunks"),
        (
            "num_microbatches_0",
            one,
            {"num_microbatches": 0},
            "num_microbatches must be an int >= 1",
        ),
        (
            "collect_non_loss_data_training",
            one,
            {"collect_non_loss_data": True},
            r"collect_non_loss_data=True in a training step",
        ),
        (
            "partial_checkpoints",
            one,
            {"model": configured(num_microbatches_with_partial_activation_checkpoints=2)},
            r"config\.num_microbatches_with_partial_activation_checkpoints: partial",
        ),
        (
            "defer_embedding_wgrad",
            one,
            {"model": configured(defer_embedding_wgrad_compute=True)},
            r"config\.defer_embedding_wgrad_compute",
        ),
        (
            "combined_1f1b",
            one,
            {"model": configured(overlap_moe_expert_parallel_comm=True)},
            r"config\.overlap_moe_expert_parallel_comm: the combined 1F1B",
        ),
        (
            "local_cuda_graphs",
            one,
            {"model": configured(cuda_graph_impl="local")},
            r"config\.cuda_graph_impl: local CUDA graphs",
        ),
        ("vpp_model_not_list", vpp, {}, r"interleaved .* takes model as a list of model chunks"),
        (
            "vpp_iterators",
            vpp,
            {"model": two, "data_iterator": iter([])},
            r"takes data_iterator as a list of one iterator \(or None\) per model chunk \(2\)",
        ),
        (
            "vpp_size_mismatch",
            {"pp_size": 2, "vp_size": 3},
            {"model": two, "data_iterator": [None, None]},
            r"vp_size=3\), but model has 2 chunks",
        ),
        (
            "vpp_config_mismatch",
            vpp,
            {"model": [configured(), configured()], "data_iterator": [None, None]},
            r"config\.virtual_pipeline_model_parallel_size=None, but model has 2 chunks",
        ),
        (
            "vpp_adjust_tensor_shapes_fn",
            vpp,
            {"model": two, "data_iterator": [None, None], "adjust_tensor_shapes_fn": print},
            r"adjust_tensor_shapes_fn with the interleaved schedule",
        ),
        (
            "vpp_group_below_pp",
            vpp,
            {
                "model": [
                    configured(
                        virtual_pipeline_model_parallel_size=2, microbatch_group_size_per_vp_stage=1
                    )
                    for _ in range(2)
                ],
                "data_iterator": [None, None],
                **groups,
            },
            r"microbatch_group_size_per_vp_stage=1: .* in \[PP=2, M=6\]",
        ),
        (
            "vpp_last_group_below_pp",
            vpp,
            {
                "model": [
                    configured(
                        virtual_pipeline_model_parallel_size=2, microbatch_group_size_per_vp_stage=2
                    )
                    for _ in range(2)
                ],
                "data_iterator": [None, None],
                "num_microbatches": 5,
                **groups,
            },
            r"num_microbatches=5 .* last group of 1 < PP=2",
        ),
    ]
    return out


def _without_tp(pgc: Any) -> Any:
    from megatron.core.process_groups_config import ProcessGroupCollection

    other = ProcessGroupCollection()
    other.cp = pgc.cp
    return other


def call_refused(factory: Any, fkw: dict[str, Any], ckw: dict[str, Any]) -> None:
    """Call the drop-in with the refusal table's keywords (over a default training call)."""
    args: dict[str, Any] = {
        "forward_step_func": print,
        "data_iterator": iter([]),
        "model": configured(),
        "num_microbatches": 6,
        "seq_length": 5,
        "micro_batch_size": B,
    }
    args.update(ckw)
    if args.get("seq_length", 0) is None:
        del args["seq_length"]
    factory(**fkw)(**args)


def megatron_schedules() -> Any:
    """``megatron.core.pipeline_parallel.schedules`` (import warnings quiet)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.pipeline_parallel import schedules
    return schedules


def megatron_version() -> str:
    import importlib.metadata as md

    return md.version("megatron-core")


def check_signatures() -> None:
    """The factory takes megatron's arguments first, in megatron's order (ours keyword-only
    after them); the function it returns has exactly megatron's schedule's signature."""
    from rrfp_async.megatron import get_forward_backward_func as ours

    s = megatron_schedules()
    theirs = inspect.signature(s.get_forward_backward_func).parameters
    mine = inspect.signature(ours).parameters
    names = list(mine)
    assert names[: len(theirs)] == list(theirs), (names, list(theirs))
    for n in theirs:
        assert mine[n].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and mine[n].default is None
    assert names[2] == "schedule_pg_collection"  # (refused where megatron has none)
    assert all(
        mine[n].kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_KEYWORD)
        for n in names[3:]
    )
    fb = ours(2, policy="strict")
    want = inspect.signature(s.forward_backward_pipelining_without_interleaving)
    assert inspect.signature(fb) == want
    vpp = ours(2, 2, policy="strict")
    assert inspect.signature(vpp) == inspect.signature(
        s.forward_backward_pipelining_with_interleaving
    )


def check_documented_order() -> None:
    """``megatron_order`` is the order megatron's docs draw (ModelParallelConfig's
    ``microbatch_group_size_per_vp_stage``), its warm-up is megatron's, and without
    interleaving it is 1F1B."""
    from rrfp_async import StepPlan, Topology
    from rrfp_async.integrations._megatron_peer import megatron_order
    from rrfp_async.policies._hints import make_hint

    def forwards(order: list[Any]) -> list[tuple[int, int]]:
        return [(t.mb, t.stage // 2) for t in order if t.kind == "F"]

    # "PP=2 VP=2, group size 2, M=4: rank 0 | 0 1 0 1 2 3 2 3" (chunk 0, 0, 1, 1, ...)
    o = megatron_order(2, 2, 4, 2, interleaved=True)
    assert forwards(o[0]) == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    # "group size 3, M=5: rank 0 | 0 1 2 0 1 2 3 4 3 4"
    o = megatron_order(2, 2, 5, 3, interleaved=True)
    assert [mb for mb, _ in forwards(o[1])] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    # Warm-up: 2 (P - r - 1) + (V - 1) G forwards before rank r's first backward.
    o = megatron_order(4, 2, 8, 4, interleaved=True)
    for r in range(4):
        first_b = next(i for i, t in enumerate(o[r]) if t.kind == "B")
        assert first_b == 2 * (3 - r) + 4 + 1, (r, o[r])
        assert o[r][first_b].stage == 4 + r and o[r][first_b].mb == 0  # the last chunk first
    plan = StepPlan(topology=Topology(stages=4), microbatches=8)
    assert megatron_order(4, 1, 8, 4, interleaved=False) == make_hint("1f1b", plan)
    fo = megatron_order(2, 2, 4, 2, interleaved=True, forward_only=True)
    assert all(t.kind == "F" for t in fo[0]) and len(fo[0]) == 8
