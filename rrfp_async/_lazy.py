"""Lazy public names for a package face (PEP 562): a name's module is imported on first use.

A face lists ``{name: module}`` once; ``exports(__name__, table)`` gives it the module-level
``__getattr__`` and ``__dir__``. So ``import rrfp_async`` (and the command line's ``--help``)
imports no torch, and ``rrfp_async.integrations`` imports torch pipelining only for the
torch drop-in. Type checkers read the same names from the face's ``if TYPE_CHECKING:``
imports; ``tests/test_public_api.py`` holds the two lists equal.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["exports"]


def exports(
    package: str, table: Mapping[str, str], *, cache: bool = True
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for the face ``package`` whose public names live in the
    modules ``table`` gives (relative to the package, e.g. ``"._tasks"``).

    With ``cache=False`` every lookup reads the name from its module afresh (a dictionary
    lookup in ``sys.modules`` once imported): the face never holds a copy, so a name
    replaced in its module (a test's ``monkeypatch``) is what the face gives, exactly as an
    import from the module itself would."""
    import sys

    def __getattr__(name: str) -> Any:
        where = table.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where, package), name)
        if cache:
            setattr(sys.modules[package], name, value)  # the next lookup is a plain attribute
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *table})

    return __getattr__, __dir__
