"""What a step of ``DistributedStage`` costs beside its tasks, side by side for two trees of
this repository (e.g. main's worktree and a branch): 4 gloo processes (``rr.spawn``), one
pipeline of 4 stages, default configuration, 8 microbatches of variable length whose tasks
sleep for their emulated GPU time (``--us-per-token`` µs a token forward, twice that
backward; 0: no compute); blocks of ``--steps`` steps, alternating A B B A ..., each block a
fresh job with the tree's code first on ``PYTHONPATH``. ``--executor torch`` runs the tasks
through ``TorchStageExecutor`` (a ``Linear`` behind an autograd op that sleeps the emulated
time on the compute thread) instead of a coroutine that sleeps it. Reports each tree's median step
(the slowest rank's, per block) and the paired difference per block pair.

``--old-control-group PATH`` instead alternates, block by block in one job of this tree, its
control group and the one in PATH (another tree's ``_control_group.py``, loaded as a module
of this tree: the step check's all-gather beside the step and the int64[2] all-reduce at
its end, against the one all-gather at its end), so the two share the process layout and
the machine's load.

``--profile`` instead times, in one job of the tree this script runs in, what ``run_step``
does around the stage loop (each part's mean per step, the slowest rank) and, in one process,
what the per-step Python costs (schedule derivation, the step check's row, the plan digest).

    python scripts/per_step_cost.py --trees /work/main /work/wt-agree
    python scripts/per_step_cost.py --old-control-group \
        /work/main/rrfp_async/distributed/_control_group.py
    python scripts/per_step_cost.py --profile
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from typing import Any

WORLD = 4
MBS = 8


PARTS = [  # (attribute of the stage, method, label): what run_step does around the loop
    ("", "_resolve_step", "resolve_step (schedule for the step)"),
    ("control", "begin_step", "control.begin_step"),
    ("control", "end_step", "control.end_step (agreement wait incl.)"),
    ("control", "finish_step", "control.finish_step"),
    ("", "_agree", "_agree (agreement wait incl.; dd70fd4)"),
    ("stage", "run_step", "stage loop run_step (the tasks)"),
    ("trace", "begin_step", "trace.begin_step"),
    ("trace", "write", "trace.write"),
    ("ties", "prepare", "ties.prepare"),
    ("ties", "set_aside", "ties.set_aside"),
    ("ties", "reduce", "ties.reduce"),
    ("channel", "at_step", "channel.at_step"),
]


def _tokens(step: int) -> list[int]:
    rng = random.Random(step)
    return [min(2048, max(32, int(rng.lognormvariate(6.0, 0.8)))) for _ in range(MBS)]


def _worker(
    rank: int, world: int, steps: int, us: float, profile: bool, cprofile: int, executor: str
) -> dict[str, Any]:
    import torch

    import rrfp_async as rr

    torch.set_num_threads(1)
    ex, inputs = _executor(executor, rank, us)
    layout = rr.ProcessLayout.from_world(pp=world)
    groups = rr.build_groups(layout)
    plan = rr.StepPlan(topology=rr.Topology(stages=world), microbatches=MBS)
    parts: dict[str, float] = defaultdict(float)

    def timed(obj: Any, name: str, label: str) -> None:
        fn = getattr(obj, name, None)
        if fn is None:
            return
        if asyncio.iscoroutinefunction(fn):

            async def wrap_async(*a: Any, **k: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return await fn(*a, **k)
                finally:
                    parts[label] += time.perf_counter() - t0

            setattr(obj, name, wrap_async)
        else:

            def wrap(*a: Any, **k: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    parts[label] += time.perf_counter() - t0

            setattr(obj, name, wrap)

    async def go() -> list[float]:
        st = rr.DistributedStage(layout, rr.StepSchedule.build(plan, "1f1b"), ex, groups=groups)
        async with st:
            await st.run_step(inputs(_tokens(0)))  # the plan check
            if profile:
                for part, name, label in PARTS:
                    obj = st if not part else getattr(st, part, None)
                    if obj is not None:
                        timed(obj, name, label)
            times = await _timed_steps(st, ex, inputs, steps)
        st.channel.close(10.0)
        return times

    if cprofile == rank:
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        times = prof.runcall(rr.run, go())
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
        return {"times": times, "parts": dict(parts), "cprofile": text.getvalue()}
    times = rr.run(go())
    return {"times": times, "parts": dict(parts)}


def _executor(kind: str, rank: int, us: float) -> tuple[Any, Any]:
    """This rank's executor and how a step's microbatches are made from token counts.

    ``tiny``: a coroutine that sleeps the emulated time (no torch executor); ``torch``: a
    ``TorchStageExecutor`` of one ``Linear(16, 16)`` behind an autograd op that sleeps the
    emulated time (forward; twice that backward) on its compute thread, the microbatches
    tensors of ``tokens // 16`` rows of 16."""
    import torch

    import rrfp_async as rr

    if kind == "tiny":

        class Emulated:
            async def execute(self, task: Any, data: Any, ctx: Any, /) -> Any:
                tokens = ctx.microbatches[task.mb]
                await asyncio.sleep(tokens * us * 1e-6 * (1 if task.kind == "F" else 2))
                return torch.zeros(4)

        return Emulated(), lambda tokens: list(tokens)

    class Sleep(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            ctx.rows = x.shape[0]
            time.sleep(x.shape[0] * 16 * us * 1e-6)
            return x.clone()

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            time.sleep(2 * ctx.rows * 16 * us * 1e-6)
            return g

    class Stage(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return Sleep.apply(self.lin(x))

    torch.manual_seed(rank)
    ex = rr.TorchStageExecutor(
        {rank: Stage()}, lambda out, mb: out.float().pow(2).mean(), rank=rank
    )

    def inputs(tokens: list[int]) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(sum(tokens))
        return [torch.randn(max(1, t // 16), 16, generator=g) for t in tokens]

    return ex, inputs


def _load_old_control_group(path: str) -> Any:
    """``path`` (another tree's ``_control_group.py``) as a module of this tree's package."""
    import importlib.util

    name = "rrfp_async.distributed._control_group_other"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _zero(ex: Any) -> None:
    for m in getattr(ex, "modules", {}).values():
        m.zero_grad(set_to_none=True)


async def _timed_steps(st: Any, ex: Any, inputs: Any, steps: int) -> list[float]:
    """Steps 1..``steps`` of ``st``, each timed (its gradients zeroed after it)."""
    times = []
    for s in range(1, steps + 1):
        xs = inputs(_tokens(s))
        t0 = time.perf_counter()
        await st.run_step(xs)
        times.append(time.perf_counter() - t0)
        _zero(ex)
    return times


def _ab_worker(
    rank: int, world: int, steps: int, us: float, blocks: int, old_path: str, executor: str
) -> dict[str, list[list[float]]]:
    """Blocks of ``steps`` steps in one job, alternating (A B B A ...) this tree's control
    group ("new") and the one in ``old_path`` ("old"), each block a fresh stage."""
    import torch

    import rrfp_async as rr

    torch.set_num_threads(1)
    old_mod = _load_old_control_group(old_path)

    layout = rr.ProcessLayout.from_world(pp=world)
    groups = rr.build_groups(layout)
    plan = rr.StepPlan(topology=rr.Topology(stages=world), microbatches=MBS)
    out: dict[str, list[list[float]]] = {"old": [], "new": []}

    async def block(variant: str) -> list[float]:
        ex, inputs = _executor(executor, rank, us)
        st = rr.DistributedStage(layout, rr.StepSchedule.build(plan, "1f1b"), ex, groups=groups)
        if variant == "old":
            old = old_mod.ControlGroup(
                old_mod.TorchCollectives(groups.control, torch.device("cpu")),
                who=st._who(),
                rank=layout.rank,
                world_size=layout.world_size,
                timeout=st.step_timeout,
                verify_plan=True,
                agree_steps=True,
                digest_of=st._plan_digest,
                adopt_seed=st._adopt_seed,
                abort_step=st.stage.step_aborted,
            )
            old.plan_tag = lambda schedule: 0  # (its messages carry no tag)
            st.control = old
        async with st:
            await st.run_step(inputs(_tokens(0)))  # the plan check
            times = await _timed_steps(st, ex, inputs, steps)
        st.channel.close(10.0)
        getattr(ex, "close", lambda: None)()
        torch.distributed.barrier()
        return times

    async def go() -> None:
        for i in range(blocks):
            for variant in ("old", "new") if i % 2 == 0 else ("new", "old"):
                out[variant].append(await block(variant))

    rr.run(go())
    return out


def _ab(steps: int, us: float, blocks: int, old_path: str, executor: str) -> None:
    import rrfp_async as rr

    res = rr.spawn(_ab_worker, WORLD, steps, us, blocks, old_path, executor, timeout=1200)
    meds: dict[str, list[float]] = {}
    for v in ("old", "new"):
        meds[v] = [
            statistics.median(max(r[v][b][i] for r in res) for i in range(steps))
            for b in range(blocks)
        ]
    diffs = [(o - n) * 1e3 for o, n in zip(meds["old"], meds["new"], strict=True)]
    print(
        f"{WORLD} gloo ranks in one job, {executor} executor, {MBS} microbatches, {us}"
        f" us/token, {steps} steps a"
        f" block, {blocks} blocks each, alternating: old control group ({old_path})"
        f" {statistics.median(meds['old']) * 1e3:.2f} ms, new"
        f" {statistics.median(meds['new']) * 1e3:.2f} ms a step (median of block medians, the"
        f" slowest rank each step); old - new per block pair"
        f" {', '.join(f'{d:.2f}' for d in diffs)} ms, median {statistics.median(diffs):.2f} ms"
    )


def _job(steps: int, us: float, profile: bool, cprofile: int, executor: str) -> dict[str, Any]:
    import rrfp_async as rr

    res = rr.spawn(_worker, WORLD, steps, us, profile, cprofile, executor, timeout=600)
    for r in res:
        if "cprofile" in r:
            print(r["cprofile"])
    per_step = [max(r["times"][i] for r in res) for i in range(steps)]
    parts: dict[str, float] = {}
    for r in res:
        for k, v in r["parts"].items():
            parts[k] = max(parts.get(k, 0.0), v / steps)
    return {"median": statistics.median(per_step), "parts": parts}


def _python_costs() -> dict[str, float]:
    """Per-step Python on one process: what a step builds or hashes beside its tasks."""
    import rrfp_async as rr

    try:
        from rrfp_async.distributed._digest import PlanDigest
    except ImportError:
        from rrfp_async.distributed._stage import PlanDigest  # type: ignore[no-redef]

    plan = rr.StepPlan(topology=rr.Topology(stages=WORLD), microbatches=MBS)
    base = rr.StepSchedule.build(plan, "1f1b")
    layout = rr.ProcessLayout(pp=WORLD, rank=0)
    out: dict[str, float] = {}

    def per_call(label: str, fn: Any, n: int = 300) -> None:
        try:
            fn()
        except (AttributeError, ImportError, TypeError):
            return  # (not in this tree)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out[label] = (time.perf_counter() - t0) / n

    per_call("StepSchedule.build(plan, '1f1b')", lambda: rr.StepSchedule.build(plan, "1f1b"))
    per_call("base.for_microbatches(8) (same size)", lambda: base.for_microbatches(MBS))
    per_call("base.for_microbatches(7) (new size)", lambda: base.for_microbatches(MBS - 1))
    per_call(
        "PlanDigest.of (the plan check's row)",
        lambda: PlanDigest.of(
            base,
            policy="readiness_first",
            layout=layout,
            max_message_bytes=1 << 28,
            rng_seed=None,
            seed_default=False,
        ),
    )
    from rrfp_async._costs import Durations

    tokens = _tokens(1)
    declared = Durations.from_arrays(plan, [[2e-6 * t for t in tokens]] * plan.num_virtual)
    for hint in ("1f1b", "bfw"):
        sched = rr.StepSchedule.build(plan, hint)
        per_call(
            f"with_durations, hint {hint} (the per-step planner)",
            lambda sched=sched: sched.with_durations(declared),
            n=50,
        )
    try:
        from rrfp_async.distributed._plan_check import step_row

        per_call("step_row (the step check's row)", lambda: step_row(1, base, changed=False))
    except ImportError:
        pass
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--trees", nargs=2, metavar=("A", "B"))
    ap.add_argument("--blocks", type=int, default=4, help="block pairs")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--us-per-token", type=float, default=2.0)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument(
        "--old-control-group",
        metavar="PATH",
        help="in one job, alternate this tree's control group with the one at PATH",
    )
    ap.add_argument("--executor", choices=["tiny", "torch"], default="tiny")
    ap.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--cprofile", type=int, default=-1, metavar="RANK", help="with --profile: cProfile RANK"
    )
    args = ap.parse_args()
    if args.job:
        got = _job(args.steps, args.us_per_token, args.profile, -1, args.executor)
        print(json.dumps(got))
        return
    if args.old_control_group:
        _ab(args.steps, args.us_per_token, 2 * args.blocks, args.old_control_group, args.executor)
        return
    if args.profile:
        got = _job(args.steps, args.us_per_token, True, args.cprofile, args.executor)
        print(f"median step {got['median'] * 1e3:.2f} ms ({WORLD} ranks, slowest rank)")
        for k, v in sorted(got["parts"].items(), key=lambda kv: -kv[1]):
            print(f"  {k:45s} {v * 1e3:8.3f} ms/step (slowest rank)")
        for k, v in sorted(_python_costs().items(), key=lambda kv: -kv[1]):
            print(f"  {k:45s} {v * 1e6:8.1f} us/call (one process)")
        return
    if not args.trees:
        ap.error("--trees A B or --profile")
    meds: dict[str, list[float]] = {t: [] for t in args.trees}
    a, b = args.trees
    for i in range(args.blocks):
        for tree in (a, b) if i % 2 == 0 else (b, a):
            env = dict(os.environ, PYTHONPATH=tree)
            cmd = [sys.executable, os.path.abspath(__file__), "--job", "--steps", str(args.steps)]
            cmd += ["--us-per-token", str(args.us_per_token), "--executor", args.executor]
            out = subprocess.run(cmd, env=env, cwd=tree, check=True, capture_output=True, text=True)
            meds[tree].append(json.loads(out.stdout.strip().splitlines()[-1])["median"])
            print(f"block {i} {tree}: {meds[tree][-1] * 1e3:.2f} ms", flush=True)
    diffs = [(x - y) * 1e3 for x, y in zip(meds[a], meds[b], strict=True)]
    print(
        f"{WORLD} gloo ranks, {MBS} microbatches, {args.us_per_token} us/token, {args.steps}"
        f" steps a block, {args.blocks} pairs: A {a} {statistics.median(meds[a]) * 1e3:.2f} ms,"
        f" B {b} {statistics.median(meds[b]) * 1e3:.2f} ms a step (median of block medians);"
        f" A - B per pair {', '.join(f'{d:.2f}' for d in diffs)} ms, median"
        f" {statistics.median(diffs):.2f} ms"
    )


if __name__ == "__main__":
    main()
