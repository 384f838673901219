"""The stage module both systems run (``PeerStage``: ``Linear`` + emulated GPU time), its
inputs and loss, the duration table it reads, the executor-side weight-gradient cost
(``TableCost``), the activation meter of torch's runs (``LiveBytes``) and the module's own
host time (see the design note in ``_peer``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from rrfp_async import CostModel, Durations, StepPlan, Topology
from rrfp_async.distributed import (
    ActivationMeter,
    EmulatedCost,
    StorageKey,
    weight_storages,
)

from ._peer_config import PeerConfig, Step, make_steps

__all__ = [
    "META",
    "TABLE",
    "LiveBytes",
    "PeerStage",
    "TableCost",
    "fill_table",
    "make_inputs",
    "make_modules",
    "module_host_time",
    "peer_loss",
    "replay_peak",
]

META = 3  # trailing columns: real tokens, microbatch index, step

TABLE: dict[tuple[int, int, int, str], float] = {}
"""(step, virtual stage, microbatch, kind) -> emulated seconds, for this process."""


class _Sleep(torch.autograd.Function):
    """Identity whose forward sleeps ``fwd`` s and whose backward sleeps ``bwd`` s."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fwd: float, bwd: float) -> torch.Tensor:
        ctx.bwd = bwd
        if fwd > 0:
            time.sleep(fwd)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.bwd > 0:
            time.sleep(ctx.bwd)
        return g, None, None


class PeerStage(nn.Module):
    """One virtual stage: ``Linear`` + emulated GPU time (see ``_peer``'s design note).

    The input is ``[1, rows, hidden + 3]``: features, then real tokens, microbatch index and
    step in every row (rows past the real tokens are padding). With ``weight_sleep=False``
    the weight-gradient share is not slept here: the caller's executor sleeps it
    (``TableCost``).
    """

    def __init__(
        self, hidden: int, vstage: int, *, padded_cost: bool = False, weight_sleep: bool = True
    ) -> None:
        super().__init__()
        self.lin = nn.Linear(hidden, hidden)
        self.vstage = vstage
        self.padded_cost = padded_cost
        self.weight_sleep = weight_sleep
        self.live: LiveBytes | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        live = self.live
        # torch's shape inference runs the module on placeholder data (0 tokens), with
        # gradients on and no backward to come: not a microbatch's forward, not measured.
        if (
            live is not None
            and torch.is_grad_enabled()
            and x.device.type != "meta"
            and x[0, 0, -META] > 0
        ):
            return live.forward(self, x)
        return self.compute(x)

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        """The forward itself (``forward`` measures it first when a ``LiveBytes`` is on)."""
        feats, meta = x[..., :-META], x[..., -META:].detach()
        tokens, mb, step = (int(v) for v in meta[0, 0].tolist())
        key = (step, self.vstage, mb)
        # torch's shape inference runs the module on placeholder data: no cost then.
        scale = x.shape[1] / tokens if self.padded_cost and tokens > 0 else 1.0
        f, i, w = (TABLE.get((*key, k), 0.0) * scale for k in ("F", "I", "W"))
        weight = self.lin.weight
        if self.weight_sleep:
            weight = _Sleep.apply(weight, 0.0, w)  # type: ignore[no-untyped-call]
        h = torch.nn.functional.linear(feats, weight, self.lin.bias)
        h = _Sleep.apply(torch.tanh(h), f, i)  # type: ignore[no-untyped-call]
        return torch.cat([h, meta], dim=-1)


class LiveBytes:
    """The activation meter of a torch run, on one rank, inside its stage modules (the
    ``PeerStage``'s ``forward``; any module's through ``run``, and a loss computed outside
    the module through ``loss``): each training forward's bytes measured as the executor's
    meter measures an rrfp_async task's (``TorchStageExecutor(measure_activations=True)``:
    the same saved-tensor ``ActivationMeter``, the module's weights excluded, the received
    input kept, the output held), added when the forward ends and taken off when its
    microbatch's backward reaches the output (a tensor hook on it: the full backward, or
    the input-gradient pass of a split one; torch runs the first stage's whole split
    backward in its weight pass). On one thread, with no task between, that is the
    executor's ``held_peak`` (a forward's bytes from its start to the end of the backward
    that frees them).

    The first stage's input is torch's view of the whole padded batch (torch splits it);
    the executor's is the microbatch's own tensor. So here its storage is excluded and the
    microbatch's own elements count instead, what an rrfp_async row counts for its input.

    Attributes:
        peak: The most held in the step (final once ``end`` ran).
        bytes: ``{(virtual stage, microbatch): bytes}`` of the step's forwards.
        order: ``(+1 or -1, virtual stage, microbatch)`` in the order the forwards ended and
            the backwards began (final once ``end`` ran): replayed on other bytes by
            ``replay_peak``.
    """

    def __init__(self) -> None:
        self.meter = ActivationMeter()
        self.peak = 0
        self.bytes: dict[tuple[int, int], int] = {}
        self.order: list[tuple[int, int, int]] = []
        self._held = 0
        self._events: list[tuple[int, int, int, int]] = []  # (sign, stage, mb, bytes)
        self._open: dict[tuple[int, int], int] = {}
        self._weights: dict[int, frozenset[StorageKey]] = {}

    def begin(self) -> None:
        """A step begins: nothing held."""
        self._held = self.peak = 0
        self.bytes = {}
        self.order = []
        self._events = []
        self._open = {}

    def forward(self, mod: PeerStage, x: torch.Tensor) -> torch.Tensor:
        """``mod``'s forward of ``x``, measured."""
        return self.run(mod.vstage, int(x[0, 0, -META + 1]), mod, mod.compute, x)

    def run(
        self,
        stage: int,
        mb: int,
        module: nn.Module,
        fn: Callable[[torch.Tensor], torch.Tensor],
        x: torch.Tensor,
    ) -> torch.Tensor:
        """``fn(x)``, the forward of microbatch ``mb`` on virtual stage ``stage`` (of
        ``module``, whose weights never count), measured and held until its backward
        reaches the output."""
        weights = self._weights.get(stage)
        if weights is None:
            weights = self._weights[stage] = weight_storages(module)
        own = 0
        keep = [x]
        if not x.requires_grad:  # the first stage's data: a view of torch's batch
            s = x.untyped_storage()
            weights, keep = weights | {(s.device, s.data_ptr())}, []
            own = x.numel() * x.element_size()
        with self.meter.measure(exclude=weights, keep=keep) as m:
            out = fn(x)
            m.hold([out])
        key = (stage, mb)
        n = m.bytes + own
        self.bytes[key] = self._open[key] = n
        self._events.append((1, *key, n))
        self._held += n
        self.peak = max(self.peak, self._held)
        out.register_hook(lambda _g: self._release(key))  # type: ignore[no-untyped-call]
        return out

    def loss(
        self,
        fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        out: torch.Tensor,
        target: torch.Tensor,
    ) -> torch.Tensor:
        """``fn(out, target)``, the loss of the last forward measured (of ``out``: torch's
        schedule computes it right after), its bytes added to that forward's, as the
        executor measures a last stage's loss inside its forward. ``out``'s storage counted
        there already; the target is torch's view of its whole batch, so the loss gets a
        copy: it counts as its own tensor where the loss keeps it, as the executor's does."""
        sign, stage, mb, n = self._events[-1]
        assert sign > 0, "a loss follows its forward"
        s = out.untyped_storage()
        with self.meter.measure(exclude={(s.device, s.data_ptr())}) as m:
            loss = fn(out, target.clone())
            m.hold([loss])
        self._events[-1] = (1, stage, mb, n + m.bytes)
        self.bytes[(stage, mb)] = self._open[(stage, mb)] = n + m.bytes
        self._held += m.bytes
        self.peak = max(self.peak, self._held)
        return loss

    def _release(self, key: tuple[int, int]) -> None:
        n = self._open.pop(key, None)
        if n is not None:  # once: a split backward's weight pass does not come back here
            self._held -= n
            self._events.append((-1, *key, n))

    def end(self) -> None:
        """The step ended: drop the forwards no backward followed. torch's shape inference
        (its first step) runs the first stage's module on its first microbatch with
        gradients on and never runs its backward: it is no training forward."""
        events: list[tuple[int, int, int, int] | None] = list(self._events)
        if self._held:
            pending: dict[tuple[int, int], int] = {}
            for i, e in enumerate(self._events):
                key = (e[1], e[2])
                if e[0] < 0:
                    pending.pop(key, None)
                else:
                    if key in pending:  # superseded before any backward came
                        events[pending[key]] = None
                    pending[key] = i
            for i in pending.values():
                events[i] = None
        kept = [e for e in events if e is not None]
        held = peak = 0
        for sign, _, _, n in kept:
            held += sign * n
            peak = max(peak, held)
        self.peak = peak
        self.order = [(sign, v, mb) for sign, v, mb, _ in kept]
        self._held = 0


def replay_peak(
    order: Sequence[tuple[int, int, int]], nbytes: Mapping[tuple[int, int], int]
) -> int:
    """The most bytes ``order`` (``LiveBytes.order``) holds with each forward's bytes
    ``nbytes[(virtual stage, microbatch)]``: the same order on other microbatches (torch's
    order on the real lengths). A forward missing from ``nbytes`` counts 0."""
    held = peak = 0
    for sign, v, mb in order:
        held += sign * nbytes.get((v, mb), 0)
        peak = max(peak, held)
    return peak


def peer_loss(out: torch.Tensor, _target: Any) -> torch.Tensor:
    feats, meta = out[..., :-META], out[..., -META:]
    n = int(meta[0, 0, 0])
    return feats[:, :n].pow(2).mean()


def fill_table(steps: Sequence[Step], chunks: int) -> None:
    TABLE.clear()
    for s, st in enumerate(steps):
        for v, row in enumerate(st.forward[chunks]):
            for m, f in enumerate(row):
                b = st.backward[chunks][v][m]
                TABLE[(s, v, m, "F")] = f
                TABLE[(s, v, m, "I")] = b / 2
                TABLE[(s, v, m, "W")] = b / 2


def make_inputs(
    cfg: PeerConfig, step: int, tokens: Sequence[int], pad: int | None
) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(cfg.seed * 1000 + step)
    out = []
    for m, t in enumerate(tokens):
        rows = pad if pad is not None else t
        x = torch.zeros(1, rows, cfg.hidden + META)
        x[0, :t, : cfg.hidden] = torch.randn(t, cfg.hidden, generator=g)
        x[0, :, cfg.hidden :] = torch.tensor([t, m, step], dtype=torch.float32)
        out.append(x)
    return out


def make_modules(
    cfg: PeerConfig, rank: int, chunks: int, placement: str, padded: bool, weight_sleep: bool = True
) -> dict[int, PeerStage]:
    topo = Topology(stages=cfg.stages, chunks=chunks, placement=placement)  # type: ignore[arg-type]
    mods = {}
    for v in topo.stages_of(rank):
        torch.manual_seed(10_000 + v)
        mods[v] = PeerStage(cfg.hidden, v, padded_cost=padded, weight_sleep=weight_sleep)
    return mods


@dataclass(frozen=True, kw_only=True)
class TableCost(EmulatedCost):
    """The weight-gradient share of the benchmark's emulated time, slept by a
    ``TorchStageExecutor`` after a task's real compute: W's share of the step's table for B
    and W tasks, nothing for F and I (the module sleeps those). See the design note in
    ``_peer``.

    Attributes:
        steps: The run's steps (their duration tables).
        chunks: Model chunks per rank (which table).
    """

    cost: CostModel = field(default_factory=CostModel)
    steps: tuple[Step, ...] = ()
    chunks: int = 1

    def durations(
        self, plan: StepPlan, microbatches: Sequence[Any], step: int, rank: int
    ) -> Durations:
        """Seconds per task of ``step``: B and W get W's share, F and I nothing."""
        st = self.steps[step]
        zeros = [[0.0] * len(row) for row in st.forward[self.chunks]]
        w = [[b / 2 for b in row] for row in st.backward[self.chunks]]
        return Durations.from_arrays(plan, zeros, w, input_grad_share=0.0)


def module_host_time(cfg: PeerConfig, *, repeats: int = 2) -> dict[str, float]:
    """Host time of one ``PeerStage`` task beyond its emulated duration, in this process
    (one torch thread): what the efficiency's lower bound does not count, for either system.

    Runs the first timed step's microbatches through a middle stage, forward then full
    backward, ``repeats`` rounds after one warm-up round, with the emulated sleeps and
    without them (real compute only).

    Returns:
        Medians in seconds: ``f_over`` / ``b_over`` (wall time minus emulated time, sleeps on),
        ``f_compute`` / ``b_compute`` (sleeps off), and ``cap``: the efficiency any runtime is
        held to by this alone (mean emulated task / mean emulated task + its overshoot).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    saved = dict(TABLE)
    try:
        steps = make_steps(cfg)
        s = cfg.warmup_steps
        mod = PeerStage(cfg.hidden, 1)
        xs = make_inputs(cfg, s, steps[s].tokens, None)

        def rounds(sleeps: bool) -> tuple[list[float], list[float], list[float], list[float]]:
            TABLE.clear()
            if sleeps:
                fill_table(steps, 1)
            f_over, b_over, f_emu, b_emu = [], [], [], []
            for rep in range(repeats + 1):
                for mb, x0 in enumerate(xs):
                    x = x0.detach().requires_grad_()
                    t0 = time.perf_counter()
                    out = mod(x)
                    t1 = time.perf_counter()
                    torch.autograd.backward(out, torch.ones_like(out))
                    t2 = time.perf_counter()
                    f = TABLE.get((s, 1, mb, "F"), 0.0)
                    b = TABLE.get((s, 1, mb, "I"), 0.0) + TABLE.get((s, 1, mb, "W"), 0.0)
                    if rep:  # the first round warms up (autograd's first backward is slow)
                        f_over.append(t1 - t0 - f)
                        b_over.append(t2 - t1 - b)
                        f_emu.append(f)
                        b_emu.append(b)
            return f_over, b_over, f_emu, b_emu

        f_over, b_over, f_emu, b_emu = rounds(True)
        f_cpu, b_cpu, _, _ = rounds(False)
    finally:
        TABLE.clear()
        TABLE.update(saved)
        torch.set_num_threads(threads)
    emu = statistics.mean(f_emu + b_emu)
    over = statistics.mean(f_over + b_over)
    return {
        "f_over": statistics.median(f_over),
        "b_over": statistics.median(b_over),
        "f_compute": statistics.median(f_cpu),
        "b_compute": statistics.median(b_cpu),
        "cap": emu / (emu + over),
    }
