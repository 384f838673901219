"""One torchtitan launch for tests/compat/test_torchtitan.py: several trainers in a row.

Run by ``python -m torch.distributed.run --nproc-per-node 2 ... torchtitan_worker.py ASSETS
OUT RUNS`` (torchtitan initialises torch.distributed itself, from the torchrun environment;
it skips that when it is already initialised, so one process group serves every trainer and
one launch pays torchtitan's import once). Each run builds torchtitan's own llama3 debug
model from the command-line flags a user gives (``ConfigManager().parse_args``), trains it
through its own ``Trainer`` and writes, per rank, what the trainer reported to
``OUT/<run>.<rank>.json`` and the trained parameters to ``OUT/<run>.<rank>.pt``.

The CPU shims below are test fixtures (torchtitan assumes a GPU); the package carries none:

* torch reports ``cpu`` as the available device type, read once when
  ``torchtitan.tools.utils`` is imported (so before any torchtitan import);
* ``torch.cpu.current_device`` returns index 0 (torchtitan passes it to
  ``barrier(device_ids=...)``) and the memory-statistics calls its ``DeviceMemoryMonitor``
  makes are stubs;
* SDPA in place of FlexAttention (no FlexAttention backward on CPU in torch 2.14): the
  maskless backend torchtitan's own graph-trainer tests use (causal, no per-document mask;
  ``positions`` still reach every stage as keyword inputs).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import traceback
from typing import Any

import torch
import torch._utils


class _Props:
    total_memory = 1 << 34
    name = "cpu"


def cpu_shims() -> None:
    torch._utils._get_available_device_type = lambda: "cpu"  # type: ignore[assignment]
    torch.cpu.current_device = lambda: 0  # type: ignore[assignment,return-value]
    stubs: dict[str, Any] = {
        "get_device_name": lambda *a, **k: "cpu",
        "get_device_properties": lambda *a, **k: _Props(),
        "reset_peak_memory_stats": lambda *a, **k: None,
        "empty_cache": lambda *a, **k: None,
        "memory_stats": lambda *a, **k: {},
    }
    for name, fn in stubs.items():
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, fn)


def base_args(assets: str, out: str, name: str, module: str, config: str) -> list[str]:
    return [
        "--module", module,
        "--config", config,
        "--hf_assets_path", f"{assets}/tokenizer",
        "--dataloader.dataset_path", f"{assets}/c4_test",
        "--dump_folder", f"{out}/{name}",
        "--training.seq_len", "32",
        "--training.local_batch_size", "4",  # 4 microbatches of 1 on PP 2
        "--training.steps", "3",
        "--parallelism.pipeline_parallel_degree", "2",
        "--debug.seed", "7",
        "--training.disable_cuda_graphs",
        "--checkpoint.no-enable",
        "--validator.no-enable",
        "--metrics.log_freq", "1",
    ]  # fmt: skip


def _local(p: torch.Tensor) -> torch.Tensor:
    to_local = getattr(p, "to_local", None)  # torchtitan's parameters are DTensors
    return (to_local() if to_local is not None else p).detach()


def _slow_first_forward(module: torch.nn.Module, seconds: float, microbatches: int) -> None:
    """Each step's first microbatch is late on this rank (as a long sequence would be), so
    that readiness-first has something to run out of the hint's order (a test fixture)."""
    calls = [0]

    def hook(*_: Any) -> None:
        if calls[0] % microbatches == 0:
            time.sleep(seconds)
        calls[0] += 1

    module.register_forward_pre_hook(hook)


def inspect_config(spec: dict[str, Any]) -> dict[str, Any]:
    """A config registry function's schedule fields (a config too big to train here)."""
    import importlib

    from rrfp_async.integrations._torchtitan import schedule_class

    module, fn = spec["inspect"]
    config = getattr(importlib.import_module(module), fn)()
    name = config.parallelism.pipeline_parallel_schedule
    return {
        "name": spec["name"],
        "schedule_name": name,
        "schedule": [c.__name__ for c in schedule_class(name).__mro__[:3]],
        "pp": config.parallelism.pipeline_parallel_degree,
        "imports": config.override.imports,
    }


def run(assets: str, out: str, spec: dict[str, Any]) -> dict[str, Any]:
    if "inspect" in spec:
        return inspect_config(spec)
    from torchtitan.config import ConfigManager
    from torchtitan.models.common.attention import ScaledDotProductAttention

    name = spec["name"]
    if spec.get("import_first"):
        import rrfp_async.torchtitan  # noqa: F401  (imported, but no override listed)
    module, registry = spec.get("config", ("llama3", "llama3_debugmodel"))
    args = base_args(assets, out, name, module, registry) + spec["args"]
    config = ConfigManager().parse_args(args)
    for layer in config.model_spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    if spec.get("no_ac"):
        # torchtitan's own split-backward schedules (ZBV) fail under selective AC on any
        # device ("backward an extra time"); the V runs compare without it.
        config.activation_checkpoint = None
    result: dict[str, Any] = {"name": name}
    trainer = None
    try:
        trainer = config.build()
        rank = torch.distributed.get_rank()  # torchtitan initialised it, at the first build
        sched = trainer.pp_schedule
        result["schedule"] = [c.__name__ for c in type(sched).__mro__[:3]]
        result["module"] = type(sched).__module__
        result["step_timeout"] = getattr(sched, "_step_timeout", None)
        stages = getattr(sched, "_stages", None) or [sched._stage]
        result["stages"] = sorted(s.stage_index for s in stages)
        result["losses"] = []
        result["steps"] = []
        fwd_bwd = trainer.forward_backward_step

        def record(**kw: Any) -> Any:
            loss = fwd_bwd(**kw)
            result["losses"].append(float(loss.detach()))
            stats = getattr(sched, "last_stats", None)
            if stats is not None:
                result["steps"].append(
                    {
                        "policy": stats.policy,
                        "hint": stats.hint,
                        "deviations": stats.deviations,
                        "max_inflight": stats.max_inflight,
                        "peak_inflight": stats.peak_inflight,
                        "budget_bytes": stats.budget_bytes,
                        "peak_bytes": stats.peak_bytes,
                        "executed": [str(t.task) for t in stats.executed],
                    }
                )
            return loss

        trainer.forward_backward_step = record
        if "slow_rank" in spec and spec["slow_rank"] == rank:
            _slow_first_forward(trainer.model_parts[0], spec["slow_s"], spec["microbatches"])
        trainer.train()
        learned = getattr(sched, "learned_bytes", None)  # (ours, where it learns)
        if learned is not None:
            result["learned"] = {"steps": learned.steps, "fitted": learned.ready(sched.plan)}
            measured = sched.activation_bytes()  # the last step's, where it was measured
            result["measured"] = {f"{v}:{i}": b for (v, i), b in sorted(measured.items())}
        params = {
            f"{i}.{k}": _local(p).clone()
            for i, m in enumerate(trainer.model_parts)
            for k, p in m.named_parameters()
        }
        torch.save(params, f"{out}/{name}.{rank}.pt")
        h = hashlib.sha256()
        for k in sorted(params):
            h.update(k.encode())
            h.update(params[k].contiguous().view(torch.uint8).numpy().tobytes())
        result["params"] = h.hexdigest()
    except Exception as e:
        result["error"] = {
            "type": type(e).__name__,
            "message": str(e),
            "traceback": traceback.format_exc()[-3000:],
            "full": traceback.format_exc(),
        }
    finally:
        if trainer is not None:
            trainer.close()
    return result


def main() -> None:
    assets, out, runs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cpu_shims()
    for spec in runs:
        result = run(assets, out, spec)
        rank = torch.distributed.get_rank()
        with open(f"{out}/{spec['name']}.{rank}.json", "w") as f:
            json.dump(result, f)
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
