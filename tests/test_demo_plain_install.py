"""The default command on a plain install (issue 38 item 5): ``pip install rrfp-async``, no
extra, then ``rrfp-async demo``. Its stderr holds no third-party warning, and its verdict
claims only what its test can decide (3 paired steps: "too few steps to judge").

A plain install is emulated in this environment (which holds every extra and the test
tools): the child processes see only the distributions that ``pyproject.toml``'s
``dependencies`` pull in, transitively; every other installed package's top-level modules
are hidden (``None`` in ``sys.modules``, set by a ``sitecustomize`` on ``PYTHONPATH``, which
the demo's spawned ranks run too). torch, for one, does not require NumPy but warns on
every import without it ("Failed to initialize NumPy"): once per process, 5 times per demo.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterable
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent

#: What torchrun (or rr.spawn) sets in a rank: a plain shell has none of them.
RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

#: A Python warning as the warnings module prints it ("file:12: UserWarning: text").
WARNING_LINE = re.compile(r"\b\w*Warning: ")


def declared_distributions(extras: Iterable[str] = ()) -> set[str]:
    """The distributions a ``pip install rrfp-async[extras]`` brings, read from this
    checkout's ``pyproject.toml`` and, transitively, from the installed packages' metadata
    (canonical names; rrfp-async included)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    todo = [Requirement(r) for r in project["dependencies"]]
    for extra in extras:
        todo += [Requirement(r) for r in project["optional-dependencies"][extra]]
    seen = {canonicalize_name(project["name"])}
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # another platform's, or one of the dependency's own extras
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            todo += [Requirement(r) for r in md.distribution(name).requires or []]
        except md.PackageNotFoundError:
            continue  # declared but not installed here: nothing of it to keep visible
    return {str(n) for n in seen}


def undeclared_modules(keep: set[str]) -> list[str]:
    """Top-level modules of the installed distributions outside ``keep``."""
    out = []
    for module, dists in md.packages_distributions().items():
        if module in sys.stdlib_module_names or module.startswith("__"):
            continue
        if not any(canonicalize_name(d) in keep for d in dists):
            out.append(module)
    return sorted(out)


def hidden_env(site: Path, hide: Iterable[str]) -> dict[str, str]:
    """The environment of a plain shell (no rank variables) that imports this checkout's
    packages and cannot import ``hide``: a ``sitecustomize`` in ``site`` puts ``None`` in
    ``sys.modules`` for each (an import raises ``ModuleNotFoundError``, ``find_spec``
    returns None), in this process and in every Python process it starts."""
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(
        f"import sys\nfor _name in {sorted(hide)!r}:\n    sys.modules.setdefault(_name, None)\n",
        encoding="utf-8",
    )
    env = {k: v for k, v in os.environ.items() if k not in RANK_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")])
    return env


def test_the_emulated_plain_install_is_not_vacuous(tmp_path: Path) -> None:
    """The plain install hides the extras' packages (here installed) and keeps the declared
    ones; a child process of it really cannot import an extra."""
    keep = declared_distributions()
    assert {"torch", "click", "rich", "structlog"} <= keep
    hidden = undeclared_modules(keep)
    assert "torch" not in hidden and "rich" not in hidden
    assert {"pytest", "transformers", "matplotlib"} <= set(hidden), hidden
    code = "import importlib.util as u; print(u.find_spec('matplotlib'), u.find_spec('rich'))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=hidden_env(tmp_path, hidden),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.startswith("None ModuleSpec(name='rich'"), out.stdout


SMALL_DEMO = ("--stages", "2", "-m", "4", "--steps", "3")


@pytest.fixture(scope="module")
def plain_demo(tmp_path_factory: pytest.TempPathFactory) -> subprocess.CompletedProcess[str]:
    """``rrfp-async demo`` on a plain install, small (2 stages, 4 microbatches, 3 steps)."""
    tmp = tmp_path_factory.mktemp("plain_demo")
    env = hidden_env(tmp / "site", undeclared_modules(declared_distributions()))
    env["COLUMNS"] = "200"  # the tables' cells unwrapped
    return subprocess.run(
        [sys.executable, "-m", "rrfp_async", "demo", *SMALL_DEMO, "--out", str(tmp / "out")],
        env=env,
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_demo_on_a_plain_install_prints_no_third_party_warning(
    plain_demo: subprocess.CompletedProcess[str],
) -> None:
    assert plain_demo.returncode == 0, plain_demo.stderr[-3000:]
    warned = [line for line in plain_demo.stderr.splitlines() if WARNING_LINE.search(line)]
    assert not warned, "\n".join(warned)
    # The run itself went as a plain install's does: no matplotlib, so no PNG, and it says so.
    assert "PNG skipped" in plain_demo.stderr and "rrfp-async[plot]" in plain_demo.stderr


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_demo_at_three_steps_says_too_few_steps_to_judge(
    plain_demo: subprocess.CompletedProcess[str],
) -> None:
    assert plain_demo.returncode == 0, plain_demo.stderr[-3000:]
    verdicts: dict[str, str] = {}  # the timing table's rows (6 cells), before the behaviour's
    for line in plain_demo.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        if len(cells) == 6 and cells[0] in ("strict@1f1b", "strict", "readiness_first"):
            verdicts.setdefault(cells[0], cells[5])
    # The baseline is the fixed order torch and Megatron run, at the same activation bytes.
    assert verdicts["strict@1f1b"] == "baseline", plain_demo.stdout
    for policy in ("strict", "readiness_first"):
        assert verdicts[policy].startswith("too few steps to judge: n = 3 < 6"), plain_demo.stdout
    assert "within noise" not in plain_demo.stdout
