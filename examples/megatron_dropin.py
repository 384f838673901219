"""A megatron-core training loop on the readiness-first runtime: one changed line.

Run:  python examples/megatron_dropin.py                  (2 gloo processes, 1F1B)
      python examples/megatron_dropin.py --vp 2           (interleaved, 2 chunks/rank)
      python examples/megatron_dropin.py --vp 2 --megatron    (megatron's own schedule)

Not under torchrun (no ``RANK`` / ``WORLD_SIZE`` in the environment) the script starts its 2
processes itself; under torchrun (``torchrun --nproc-per-node 2 ...``) it joins torchrun's.
``--spawn``, once needed for the former, is still accepted and changes nothing.

The script is written as Megatron-LM's ``training.py`` (megatron-core 0.19) calls the
schedule: ``get_forward_backward_func(schedule_pg_collection=...)`` (where the installed
megatron-core has that argument: 0.16 runs the same script without it), the model as a list
of chunks (one per virtual pipeline stage), one data iterator per chunk, and every keyword
``train_step`` passes. ``--megatron`` swaps back the one import that differs. Needs
``pip install 'rrfp-async[megatron]'`` (without it the script says so in one line); runs
on megatron-core 0.16 and 0.19.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import os
import sys
import threading
import warnings
from typing import Any

import torch
import torch.distributed as dist

import rrfp_async as rr

VOCAB, HIDDEN, SEQ, MBS, N_MB, STEPS = 64, 32, 16, 2, 4, 3


# --- Only needed without a GPU: megatron-core assumes CUDA. On a GPU machine delete this
# block (and the calls to cpu_shims and cpu_rng_tracker below). ----------------------------
def cpu_shims() -> None:
    from torch.overrides import TorchFunctionMode

    class CudaToCpu(TorchFunctionMode):  # device="cuda" -> cpu (a causal mask, a counter)
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):  # type: ignore[no-untyped-def]
            kwargs = dict(kwargs or {})
            dev = kwargs.get("device")
            if dev is not None and torch.device(dev).type == "cuda":
                kwargs["device"] = "cpu"
            return func(*args, **kwargs)

    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    CudaToCpu().__enter__()
    run = threading.Thread.run  # the mode is per thread: also on the compute threads

    def run_on_cpu(self: threading.Thread) -> None:
        with CudaToCpu():
            run(self)

    threading.Thread.run = run_on_cpu  # type: ignore[method-assign]


def cpu_rng_tracker() -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()  # dropout is 0


# -------------------------------------------------------------------------------------------


def batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(step)
    toks = [torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=g) for _ in range(N_MB)]
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in toks]


def forward_step(data_iterator: Any, model: torch.nn.Module) -> Any:
    tokens, labels = next(data_iterator)  # every chunk reads its own copy of the microbatch
    pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    out = model(tokens, pos, None, labels=labels)  # per-token losses on the last stage

    def loss_func(losses: torch.Tensor) -> Any:
        loss = losses.float().mean()
        return loss, {"lm loss": loss.detach().clone()}  # Megatron scales `loss` in place

    return out, loss_func


def worker(rank: int, world: int, use_megatron: bool, vp: int | None) -> list[float]:
    cpu_shims()  # only without a GPU
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine / Apex not installed"
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.pipeline_parallel.utils import is_vp_first_stage, is_vp_last_stage
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.transformer_config import TransformerConfig

        if use_megatron:
            from megatron.core.pipeline_parallel import get_forward_backward_func
        else:  # the one changed line
            from rrfp_async.megatron import get_forward_backward_func

        parallel_state.initialize_model_parallel(
            pipeline_model_parallel_size=world, virtual_pipeline_model_parallel_size=vp
        )
        cpu_rng_tracker()  # only without a GPU
        chunks = vp or 1
        interleaved = {}
        if vp is not None:  # Megatron-LM's p2p setting for the interleaved schedule
            interleaved = {
                "virtual_pipeline_model_parallel_size": vp,
                "overlap_p2p_comm": True,
                "batch_p2p_comm": False,
            }
        config = TransformerConfig(
            num_layers=2 * world * chunks,
            hidden_size=HIDDEN,
            num_attention_heads=4,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            pipeline_model_parallel_size=world,
            pipeline_dtype=torch.float32,
            **interleaved,
        )
        model = []  # one chunk per virtual pipeline stage, as Megatron-LM's get_model builds
        for c in range(chunks):
            torch.manual_seed(100 * c + rank)
            model.append(
                GPTModel(
                    config=config,
                    transformer_layer_spec=get_gpt_layer_local_spec(),
                    vocab_size=VOCAB,
                    max_sequence_length=SEQ,
                    pre_process=parallel_state.is_pipeline_first_stage()
                    and is_vp_first_stage(c, vp),
                    post_process=parallel_state.is_pipeline_last_stage()
                    and is_vp_last_stage(c, vp),
                    share_embeddings_and_output_weights=False,
                    **({"vp_stage": c} if vp is not None else {}),
                )
            )
    params = [p for m in model for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    # training.py: get_forward_backward_func(schedule_pg_collection=pg_collection) (0.19).
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    from megatron.core.pipeline_parallel import get_forward_backward_func as installed

    factory_args = inspect.signature(installed).parameters  # the installed megatron-core's
    with_pgc = {"schedule_pg_collection": pgc} if "schedule_pg_collection" in factory_args else {}
    losses: list[float] = []
    for step in range(STEPS):
        forward_backward_func = get_forward_backward_func(**with_pgc)
        data = batches(step)
        iterators = [iter(data) for _ in model] if vp is not None else iter(data)
        reduced = forward_backward_func(  # every keyword training.py's train_step passes
            forward_step_func=forward_step,
            data_iterator=iterators,
            model=model,
            num_microbatches=N_MB,
            seq_length=SEQ,
            micro_batch_size=MBS,
            decoder_seq_length=None,
            forward_only=False,
            adjust_tensor_shapes_fn=None,
            force_all_reduce=False,
            p2p_communicator=None,
            pg_collection=None,
        )
        opt.step()
        opt.zero_grad()
        if reduced:  # the last pipeline stage
            losses.append(sum(float(d["lm loss"]) for d in reduced) / len(reduced))
    parallel_state.destroy_model_parallel()  # (our function needs no close(), as megatron's)
    return losses


def require(module: str, extra: str) -> None:
    """Exit with one line saying what to install, not a traceback, when ``module`` is
    missing."""
    try:
        found = importlib.util.find_spec(module) is not None
    except ImportError:  # its parent package is missing
        found = False
    if not found:
        sys.exit(f"{os.path.basename(__file__)} needs {module}: pip install 'rrfp-async[{extra}]'")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--spawn",
        action="store_true",
        help="accepted for old command lines: without torchrun the script starts its processes",
    )
    ap.add_argument("--megatron", action="store_true", help="Megatron's own schedule instead")
    ap.add_argument("--vp", type=int, default=None, help="virtual pipeline size (interleaved)")
    args = ap.parse_args()
    require("megatron.core", "megatron")
    if not {"RANK", "WORLD_SIZE"} <= os.environ.keys():  # not under torchrun: start them here
        losses = rr.spawn(worker, 2, args.megatron, args.vp, timeout=300)[-1]
    else:
        dist.init_process_group("gloo")  # torchrun's env:// rendezvous
        try:
            rank, world = dist.get_rank(), dist.get_world_size()
            losses = worker(rank, world, args.megatron, args.vp)
            dist.barrier()  # nobody tears the group down while a peer still communicates
        finally:
            dist.destroy_process_group()
        if rank != world - 1:
            return  # the last pipeline stage has the losses
    kind = "interleaved" if args.vp else "1F1B"
    which = f"megatron {kind}" if args.megatron else f"rrfp_async readiness-first ({kind})"
    for step, loss in enumerate(losses):
        print(f"{which}: step {step} mean lm loss {loss:.6f}")


if __name__ == "__main__":
    main()
