"""The exports stay honest: sorted, existing, documented."""

from __future__ import annotations

import inspect

import pytest

import rrfp_async
import rrfp_async.channels
import rrfp_async.loop
import rrfp_async.policies

MODULES = [rrfp_async, rrfp_async.loop, rrfp_async.channels, rrfp_async.policies]


@pytest.mark.parametrize("mod", MODULES, ids=lambda m: m.__name__)
def test_all_is_sorted_and_exists(mod: object) -> None:
    names = mod.__all__  # type: ignore[attr-defined]
    assert names == sorted(names, key=lambda n: (not n.isupper(), n)) or names == sorted(names)
    for n in names:
        assert hasattr(mod, n), n


@pytest.mark.parametrize("mod", MODULES, ids=lambda m: m.__name__)
def test_every_public_callable_is_documented(mod: object) -> None:
    for n in mod.__all__:  # type: ignore[attr-defined]
        obj = getattr(mod, n)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert inspect.getdoc(obj), f"{mod.__name__}.{n} has no docstring"  # type: ignore[attr-defined]


def test_layering() -> None:
    """policies/ never imports channels/ and channels/ never imports policies/."""
    import ast
    import pathlib

    root = pathlib.Path(rrfp_async.__file__).parent

    def imports(f: pathlib.Path) -> set[str]:
        out = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                out.add(node.module)
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
        return out

    for f in (root / "policies").glob("*.py"):
        assert not any("channels" in m for m in imports(f)), f
    for f in (root / "channels").glob("*.py"):
        assert not any("policies" in m for m in imports(f)), f
