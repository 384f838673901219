"""The exports stay honest: sorted, existing, documented, and what the examples use."""

from __future__ import annotations

import ast
import inspect
import pathlib

import pytest

import rrfp_async
import rrfp_async.channels
import rrfp_async.distributed
import rrfp_async.errors
import rrfp_async.loop
import rrfp_async.observability
import rrfp_async.policies
import rrfp_async.sim
import rrfp_async.testing
import rrfp_lab

MODULES = [
    rrfp_async,
    rrfp_async.errors,
    rrfp_async.loop,
    rrfp_async.channels,
    rrfp_async.policies,
    rrfp_async.distributed,
    rrfp_async.observability,
    rrfp_async.sim,
    rrfp_async.testing,
    rrfp_lab,
]
EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


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


def test_training_harness_is_the_labs_public_api() -> None:
    """What the training example runs is public API under clear names, the lab's
    (``rrfp_lab``: the example model's harness), not the runtime's. The old names on the
    runtime's face still resolve to the same objects for a release, with a warning."""
    import warnings

    for n in ("TrainConfig", "TrainResult", "train_worker", "image_text_cost"):
        assert n in rrfp_lab.__all__, n
        assert getattr(rrfp_lab, n).__module__ == "rrfp_lab._demo_train", n
        assert n not in rrfp_async.__all__ and n not in dir(rrfp_async), n
        assert n not in rrfp_async.distributed.__all__, n
        with pytest.warns(DeprecationWarning, match=rf"rrfp_async\.{n} moved to rrfp_lab\.{n}"):
            assert getattr(rrfp_async, n) is getattr(rrfp_lab, n)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a runtime name resolves without a warning
        assert rrfp_async.CostModel is not None
    with pytest.raises(AttributeError, match="no attribute 'TrainConfigs'"):
        rrfp_async.TrainConfigs  # noqa: B018
    # image_text_cost returns a CostModel; EmulatedCost is the sleeping wrapper around one.
    assert isinstance(rrfp_lab.image_text_cost(), rrfp_async.CostModel)
    assert "emulated_cost" not in rrfp_async.__all__ + rrfp_async.distributed.__all__


@pytest.mark.parametrize("example", sorted(EXAMPLES.glob("*.py")), ids=lambda p: p.name)
def test_examples_use_only_public_names(example: pathlib.Path) -> None:
    """Users copy the examples: they import nothing private (no ``_module`` of rrfp_async or
    of the lab) and every ``rr.<name>`` (``lab.<name>``, ``rr.<namespace>.<name>``) they use
    is exported."""
    import importlib

    faces = {"rr": rrfp_async.__all__, "lab": rrfp_lab.__all__}
    tree = ast.parse(example.read_text())
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute)
            and isinstance(node.value.value, ast.Name)
            and node.value.value.id == "rr"
            and node.value.attr in rrfp_async._NAMESPACES
        ):
            ns = importlib.import_module(f"rrfp_async.{node.value.attr}")
            assert node.attr in ns.__all__, (example.name, f"rr.{node.value.attr}.{node.attr}")
            continue
        mods: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module:
            mods = [node.module]
        elif isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        for m in mods:
            if m.split(".")[0] in ("rrfp_async", "rrfp_lab"):
                assert not any(part.startswith("_") for part in m.split(".")), (example.name, m)
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in faces
        ):
            if node.value.id == "rr" and node.attr in rrfp_async._NAMESPACES:
                continue  # rr.sim.X: checked above
            assert node.attr in faces[node.value.id], (example.name, f"{node.value.id}.{node.attr}")


def test_layering() -> None:
    """policies/ never imports channels/ and channels/ never imports policies/."""
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


def test_nothing_from_the_network_is_unpickled() -> None:
    """The package and the examples use no pickling collective (``*_object``,
    ``*_object_list``) and import no pickle: tensors, not objects, cross the network."""
    import ast

    root = pathlib.Path(rrfp_async.__file__).parent
    files = [*root.rglob("*.py"), *(root.parent / "examples").glob("*.py")]
    bad = []
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Attribute) and (
                node.attr.endswith("_object") or node.attr.endswith("_object_list")
            ):
                bad.append(f"{f.name}:{node.lineno} {node.attr}")
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                if any(n.split(".")[0] in ("pickle", "cloudpickle", "dill") for n in names):
                    bad.append(f"{f.name}:{node.lineno} imports pickle")
    assert not bad, bad


@pytest.mark.parametrize(
    "face",
    ["rrfp_async", "rrfp_async.observability", "rrfp_async.integrations", "rrfp_lab"],
)
def test_lazy_exports_match_the_type_checkers_imports(face: str) -> None:
    """A lazy face lists each name twice, for the runtime (``_EXPORTS``) and for type
    checkers (``if TYPE_CHECKING:`` imports): the two, and ``__all__``, name the same things
    from the same modules. Names internal to the package family (``_INTERNAL``, for sibling
    packages) are lazy and typed the same way but stay out of ``__all__``."""
    import importlib

    mod = importlib.import_module(face)
    path = pathlib.Path(mod.__file__)  # type: ignore[arg-type]
    tree = ast.parse(path.read_text())
    typed: dict[str, str] = {}
    namespaces: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom)
                for alias in imp.names:
                    if imp.module is None:  # ``from . import sim as sim``: a namespace
                        namespaces.add(alias.asname or alias.name)
                        continue
                    typed[alias.asname or alias.name] = "." * imp.level + (imp.module or "")
    assert namespaces == set(vars(mod).get("_NAMESPACES", ()))
    table: dict[str, str] = next(
        (v for k, v in vars(mod).items() if k in ("_EXPORTS", "_WHERE")), {}
    )
    internal = vars(mod).get("_INTERNAL", {})
    assert table or internal
    assert not set(table) & set(internal)
    assert typed == {**table, **internal}
    assert sorted(mod.__all__) == sorted(table)  # type: ignore[attr-defined]
    for name, where in {**table, **internal}.items():
        assert getattr(mod, name) is getattr(importlib.import_module(where, face), name)


def test_the_face_is_small() -> None:
    """The top level holds what a user writing a training loop, a policy or a simulation
    needs (about 40 names); the rest lives in the namespaces, each an attribute of the face
    (``rr.sim``) without an import of its own. ``__all__`` is derived from the one table."""
    import importlib

    assert len(rrfp_async.__all__) <= 45, len(rrfp_async.__all__)
    assert rrfp_async.__all__ == sorted(rrfp_async._EXPORTS)
    for ns in sorted(rrfp_async._NAMESPACES):
        assert getattr(rrfp_async, ns) is importlib.import_module(f"rrfp_async.{ns}"), ns
        assert ns in dir(rrfp_async), ns
    with pytest.raises(AttributeError, match="no attribute 'simm'"):
        rrfp_async.simm  # noqa: B018


@pytest.mark.parametrize("name", sorted(rrfp_async._MOVED))
def test_names_that_left_the_face_warn_and_resolve(name: str) -> None:
    """Every name that left the top level still resolves for a release, to the same object
    as its new home's, with a ``DeprecationWarning`` that names the new path; it is in
    neither ``__all__`` nor ``dir()``, and its new home exports it."""
    import importlib

    new = rrfp_async._MOVED[name]
    home = importlib.import_module(new)
    assert name in home.__all__, (new, name)
    assert name not in rrfp_async.__all__ and name not in dir(rrfp_async), name
    with pytest.warns(DeprecationWarning, match=rf"rrfp_async\.{name} moved to {new}\.{name}"):
        got = getattr(rrfp_async, name)
    assert got is getattr(home, name)


def test_the_example_models_old_package_warns_and_resolves() -> None:
    """``rrfp_async.models`` (the example model, now the lab's ``rrfp_lab.models``) and its
    modules still import for a release, with a warning, as the lab's modules themselves."""
    import subprocess
    import sys

    code = (
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    import rrfp_async.models.image_text as old\n"
        "    from rrfp_async.models import ImageTextConfig\n"
        "import rrfp_lab.models as lab\n"
        "assert old is lab.image_text and ImageTextConfig is lab.ImageTextConfig\n"
        "print([str(x.message) for x in w if x.category is DeprecationWarning])\n"
    )
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr
    assert "rrfp_async.models moved to rrfp_lab.models" in got.stdout, got.stdout
