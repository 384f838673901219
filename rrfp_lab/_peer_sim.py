"""The peer benchmark's steps in the simulator (virtual time, no host cost): what the
configurations would gain with the emulated durations alone. Torch-free.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from ._peer_config import PeerConfig, Step, make_steps

__all__ = ["SIMULATED", "peer_simulated"]


SIMULATED: tuple[tuple[str, str, float, bool], ...] = (
    ("1f1b", "strict", 1.0, False),
    ("gpipe", "strict", 1.0, False),
    ("breadth_first_weighted", "strict", 1.0, False),
    ("breadth_first_weighted", "readiness_first", 1.0, False),
    ("breadth_first_weighted", "readiness_first", 2.0, False),
    ("breadth_first_weighted", "readiness_first", 1.0, True),
    ("breadth_first_weighted", "readiness_first", 2.0, True),
)
"""(hint, policy, memory factor, split backward) rows of ``peer_simulated``."""

_GUIDED = ("breadth_first_weighted", "backward_first", "1f1b", "zb_h1")


def peer_simulated(
    cfg: PeerConfig, *, latency: float = 0.0, guided: bool = True
) -> list[dict[str, Any]]:
    """The same steps in the simulator (virtual time, no host cost): each configuration's
    median ratio to strict 1F1B and median efficiency, step by step as in the real run.

    With ``guided``, two more rows per memory factor: a *simulation-guided* hint (each step,
    simulate every hint of ``_GUIDED`` under ``readiness_first`` on the declared durations,
    keep the fastest) and the *oracle* (the fastest on the realized durations).
    """
    from rrfp_async.sim import simulate

    steps = make_steps(cfg)[cfg.warmup_steps :]
    p, m = cfg.stages, cfg.microbatches

    def run(st: Step, i: int, hint: str, pol: str, mf: float, split: bool, jitter: float) -> Any:
        fw = [[cfg.us_per_token * 1e-6 * t for t in st.tokens]] * p
        return simulate(
            stages=p,
            microbatches=m,
            forward=fw,
            hint=hint,
            policy=pol,
            memory_factor=mf,
            jitter=jitter,
            seed=cfg.seed * 1000 + i,
            latency=latency,
            split_backward=split,
        )

    base = [run(st, i, "1f1b", "strict", 1.0, False, cfg.jitter) for i, st in enumerate(steps)]
    rows = []
    for hint, pol, mf, split in SIMULATED:
        res = [run(st, i, hint, pol, mf, split, cfg.jitter) for i, st in enumerate(steps)]
        rows.append(_sim_row(f"{hint} {pol} {mf:g}x" + (" split" if split else ""), base, res))
    if guided:
        for mf in (1.0, 2.0):
            picked, best = [], []
            for i, st in enumerate(steps):
                cands = {h: run(st, i, h, "readiness_first", mf, True, cfg.jitter) for h in _GUIDED}
                plan = {h: run(st, i, h, "readiness_first", mf, True, 0.0) for h in _GUIDED}
                picked.append(cands[min(plan, key=lambda h: plan[h].makespan)])
                best.append(min(cands.values(), key=lambda r: r.makespan))
            rows.append(_sim_row(f"simulation-guided readiness_first {mf:g}x split", base, picked))
            rows.append(_sim_row(f"oracle readiness_first {mf:g}x split", base, best))
    return rows


def _sim_row(name: str, base: Sequence[Any], res: Sequence[Any]) -> dict[str, Any]:
    return {
        "configuration": name,
        "vs_strict_1f1b": statistics.median(
            b.makespan / r.makespan for b, r in zip(base, res, strict=True)
        ),
        "efficiency": statistics.median(r.lower_bound / r.makespan for r in res),
    }
