"""What the activation meter costs a forward (``TorchStageExecutor(measure_activations=True)``,
saved-tensor hooks on CPU): forward time with the meter over forward time without, and the
same for forward + backward, on one transformer block at a few sizes.

    python scripts/activation_meter_cost.py [--repeats 30] [--threads 1]

The block is ``nn.TransformerEncoderLayer`` (pre-norm, GELU, no dropout), batch 1, in
training mode; the meter excludes its weights as the executor does. With and without the
meter alternate (one of each per round, the first of a round alternating) and each ratio is
the median over the rounds of that round's with / without, so a load that comes and goes on
the machine falls on both sides of a ratio; ``added`` is the difference of the medians.
The meter's cost is per saved tensor (a Python call, a detached alias) plus one pass over
the storages at the end, so its share is largest where a forward is short.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from rrfp_async.distributed._activation_meter import ActivationMeter, weight_storages

SIZES = ((64, 16), (128, 64), (256, 256), (512, 512), (1024, 1024))  # (d_model, sequence length)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), {args.repeats} rounds;"
        " medians, ms; ratio = with meter / without"
    )
    print(
        f"{'d_model':>7} {'seq':>5} {'saved':>5} {'MiB':>7} | {'F off':>7} {'F on':>7}"
        f" {'ratio':>6} | {'F+B off':>8} {'F+B on':>8} {'ratio':>6} | {'F added us':>10}"
    )
    for d, s in SIZES:
        block = nn.TransformerEncoderLayer(
            d,
            max(1, d // 64),
            4 * d,
            dropout=0.0,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        ).train()
        x = torch.randn(1, s, d, requires_grad=True)
        weights = weight_storages(block)
        on, off = ActivationMeter(), ActivationMeter(enabled=False)
        times: dict[tuple[str, bool], list[float]] = {
            (k, m): [] for k in ("F", "FB") for m in (True, False)
        }
        saved = nbytes = 0
        for r in range(args.repeats + 2):  # (two warm-up rounds)
            for meter in (on, off) if r % 2 else (off, on):
                t0 = time.perf_counter()
                with meter.measure(exclude=weights, keep=[x]) as m:
                    y = block(x)
                    m.hold([y])
                t1 = time.perf_counter()
                y.sum().backward()
                t2 = time.perf_counter()
                if r >= 2:
                    times[("F", meter.enabled)].append(t1 - t0)
                    times[("FB", meter.enabled)].append(t2 - t0)
                if meter.enabled:
                    saved, nbytes = m.saved_tensors, m.bytes
                x.grad = None
                block.zero_grad(set_to_none=True)
        med = {k: statistics.median(v) for k, v in times.items()}
        ratio = {
            k: statistics.median(
                a / b for a, b in zip(times[(k, True)], times[(k, False)], strict=True)
            )
            for k in ("F", "FB")
        }
        added = (med[("F", True)] - med[("F", False)]) * 1e6
        print(
            f"{d:7d} {s:5d} {saved:5d} {nbytes / 2**20:7.2f} |"
            f" {med[('F', False)] * 1e3:7.3f} {med[('F', True)] * 1e3:7.3f}"
            f" {ratio['F']:6.3f} |"
            f" {med[('FB', False)] * 1e3:8.3f} {med[('FB', True)] * 1e3:8.3f}"
            f" {ratio['FB']:6.3f} | {added:10.1f}"
        )


if __name__ == "__main__":
    main()
