"""The package's layers import only downward and its modules form no import cycle.

The layer order is written once here and in ARCHITECTURE.md (bottom first). Every import in
the package counts: module-level, inside functions and under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import rrfp_async

PACKAGE = Path(rrfp_async.__file__).parent

#: Bottom first. A module may import its own layer and the layers below it, never above.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "base",
        (
            "_errors",
            "_check",
            "_lazy",
            "_tasks",
            "_pytree",
            "_costs",
            "_workloads",
            "_admission",
            "_bridges",
            "_rng",
            "_streams",
        ),
    ),
    ("models", ("models",)),
    ("policies", ("policies",)),
    ("channels", ("channels",)),
    ("loop", ("loop",)),
    ("observability", ("observability",)),
    ("sim", ("sim",)),
    ("distributed", ("distributed",)),
    ("integrations", ("integrations",)),
    ("bench", ("bench",)),
    ("cli", ("cli",)),
    ("face", ("__init__", "__main__", "pipelining", "megatron", "torchtitan")),
)


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> int:
    parts = module.split(".")
    head = "__init__" if len(parts) == 1 else parts[1]
    for i, (_, members) in enumerate(LAYERS):
        if head in members:
            return i
    raise AssertionError(f"{module} belongs to no layer: add it to LAYERS and ARCHITECTURE.md")


def imports_of(module: str, path: Path, known: set[str]) -> Iterator[tuple[str, int]]:
    """Package modules imported by ``module`` with their line numbers."""
    is_pkg = path.name == "__init__.py"
    package = module if is_pkg else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "rrfp_async":
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.split(".")[0] == "rrfp_async":
                target = node.module
            else:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                yield (sub if sub in known else target), node.lineno


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    g: dict[str, set[str]] = {}
    for mod, path in mods.items():
        g[mod] = {t for t, _ in imports_of(mod, path, known) if t in known and t != mod}
    return g


def test_every_module_has_a_layer() -> None:
    for mod in modules():
        layer_of(mod)


def test_layers_import_only_downward() -> None:
    mods = modules()
    known = set(mods)
    upward = []
    for mod, path in mods.items():
        for target, line in imports_of(mod, path, known):
            if target in known and layer_of(target) > layer_of(mod):
                upward.append(
                    f"{mod}:{line} ({LAYERS[layer_of(mod)][0]}) imports {target} "
                    f"({LAYERS[layer_of(target)][0]})"
                )
    assert not upward, "upward imports:\n" + "\n".join(upward)


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(g.get(n, ())):
            if state.get(m) == 1:
                return [*stack[stack.index(m) :], m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(g):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def submodule_graph() -> dict[str, set[str]]:
    """The import graph with re-exporting package ``__init__`` modules seen through: an import
    of ``rrfp_async.loop`` from inside the package counts as importing what it re-exports."""
    g = graph()
    mods = modules()
    packages = {m for m, p in mods.items() if p.name == "__init__.py"}
    out: dict[str, set[str]] = {}
    for mod, targets in g.items():
        if mod in packages:
            continue
        resolved: set[str] = set()
        todo = list(targets)
        while todo:
            t = todo.pop()
            if t in packages:
                todo.extend(g[t] - resolved)
            else:
                resolved.add(t)
        out[mod] = resolved - {mod}
    return out


def test_no_import_cycles() -> None:
    cycle = find_cycle(submodule_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_checker_sees_cycles_and_upward_imports() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert layer_of("rrfp_async._tasks") < layer_of("rrfp_async.loop._stage_loop")
    assert layer_of("rrfp_async.channels._p2p") < layer_of("rrfp_async.loop._stage_loop")
    with pytest.raises(AssertionError, match="no layer"):
        layer_of("rrfp_async.somewhere_new")


def test_module_names_are_unique_across_packages() -> None:
    """One concept per module, one name per concept: a module's file name says which one
    without its package (``_stage.py`` in two packages was two concepts under one name)."""
    seen: dict[str, list[str]] = {}
    for mod, path in modules().items():
        if path.name != "__init__.py":
            seen.setdefault(path.name, []).append(mod)
    repeated = {name: mods for name, mods in seen.items() if len(mods) > 1}
    assert not repeated, f"module names repeat across packages: {repeated}"


def test_no_package_file_is_over_700_lines() -> None:
    long = {
        mod: n for mod, path in modules().items() if (n := len(path.read_text().splitlines())) > 700
    }
    assert not long, f"split by concept: {long}"
