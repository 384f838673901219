"""A DeepSpeed pipeline training loop on the readiness-first runtime: one added line.

Run:  python examples/deepspeed_dropin.py              (2 gloo processes, readiness-first)
      python examples/deepspeed_dropin.py --deepspeed  (DeepSpeed's own PipelineEngine)

Not under torchrun (no ``RANK`` / ``WORLD_SIZE`` in the environment) the script starts its 2
processes itself (torchrun's launcher, on 127.0.0.1); under torchrun it joins torchrun's.

The loop is gpt-neox's ``train_step_pipe`` in small: a ``PipelineModule`` of ``LayerSpec``
layers with a ``TiedLayerSpec`` embedding that the last stage reuses for its logits,
``(hidden, attention mask)`` tuples between the stages, a ``set_batch_fn`` that turns raw
token rows into ``((tokens, mask), labels)``, and ``engine.train_batch(data_iter)`` once per
step. ``rrfp_async.deepspeed.install()`` before ``deepspeed.initialize`` is the one line.
The sequences vary in length (DeepSpeed's ``dynamic_shape``). Each step prints the loss
``train_batch`` returns; run it with and without ``--deepspeed`` to compare. Needs
``pip install 'rrfp-async[deepspeed]'`` (without it the script says so in one line); CPU:
DeepSpeed's CPU accelerator (``DS_ACCELERATOR=cpu``, set here) over gloo.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from typing import Any

VOCAB, DIM, LAYERS, MBS, GAS, STEPS = 64, 32, 4, 2, 4, 4


def check_extra() -> None:
    if importlib.util.find_spec("deepspeed") is None:
        sys.exit(
            f"{os.path.basename(__file__)} needs deepspeed: pip install 'rrfp-async[deepspeed]'"
        )


def train(use_deepspeed: bool) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from torch import nn

    import rrfp_async.deepspeed

    class Embed(nn.Embedding):
        def forward(self, x: Any) -> Any:  # type: ignore[override]
            tokens, mask = x
            return super().forward(tokens), mask

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ff = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

        def forward(self, x: Any) -> Any:
            h, mask = x
            return h + self.ff(h) * mask.unsqueeze(-1).to(h.dtype), mask

    def logits(embed: nn.Embedding, x: Any) -> torch.Tensor:
        return x[0] @ embed.weight.t() * DIM**-0.5

    def loss_fn(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.reshape(-1, VOCAB), labels.reshape(-1))

    def batch_fn(rows: torch.Tensor) -> Any:  # gpt-neox's shape
        tokens, labels = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
        return (tokens, torch.ones_like(tokens, dtype=torch.bool)), labels

    deepspeed.init_distributed(dist_backend="gloo")
    if not use_deepspeed:
        rrfp_async.deepspeed.install()  # the one line: before deepspeed.initialize
    torch.manual_seed(0)
    model = PipelineModule(
        layers=[
            TiedLayerSpec("embed", Embed, VOCAB, DIM),
            *[LayerSpec(Block) for _ in range(LAYERS)],
            TiedLayerSpec("embed", Embed, VOCAB, DIM, forward_fn=logits),
        ],
        num_stages=torch.distributed.get_world_size(),
        loss_fn=loss_fn,
        partition_method="uniform",
        dynamic_shape=True,
    )
    config = {
        "train_micro_batch_size_per_gpu": MBS,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
        "gradient_clipping": 1.0,
        "steps_per_print": 1_000_000,
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, config=config, model_parameters=[p for p in model.parameters()]
    )
    engine.set_has_attention_mask(True)
    engine.set_batch_fn(batch_fn)
    g = torch.Generator().manual_seed(1)
    rows = [
        torch.randint(
            0, VOCAB, (MBS, int(torch.randint(8, 33, (1,), generator=g)) + 1), generator=g
        )
        for _ in range(GAS * STEPS)
    ]
    data = iter(rows)
    name = type(engine).__name__
    for step in range(STEPS):
        loss = engine.train_batch(data)
        if engine.global_rank == 0:
            print(f"{name} step {step}: loss {loss.item():.6f}", flush=True)
    engine.destroy()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--deepspeed", action="store_true", help="DeepSpeed's own PipelineEngine")
    p.add_argument("--nproc", type=int, default=2, help="pipeline stages (processes)")
    args = p.parse_args()
    check_extra()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        train(args.deepspeed)
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", str(args.nproc), __file__, *sys.argv[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    env.setdefault("DS_ACCELERATOR", "cpu")
    sys.exit(subprocess.run(cmd, env=env, check=False).returncode)


if __name__ == "__main__":
    main()
