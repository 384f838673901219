"""Stage boundaries that are not one tensor: ``Args`` and the pytree rules.

What a stage may take and return (its *boundary value*) is a *pytree*: a tensor, or a
``tuple`` / ``list`` / ``dict`` (string or integer keys) / :class:`Args`, nested, whose
leaves are tensors or small plain values (``None``, ``bool``, ``int``, ``float``, ``str``).
The same structure arrives at the consumer: in-process as the object itself, across
processes as one message (see the channel's wire format).

How a boundary value (or a first stage's input) calls the module (torch pipelining's rule
for tuples, and a dict microbatch's keys as keywords, as a Hugging Face model takes
``input_ids=..., attention_mask=...``):

* ``Args(*a, **kw)`` -> ``module(*a, **kw)``;
* a ``tuple`` -> ``module(*value)``;
* a ``dict`` whose keys are all strings -> ``module(**value)``;
* anything else (a tensor, a list, a dict with other keys) -> ``module(value)``.

To pass a tuple or a dict as *one* argument, wrap it: ``Args(value)``.

A dict subclass (``OrderedDict``, a Hugging Face ``ModelOutput``) travels as a plain ``dict``;
a named tuple as a plain ``tuple``.

Design note: leaf order
-----------------------
Every function here walks a tree in the same depth-first order (dict items in insertion
order, ``Args`` positional before keyword). That order is the wire order of the tensors and
the order of a gradient message: the gradients of a boundary travel back as a plain tuple
aligned with the *tensor leaves* of the forward value, so a consumer never has to rebuild
its producer's structure and a producer never has to trust a structure it receives.
Nothing here is pickled: a structure is described by a small JSON document whose only
objects are tagged lists, checked on decoding against size and depth limits.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ._errors import ProtocolError

__all__ = [
    "MAX_DEPTH",
    "MAX_LEAVES",
    "MAX_STRUCTURE_BYTES",
    "Args",
    "call_module",
    "decode_structure",
    "encode_structure",
    "map_tensors",
    "tensor_leaves",
]

MAX_DEPTH = 32
"""Deepest nesting a boundary value may have."""
MAX_LEAVES = 4096
"""Most leaves (tensors and plain values) a boundary value may have."""
MAX_STRUCTURE_BYTES = 1 << 20
"""Largest encoded structure (JSON) a message may carry."""


class Args:
    """Positional and keyword arguments of a module call, as one value.

    Return it from a stage (or give it as a first stage's input) to call the next module
    with ``(*args, **kwargs)``::

        return rr.Args(hidden, cos, sin, attention_mask=mask)

    Attributes:
        args: The positional arguments.
        kwargs: The keyword arguments.
    """

    __slots__ = ("args", "kwargs")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.kwargs = kwargs

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Args) and self.args == other.args and self.kwargs == other.kwargs

    __hash__ = None  # type: ignore[assignment]  # mutable contents

    def __repr__(self) -> str:
        parts = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"Args({', '.join(parts)})"


_PLAIN = (type(None), bool, int, float, str)


def _bad(path: str, value: Any) -> ProtocolError:
    return ProtocolError(
        f"boundary value{path}: a stage may pass on tensors, tuples, lists, dicts (str or int"
        f" keys), rr.Args and None/bool/int/float/str leaves; got {type(value).__name__}"
    )


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    """The tensor leaves of ``tree`` in wire order (see the design note)."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    out: list[torch.Tensor] = []

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (tuple, list)):
            for y in x:
                walk(y)
        elif isinstance(x, Mapping):
            for y in x.values():
                walk(y)
        elif isinstance(x, Args):
            for y in x.args:
                walk(y)
            for y in x.kwargs.values():
                walk(y)

    walk(tree)
    return out


def map_tensors(tree: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``tree`` with every tensor leaf ``t`` replaced by ``fn(t)`` (containers become plain
    ``tuple`` / ``list`` / ``dict`` / ``Args``).

    Raises:
        ProtocolError: A leaf or container of an unsupported type (the message names its path).
    """
    if isinstance(tree, torch.Tensor):
        return fn(tree)

    def walk(x: Any, path: str, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise ProtocolError(f"boundary value{path}: nested deeper than {MAX_DEPTH}")
        if isinstance(x, torch.Tensor):
            return fn(x)
        if isinstance(x, _PLAIN):
            return x
        if isinstance(x, tuple):
            return tuple(walk(y, f"{path}[{i}]", depth + 1) for i, y in enumerate(x))
        if isinstance(x, list):
            return [walk(y, f"{path}[{i}]", depth + 1) for i, y in enumerate(x)]
        if isinstance(x, Mapping):
            d = {}
            for k, y in x.items():
                if not isinstance(k, (str, int)) or isinstance(k, bool):
                    raise ProtocolError(
                        f"boundary value{path}: dict keys must be str or int, got {k!r}"
                    )
                d[k] = walk(y, f"{path}[{k!r}]", depth + 1)
            return d
        if isinstance(x, Args):
            return Args(
                *(walk(y, f"{path}.args[{i}]", depth + 1) for i, y in enumerate(x.args)),
                **{k: walk(y, f"{path}.kwargs[{k!r}]", depth + 1) for k, y in x.kwargs.items()},
            )
        raise _bad(path, x)

    return walk(tree, "", 0)


def call_module(module: Callable[..., Any], value: Any, kwargs: Mapping[str, Any]) -> Any:
    """Call ``module`` with a boundary value (the rule in the module docstring), adding the
    keyword arguments ``kwargs`` (side inputs) that the value does not already give."""
    if isinstance(value, Args):
        if not kwargs:
            return module(*value.args, **value.kwargs)
        return module(*value.args, **{**kwargs, **value.kwargs})
    if isinstance(value, tuple):
        return module(*value, **kwargs)
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        return module(**{**kwargs, **value})
    return module(value, **kwargs)


# ---------------------------------------------------------------------------- wire structure

_T, _TUPLE, _DICT, _ARGS, _LIST, _FLOAT = "T", "t", "d", "a", "l", "f"


def encode_structure(
    tree: Any, dtype_code: Callable[[torch.dtype], int]
) -> tuple[bytes, list[torch.Tensor]]:
    """The JSON structure of ``tree`` and its tensor leaves in wire order.

    A tensor leaf is ``["T", dtype code, requires_grad, [shape]]``; containers are tagged
    lists (``["t", ...]`` tuple, ``["l", ...]`` list, ``["d", [key, value], ...]`` dict,
    ``["a", [args], [[key, value], ...]]`` Args); plain values are themselves (a float that
    is not finite as ``["f", "inf"]``).

    Raises:
        ProtocolError: An unsupported leaf or container, a structure too deep, too many
            leaves, or an encoding larger than ``MAX_STRUCTURE_BYTES``.
    """
    tensors: list[torch.Tensor] = []
    count = 0

    def walk(x: Any, path: str, depth: int) -> Any:
        nonlocal count
        if depth > MAX_DEPTH:
            raise ProtocolError(f"boundary value{path}: nested deeper than {MAX_DEPTH}")
        count += 1
        if count > MAX_LEAVES:
            raise ProtocolError(f"boundary value: more than {MAX_LEAVES} leaves")
        if isinstance(x, torch.Tensor):
            tensors.append(x)
            return [_T, dtype_code(x.dtype), int(x.requires_grad), list(x.shape)]
        if x is None or isinstance(x, (bool, int, str)):
            return x
        if isinstance(x, float):
            return x if math.isfinite(x) else [_FLOAT, repr(x)]
        if isinstance(x, tuple):
            return [_TUPLE, *(walk(y, f"{path}[{i}]", depth + 1) for i, y in enumerate(x))]
        if isinstance(x, list):
            return [_LIST, *(walk(y, f"{path}[{i}]", depth + 1) for i, y in enumerate(x))]
        if isinstance(x, Mapping):
            items = []
            for k, y in x.items():
                if not isinstance(k, (str, int)) or isinstance(k, bool):
                    raise ProtocolError(
                        f"boundary value{path}: dict keys must be str or int, got {k!r}"
                    )
                items.append([k, walk(y, f"{path}[{k!r}]", depth + 1)])
            return [_DICT, *items]
        if isinstance(x, Args):
            a = [walk(y, f"{path}.args[{i}]", depth + 1) for i, y in enumerate(x.args)]
            kw = [[k, walk(y, f"{path}.kwargs[{k!r}]", depth + 1)] for k, y in x.kwargs.items()]
            return [_ARGS, a, kw]
        raise _bad(path, x)

    doc = json.dumps(walk(tree, "", 0), separators=(",", ":")).encode()
    if len(doc) > MAX_STRUCTURE_BYTES:
        raise ProtocolError(
            f"boundary value: its structure takes {len(doc)} bytes, more than {MAX_STRUCTURE_BYTES}"
        )
    return doc, tensors


def decode_structure(
    doc: bytes,
    make_tensor: Callable[[int, tuple[int, ...], bool], torch.Tensor],
) -> Any:
    """Rebuild a tree from its JSON structure; ``make_tensor(dtype code, shape,
    requires_grad)`` returns each tensor leaf, called in wire order.

    Raises:
        ProtocolError: The document is not a structure this module writes (bad JSON, an
            unknown tag, a bad shape, too deep, too many leaves); nothing is evaluated.
    """
    if len(doc) > MAX_STRUCTURE_BYTES:
        raise ProtocolError(f"structure of {len(doc)} bytes > {MAX_STRUCTURE_BYTES}")
    try:
        root = json.loads(doc)
    except (ValueError, RecursionError) as e:
        raise ProtocolError(f"structure is not valid JSON: {e}") from None
    count = 0

    def bad(why: str) -> ProtocolError:
        return ProtocolError(f"corrupt structure: {why}")

    def key(k: Any) -> str | int:
        if isinstance(k, bool) or not isinstance(k, (str, int)):
            raise bad(f"dict key {k!r}")
        return k

    def walk(x: Any, depth: int) -> Any:
        nonlocal count
        count += 1
        if depth > MAX_DEPTH or count > MAX_LEAVES:
            raise bad("too deep or too many leaves")
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if not isinstance(x, list) or not x or not isinstance(x[0], str):
            raise bad(f"unexpected element {str(x)[:60]}")
        tag = x[0]
        if tag == _T:
            if len(x) != 4 or not isinstance(x[1], int) or x[2] not in (0, 1):
                raise bad(f"tensor leaf {x}")
            shape = x[3]
            if not isinstance(shape, list) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
            ):
                raise bad(f"tensor shape {shape}")
            return make_tensor(x[1], tuple(shape), bool(x[2]))
        if tag == _TUPLE:
            return tuple(walk(y, depth + 1) for y in x[1:])
        if tag == _LIST:
            return [walk(y, depth + 1) for y in x[1:]]
        if tag == _DICT:
            d: dict[str | int, Any] = {}
            for item in x[1:]:
                if not isinstance(item, list) or len(item) != 2:
                    raise bad("dict item")
                d[key(item[0])] = walk(item[1], depth + 1)
            return d
        if tag == _ARGS:
            if len(x) != 3 or not isinstance(x[1], list) or not isinstance(x[2], list):
                raise bad("Args")
            a = [walk(y, depth + 1) for y in x[1]]
            kw: dict[str, Any] = {}
            for item in x[2]:
                if not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], str):
                    raise bad("Args keyword")
                kw[item[0]] = walk(item[1], depth + 1)
            return Args(*a, **kw)
        if tag == _FLOAT and len(x) == 2 and x[1] in ("inf", "-inf", "nan"):
            return float(x[1])
        raise bad(f"unknown tag {tag!r}")

    return walk(root, 0)
