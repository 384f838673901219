"""Side by side with torch.distributed.pipelining: the same stage modules, the same
microbatches, the same emulated GPU time, real processes on gloo, interleaved in one run.

Design note
-----------
A benchmark against a peer is only fair if both systems run the *same* work. Here every
virtual stage is one module (``PeerStage``): a ``Linear`` whose forward and backward also
sleep for a declared, seeded duration (emulated GPU time: the host waits, like for a CUDA
kernel). The sleep sits in two autograd ops, so that a split backward pays for what it
computes: the input-gradient pass (``I``) sleeps in an op on the activation path, the
weight-gradient pass (``W``) in an op on the weight (``linear(x, sleep_w(weight))``); a full
backward (``B``) passes both. Durations are looked up per (step, virtual stage, microbatch,
kind) in a table every process computes from the same seed: per token of the microbatch's
*real* length, backward = 2x forward (I = W = forward), lognormal jitter. Each activation
carries its microbatch's metadata (real tokens, index, step) in three trailing columns, so a
module knows what it is costing under either runtime.

torch's runtime can only be charged inside its modules, where the weight-gradient sleep
has to be a custom autograd op on the weight; the executor's real I/W split falls back to
recomputing for such ops (it would charge W = I + W). So rrfp_async's rows run the same
modules without that one op, and the executor sleeps the weight-gradient share after the
task's real compute (``TableCost``: 0 for F and I, W's share for B and W). Every task
sleeps as many times as under torch (F once, I once, W once, B twice: I in the module, W
after it), so sleep overshoot and cold caches after a sleep cost both systems alike.

torch freezes shapes at its first step: it gets microbatches padded to the longest of the
run, with the emulated cost of the real tokens (this isolates scheduling); a second row per
torch schedule (``padded_cost``) charges the padded length, which is what torch really pays
on variable-length data. rrfp_async gets the real shapes.

Per step and configuration, every process enters a barrier, runs one training step (no
optimizer step: the weights stay put, so every configuration computes the same losses,
which the benchmark checks), and the slowest rank's time is the step time. Configurations
are interleaved step by step (the machine is noisy); the median over the timed steps is
reported. Efficiency = a lower bound of the step (``rrfp_async.sim.lower_bound`` of the
realized emulated durations, no communication, no host compute) / the measured step.

Where it lives: ``_peer_config`` (the configuration, result rows and each step's work;
no torch), ``_peer_stage`` (``PeerStage``, its inputs and duration table,
``TableCost``), ``_peer_torch`` and ``_peer_rr`` (each system's runs in a worker),
``_peer_sim`` (the same steps simulated); this module runs them interleaved in each
process (``peer_worker``) and turns the ranks' results into rows (``peer_benchmark``).
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ._peer_config import (
    TORCH_SCHEDULES,
    PeerConfig,
    PeerRun,
    Step,
    WorkerRun,
    make_steps,
    resolve_torch_schedule,
    step_lower_bound,
)
from ._peer_rr import rr_runs
from ._peer_sim import SIMULATED, peer_simulated
from ._peer_stage import (
    META,
    PeerStage,
    TableCost,
    fill_table,
    module_host_time,
    replay_peak,
)
from ._peer_torch import torch_runs

__all__ = [
    "SIMULATED",
    "TORCH_SCHEDULES",
    "PeerConfig",
    "PeerRun",
    "PeerStage",
    "TableCost",
    "module_host_time",
    "peer_benchmark",
    "peer_simulated",
    "peer_worker",
]


def peer_worker(rank: int, world: int, cfg: PeerConfig) -> dict[str, Any]:
    """One process of ``peer_benchmark`` (module-level, so that ``spawn`` can pickle it):
    builds both systems' runs, then runs every configuration once per step, interleaved."""
    from rrfp_async.distributed import ProcessLayout, build_groups
    from rrfp_async.loop import loop_factory

    steps = make_steps(cfg)
    total = len(steps)
    layout = ProcessLayout.from_world(pp=cfg.stages)
    groups = build_groups(layout)
    one_way = _raw_one_way(cfg, rank, steps)

    runs = torch_runs(cfg, rank, steps)
    factory = loop_factory()
    loop = factory() if factory is not None else asyncio.new_event_loop()
    rr, closers = rr_runs(cfg, rank, steps, layout, groups, loop)
    runs += rr
    if cfg.dropin_hints:
        from ._peer_dropin import dropin_runs

        dropins, scheds = dropin_runs(cfg, rank, steps)
        runs += dropins
        closers += [sc.close for sc in scheds]

    fill_table(steps, 1)
    current = 1
    try:
        for s in range(total):
            for run in runs:
                if run.fn is None:
                    continue
                if run.chunks != current:
                    fill_table(steps, run.chunks)
                    current = run.chunks
                run.times.append(run.fn(s))
            if rank == 0:
                from rrfp_async.distributed import report_progress

                report_progress(s)
    finally:
        for c in closers:
            c()
        loop.close()
    lbs = {
        (c, p, sp): [step_lower_bound(cfg, st, c, p, sp) for st in steps]
        for c, p, sp in {(r.chunks, r.placement, r.split) for r in runs}
    }
    times, peaks = slowest(runs, total)
    # Losses live on the rank of the last virtual stage; every rank reports its own.
    return {
        "bytes": [r.peak_bytes for r in runs],
        "step_bytes": [r.step_bytes for r in runs],
        "orders": [r.orders for r in runs],
        "one_way_s": one_way,
        "keys": [r.key for r in runs],
        "chunks": [r.chunks for r in runs],
        "placements": [r.placement for r in runs],
        "errors": [r.error for r in runs],
        "times": times,
        "peaks": peaks,
        "losses": [r.losses for r in runs],
        "lower_bounds": [lbs[(r.chunks, r.placement, r.split)] for r in runs],
    }


def slowest(runs: Sequence[WorkerRun], total: int) -> tuple[list[list[float]], list[int]]:
    """Every run's step times as the slowest rank's and its peak as the largest of any rank
    (collective over the world; a run that did not run counts 0 s)."""
    local = torch.tensor([r.times[i] if r.times else 0.0 for r in runs for i in range(total)])
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    peaks = torch.tensor([r.peak for r in runs], dtype=torch.int64)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    return local.view(len(runs), total).tolist(), peaks.tolist()


def real_bytes(cfg: PeerConfig, res: Sequence[dict[str, Any]]) -> list[list[list[float]]]:
    """Each torch run's order (``LiveBytes.order``, step by step, on every rank) replayed on
    the real lengths' bytes, those an rrfp_async run measured in the same step (on every
    rank): one of the same chunks and placement, else a one-chunk one, each virtual stage
    taking the bytes of the stage at its position (the first, a middle one, the last: the
    modules are alike, only the position changes what a forward keeps). ``[rank][run][step]``,
    NaN where no such run measured them (and for the runs that are not torch's)."""
    r0 = res[0]
    keys = [tuple(k) for k in r0["keys"]]
    place = {k: (c, p) for k, c, p in zip(keys, r0["chunks"], r0["placements"], strict=True)}
    n = len(r0["times"][0]) if r0["times"] else 0

    def measured(j: int, s: int) -> dict[tuple[int, int], int]:
        return {(v, mb): b for r in res for v, mb, b in r["step_bytes"][j][s]}

    out = [[[math.nan] * n for _ in keys] for _ in res]
    for i, key in enumerate(keys):
        if key[0] != "torch" or not r0["orders"][i]:
            continue
        same = next(
            (j for j, k in enumerate(keys) if k[0] != "torch" and place[k] == place[key]), None
        )
        single = next(
            (j for j, k in enumerate(keys) if k[0] != "torch" and place[k] == (1, "interleaved")),
            None,
        )
        ref = same if same is not None else single
        if ref is None or not r0["step_bytes"][ref]:
            continue
        last = cfg.stages * place[key][0] - 1
        for s in range(n):
            nb = measured(ref, s)
            if ref != same:
                nb = {
                    (v, mb): nb.get((0 if v == 0 else cfg.stages - 1 if v == last else 1, mb), 0)
                    for v in range(last + 1)
                    for mb in range(cfg.microbatches)
                }
            for rank, r in enumerate(res):
                out[rank][i][s] = float(replay_peak(r["orders"][i][s], nb))
    return out


def _bytes_fields(
    res: Sequence[dict[str, Any]],
    real: list[list[list[float]]],
    i: int,
    base: int,
    w: int,
    meter: bool,
) -> dict[str, Any]:
    """Row ``i``'s ``PeerRun`` bytes fields from every rank's measurements (timed steps
    only), against row ``base`` (torch 1F1B; -1: not run).

    A row of ``c`` model chunks per rank counts ``1/c`` of what its modules measured: each of
    its virtual stages is the same ``PeerStage`` as a one-chunk row's, standing for ``1/c``
    of the rank's model (its emulated time is ``1/c``), so its bytes are that share's too."""
    if not meter:
        return {}
    per = {"bytes": [r["bytes"] for r in res], "real_bytes": real}

    def per_rank(key: str, row: int) -> list[float]:
        share = res[0]["chunks"][row]
        return [max(by_run[row][w:], default=math.nan) / share for by_run in per[key]]

    mine = per_rank("bytes", i)
    if not all(math.isfinite(b) and b > 0 for b in mine):  # a run that did not run
        return {}
    out: dict[str, Any] = {
        "peak_bytes": int(max(mine)),
        "peak_bytes_per_rank": tuple(int(b) for b in mine),
        "measured_peak_bytes_per_rank": tuple(max(r["bytes"][i][w:]) for r in res),
    }
    on_real = per_rank("real_bytes", i)
    if all(math.isfinite(b) for b in on_real):
        out.update(real_bytes=int(max(on_real)), real_bytes_per_rank=tuple(int(b) for b in on_real))
    if base >= 0 and any(per_rank("bytes", base)):
        ref = per_rank("bytes", base)
        out["bytes_vs_torch_1f1b"] = max(mine) / max(ref)
        out["bytes_vs_torch_1f1b_per_rank"] = tuple(
            a / b if b else math.nan for a, b in zip(mine, ref, strict=True)
        )
        ref_real = per_rank("real_bytes", base)
        # torch's own rows on the real lengths too (their order replayed), ours as they ran.
        ours = on_real if res[0]["keys"][i][0] == "torch" else mine
        if all(math.isfinite(b) for b in ref_real + ours):
            out["bytes_vs_torch_1f1b_real"] = max(ours) / max(ref_real)
    return out


def _raw_one_way(cfg: PeerConfig, rank: int, steps: Sequence[Step], reps: int = 20) -> float:
    """One-way seconds of a raw blocking gloo send of a mean-sized activation (rank 0 <-> 1)."""
    rows = round(statistics.mean(t for st in steps for t in st.tokens))
    x = torch.zeros(1, rows, cfg.hidden + META)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        if rank == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        elif rank == 1:
            dist.recv(x, 0)
            dist.send(x, 0)
    return (time.perf_counter() - t0) / (2 * reps)


def peer_benchmark(
    cfg: PeerConfig, *, on_progress: Callable[[Any], None] | None = None
) -> dict[str, Any]:
    """Run ``cfg`` on ``cfg.stages`` gloo processes (127.0.0.1); return the runs.

    Returns:
        ``{"config": ..., "runs": [PeerRun.to_dict(), ...], "loss_max_diff": float,
        "comm_share": ...}``; ``speedup_vs_torch_1f1b`` is the median over the timed steps
        of torch ``Schedule1F1B``'s step time (real-token cost) / the configuration's in the
        same step (1.0 there; NaN when it was not run); ``efficiency`` the median of
        lower bound / step time.
    """
    from rrfp_async.distributed import spawn

    res = spawn(peer_worker, cfg.stages, cfg, timeout=cfg.timeout, on_progress=on_progress)
    r0 = res[0]
    w = cfg.warmup_steps
    real = real_bytes(cfg, res) if cfg.meter else []
    keys = [tuple(k) for k in r0["keys"]]
    med = {k: statistics.median(r0["times"][i][w:]) for i, k in enumerate(keys)}
    # Every step has its own microbatches: compare configurations step by step (paired),
    # then take the median of those ratios; a ratio of medians would compare different steps.
    bi = (
        keys.index(("torch", "Schedule1F1B", False))
        if ("torch", "Schedule1F1B", False) in keys
        else -1
    )
    base_steps = r0["times"][bi][w:] if bi >= 0 else None
    # The same model for every row with as many chunks (the virtual stages' modules are built
    # from their index): the losses are compared within each such group. The rank of the
    # last virtual stage holds them (rank 0 for V-shape).
    losses: list[list[float]] = [
        next((r["losses"][i] for r in res if r["losses"][i]), []) for i in range(len(keys))
    ]
    ref: dict[int, list[float]] = {}
    for c, ls in zip(r0["chunks"], losses, strict=True):
        if ls:
            ref.setdefault(c, ls)
    diff = 0.0
    checked = 0
    rows: list[PeerRun] = []
    for i, key in enumerate(keys):
        err = r0["errors"][i]
        lbs = r0["lower_bounds"][i]
        steps_s = tuple(r0["times"][i][w:])
        ok = not err
        eff = (
            statistics.median(lb / t for lb, t in zip(lbs[w:], steps_s, strict=True))
            if ok
            else math.nan
        )
        ls, base = losses[i], ref.get(r0["chunks"][i], [])
        if ls and base:
            diff = max(diff, max(abs(a - b) for a, b in zip(ls, base, strict=True)))
            checked += 1
        torch_row = key[0] == "torch"
        note = f"cannot run: {err}" if err else "padded cost" if torch_row and key[2] else ""
        native = ("rrfp_async", *key[1:])
        same = math.nan
        if key[0] == "drop-in" and ok and str(key[1]).startswith("torch:"):
            # torch's order as the hint: against that torch schedule, paired step by step.
            tkey = ("torch", resolve_torch_schedule(str(key[1]).removeprefix("torch:")), False)
            if tkey in keys and not r0["errors"][keys.index(tkey)]:
                tt = r0["times"][keys.index(tkey)][w:]
                same = statistics.median(b / t for b, t in zip(tt, steps_s, strict=True))
        if key[0] == "drop-in" and ok and native in keys:
            # The adapter's cost: the native row at the same hint, policy and memory, paired.
            nat = r0["times"][keys.index(native)][w:]
            vs = statistics.median(n / t for n, t in zip(nat, steps_s, strict=True))
            note = f"{vs:.2f}x native"
        rows.append(
            PeerRun(
                system=key[0],
                schedule=key[1] if torch_row else None,
                hint=None if torch_row else key[1],
                policy=None if torch_row else key[2],
                memory_factor=None if torch_row else key[3],
                step_s=med[key] if ok else math.nan,
                speedup_vs_torch_1f1b=(
                    statistics.median(b / t for b, t in zip(base_steps, steps_s, strict=True))
                    if ok and base_steps is not None
                    else math.nan
                ),
                efficiency=eff,
                speedup_vs_same_torch=same,
                peak_inflight=int(r0["peaks"][i]),
                steps_s=steps_s if ok else (),
                note=note,
                **(_bytes_fields(res, real, i, bi, w, cfg.meter) if ok else {}),
            )
        )
    steps = make_steps(cfg)
    mean_task = statistics.mean(
        x for st in steps[w:] for tab in (st.forward[1], st.backward[1]) for row in tab for x in row
    )
    return {
        "config": cfg,
        "runs": [r.to_dict() for r in rows],
        "loss_max_diff": diff,
        "losses_checked": checked,
        "one_way_s": r0["one_way_s"],
        "mean_task_s": mean_task,
        "comm_share": r0["one_way_s"] / mean_task,
    }
