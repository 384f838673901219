"""The docs' complete programs run as written, under ``rr.spawn`` and torchrun, and print what
their pages say: each step's loss, equal to one process training the same model on the same
microbatches (to float rounding), falling as it trains.

A program is a python block of docs/distributed.md or docs/models.md whose first line is a
docstring naming its file (three quotes, then ``train.py: ...``). Each test writes it to a
temporary directory and runs it there as a reader would: ``python train.py`` (the program's
own ``rr.spawn`` starts the ranks) or ``python -m torch.distributed.run ... train.py``. The
single-process reference imports that same file and trains its ``model()``/``blocks()`` on
its ``microbatches()`` with its ``loss_fn``, so it checks the page's code, not a copy of it.
(``tests/test_doc_examples.py`` runs the blocks that need no processes of their own.)
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
PAGES = ("docs/distributed.md", "docs/models.md")
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
_NAMED = re.compile(r'"""(\w+\.py): ')

# Read with finditer over the whole output, not line by line: two ranks that print (the
# replicas of train_async.py) may interleave a line's text and its newline when Python's
# output is unbuffered (PYTHONUNBUFFERED: print writes the two separately).
STEP = re.compile(r"(?<!replica \d )step (\d+)  loss (\d+\.\d{5})")
REPLICA_STEP = re.compile(r"replica (\d) step (\d+)  loss (\d+\.\d{5})")
EVAL = re.compile(r"eval loss (\d+\.\d{5})")
TOL = 2e-5
"""Printed to 5 decimals: half a unit of rounding, plus float summation order."""


def _programs() -> dict[str, tuple[str, str]]:
    """File name -> (page, source) of every complete program of the pages."""
    out: dict[str, tuple[str, str]] = {}
    for page in PAGES:
        for block in _BLOCK.findall((ROOT / page).read_text(encoding="utf-8")):
            m = _NAMED.match(block)
            if m:
                assert m[1] not in out, f"two programs named {m[1]}"
                out[m[1]] = (page, block)
    return out


def _write(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    path.write_text(_programs()[name][1], encoding="utf-8")
    return path


def _run(cmd: list[str], cwd: Path) -> str:
    """Run a program as a reader would (this checkout's rrfp_async); its stdout."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    got = subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=400, check=False
    )
    assert got.returncode == 0, f"{' '.join(cmd)} failed:\n{got.stderr[-4000:]}"
    return got.stdout


def _torchrun(n: int, script: Path) -> str:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return _run([*launcher, "--nproc-per-node", str(n), script.name], script.parent)


def _import(path: Path) -> ModuleType:
    """The program as a module (its ``__main__`` block does not run)."""
    spec = importlib.util.spec_from_file_location(f"_doc_program_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def _like_a_rank() -> Iterator[None]:
    """One torch thread, like every spawned or torchrun rank; this process's random state
    untouched by the program's seeding."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng():
            yield
    finally:
        torch.set_num_threads(n)


def _mirrors(source: str, optimizer: str) -> None:
    """The reference builds the optimizer the program builds (else it compares nothing)."""
    assert optimizer in source, f"the program no longer uses {optimizer}: update the reference"


def _sgd_reference(mod: ModuleType, replicas: int) -> dict[tuple[int, int], float]:
    """``model()`` trained by plain autograd on every replica's microbatches of each step
    (each loss / (replicas * M): the mean the replicas' averaged gradients are of);
    ``{(replica, step): mean loss of that replica's microbatches}`` before each step."""
    out = {}
    with _like_a_rank():
        model = mod.model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(mod.STEPS):
            for r in range(replicas):
                mbs = mod.microbatches(step, r) if replicas > 1 else mod.microbatches(step)
                total = 0.0
                for mb in mbs:
                    loss = mod.loss_fn(model(mb[0]), mb)
                    total += float(loss.detach())
                    (loss / (replicas * len(mbs))).backward()
                out[r, step] = total / len(mbs)
            opt.step()
            opt.zero_grad()
    return out


def test_every_program_of_the_pages_is_run_here() -> None:
    """A new complete program on a page needs its test below."""
    assert {k: v[0] for k, v in _programs().items()} == {
        "train.py": "docs/distributed.md",
        "train_async.py": "docs/distributed.md",
        "lm.py": "docs/models.md",
    }


def _check_train_py(out: str, tmp_path: Path) -> None:
    mod = _import(tmp_path / "train.py")
    _mirrors(_programs()["train.py"][1], "torch.optim.SGD(module.parameters(), lr=0.05)")
    ref = _sgd_reference(mod, 1)
    got = [(int(m[1]), float(m[2])) for m in STEP.finditer(out)]
    assert [s for s, _ in got] == list(range(mod.STEPS)), out  # one line a step, last rank
    for step, loss in got:
        assert abs(loss - ref[0, step]) <= TOL, (step, loss, ref[0, step])
    assert got[-1][1] < got[0][1] / 4, got  # it trains


@pytest.mark.distributed
@pytest.mark.timeout(420)
def test_train_py_run_by_itself_prints_the_losses_of_one_process(tmp_path: Path) -> None:
    script = _write(tmp_path, "train.py")
    _check_train_py(_run([sys.executable, script.name], tmp_path), tmp_path)


@pytest.mark.distributed
@pytest.mark.timeout(420)
def test_train_py_under_torchrun_prints_the_same_losses(tmp_path: Path) -> None:
    _check_train_py(_torchrun(2, _write(tmp_path, "train.py")), tmp_path)


@pytest.mark.distributed
@pytest.mark.timeout(420)
def test_train_async_py_replicas_train_as_one_process_on_both_replicas_data(
    tmp_path: Path,
) -> None:
    # Each replica's printed loss is the one-process reference's on that replica's
    # microbatches: without the gradient all-reduce the replicas would drift apart from it.
    script = _write(tmp_path, "train_async.py")
    out = _run([sys.executable, script.name], tmp_path)
    mod = _import(script)
    _mirrors(_programs()["train_async.py"][1], "torch.optim.SGD(module.parameters(), lr=0.05)")
    ref = _sgd_reference(mod, 2)
    got = {(int(m[1]), int(m[2])): float(m[3]) for m in REPLICA_STEP.finditer(out)}
    assert sorted(got) == sorted(ref), out  # every replica, every step, once
    for key, loss in got.items():
        assert abs(loss - ref[key]) <= TOL, (key, loss, ref[key])
    assert ref[0, 0] != ref[1, 0]  # the replicas do draw different microbatches
    for r in (0, 1):
        assert got[r, mod.STEPS - 1] < got[r, 0] / 4, got


@pytest.mark.distributed
@pytest.mark.timeout(420)
def test_lm_py_trains_its_tied_model_as_one_process_does(tmp_path: Path) -> None:
    # The tie's gradient summed over the two ranks and the per-token loss scale make the
    # pipeline's steps those of the whole model in one process, Adam included.
    script = _write(tmp_path, "lm.py")
    out = _run([sys.executable, script.name], tmp_path)
    mod = _import(script)
    src = _programs()["lm.py"][1]
    _mirrors(src, "lr=1e-2)")
    _mirrors(src, "torch.optim.Adam(")
    steps = int(re.search(r"for step in range\((\d+)\)", src)[1])  # type: ignore[index]
    ref: list[float] = []
    with _like_a_rank():
        model = nn.Sequential(*mod.blocks())
        assert model[-1].weight is model[0].weight  # the tie the page draws
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)  # (the tied weight once)
        for step in range(steps):
            mbs = mod.microbatches(step)
            tokens = sum(mb[1].numel() for mb in mbs)
            total = 0.0
            for mb in mbs:
                loss = mod.loss_fn(model(mb[0]), mb) * mb[1].numel() / tokens
                total += float(loss.detach())
                loss.backward()
            opt.step()
            opt.zero_grad()
            ref.append(total)
        with torch.no_grad():
            evals = [float(mod.loss_fn(model(mb[0]), mb)) for mb in mod.microbatches(100)]
    got = [(int(m[1]), float(m[2])) for m in STEP.finditer(out)]
    assert [s for s, _ in got] == list(range(steps)), out
    # (Adam turns the rounding noise of gradients that are zero in exact arithmetic, such as
    # the attention's key bias, into updates, but those do not change the loss: within 5e-6
    # here, 5e-5 allowed.)
    for step, loss in got:
        assert abs(loss - ref[step]) <= 5e-5, (step, loss, ref[step])
    (ev,) = [float(m[1]) for m in EVAL.finditer(out)]
    assert abs(ev - sum(evals) / len(evals)) <= 5e-5, (ev, evals)
    assert got[-1][1] < 0.7 * got[0][1] and ev < got[0][1], got  # it learns to count


# ------------------------------------------------------------------ docs/policies.md's claim

_REGISTRY_PROGRAM = """
import json

import rrfp_async as rr


async def at_import(view):
    return view.ready[0]


rr.register_policy("at_import", at_import)  # top level: each spawned process runs it too


class Counting(rr.PolicyBase):
    def __init__(self):
        self.calls = 0

    async def __call__(self, view):
        self.calls += 1
        return view.ready[0]


def rank(rank, world, counting):
    found = {}
    for name in ("at_import", "at_run_time"):
        try:
            rr.simulate(policy=name, stages=2, microbatches=2)
            found[name] = "ok"
        except rr.errors.PolicyError as e:
            found[name] = str(e).split(";")[0]
    arrived = counting.calls
    rr.simulate(policy=counting, stages=2, microbatches=2)
    return {"found": found, "arrived": arrived, "after": counting.calls}


if __name__ == "__main__":
    rr.register_policy("at_run_time", at_import)  # the parent only
    counting = Counting()
    rr.simulate(policy=counting, stages=2, microbatches=2)  # 8 decisions, for both ranks
    results = rr.spawn(rank, 2, counting)
    print(json.dumps({"parent": counting.calls, "ranks": results}))
"""


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_spawned_ranks_see_import_time_names_and_get_a_copy_of_a_policy(tmp_path: Path) -> None:
    # docs/policies.md, "What a policy instance sees": a name registered at the top level of
    # the script is known to every spawned rank, one registered under `__main__` is a
    # PolicyError there; a policy object arrives as a copy with the state it had.
    (tmp_path / "job.py").write_text(_REGISTRY_PROGRAM, encoding="utf-8")
    got = json.loads(_run([sys.executable, "job.py"], tmp_path))
    assert got["parent"] == 8  # the ranks' calls stayed in their own copies
    each = {
        "found": {"at_import": "ok", "at_run_time": "unknown policy 'at_run_time'"},
        "arrived": 8,  # a copy of the parent's object, with its state
        "after": 16,
    }
    assert got["ranks"] == [each, each]
