"""mkdocs hooks for the API reference (mkdocs.yml): each face's page renders the members
its ``__all__`` lists, each object once, and a public name without a docstring fails the
build.

``::: rrfp_async.x`` on a page becomes the same directive with ``members:`` set from the
face's ``__all__`` (read by importing the face: the lazy top level derives its ``__all__``
from its table, which static analysis cannot evaluate), so the reference shows exactly the
public names, written once in the code. A name several faces export (``PlanError`` on the
top level and in ``rrfp_async.errors``) is documented on the first page of the nav that
lists it; the others name it and link there.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import re
import sys
from pathlib import Path
from typing import Any

# The checkout's package, as griffe reads it (mkdocs.yml's ``paths: [.]``), not an installed one.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

log = logging.getLogger("mkdocs.plugins.rrfp_async")

_DIRECTIVE = re.compile(r"^::: (rrfp_async(?:\.\w+)*)\s*$", re.M)

#: ``id(object) -> (face, page)`` where each public object is documented.
_OWNER: dict[int, tuple[str, str]] = {}


def _nav_files(nav: Any) -> list[str]:
    out: list[str] = []
    for item in nav or []:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        if isinstance(value, list):
            out += _nav_files(value)
        else:
            out.append(str(value))
    return out


def on_config(config: Any) -> Any:
    _OWNER.clear()
    for page in _nav_files(config["nav"]):
        text = (Path(config["docs_dir"]) / page).read_text(encoding="utf-8")
        for module in _DIRECTIVE.findall(text):
            mod = importlib.import_module(module)
            for name in getattr(mod, "__all__", []):
                _OWNER.setdefault(id(getattr(mod, name)), (module, page))
    return config


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    def expand(m: re.Match[str]) -> str:
        module = m.group(1)
        mod = importlib.import_module(module)
        own, elsewhere = [], []
        for name in getattr(mod, "__all__", []):
            obj = getattr(mod, name)
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and not inspect.getdoc(obj):
                log.warning("%s.%s is public (in __all__) and has no docstring", module, name)
            face, where = _OWNER[id(obj)]
            if face == module:
                own.append(name)
            else:
                elsewhere.append(f"[`{name}`]({where}#{face}.{name})")
        members = "".join(f"\n        - {n}" for n in own) or " []"
        also = (
            f"\n\nAlso exported here, documented where first listed: {', '.join(elsewhere)}.\n"
            if elsewhere
            else "\n"
        )
        return f"::: {module}\n    options:\n      members:{members}{also}"

    return _DIRECTIVE.sub(expand, markdown)
