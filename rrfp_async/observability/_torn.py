"""A trace file cut short, read up to the cut (``read_torn``).

``write_trace`` never leaves a torn file (it renames a finished one into place), but a copy
can stop half-way: off a node that died, a full disk on the machine that collects the files,
an interrupted transfer. Such a file is a prefix of a JSON document, and its reader needs
what it holds most: the events before the cut.

The rule: a text is torn when ``json.loads`` fails only because the text ends (the error
is at its end: a value, a string or a delimiter still expected), never for a malformed
byte in the middle; then the top-level object is walked member by member and
``traceEvents`` element by element, keeping every member and event that is whole before the
cut. ``write_trace`` puts ``otherData`` first and one event per line, so a cut keeps the
header (clock, policy, failures) and loses only the events after it; a file of the older
layout (events first) loses its header, and its reader says so.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

__all__ = ["TornRead", "decode_torn", "read_torn"]

_NUMBER_PREFIX = re.compile(r"-?\d*(\.\d*)?([eE][+-]?\d*)?")
_LITERALS = ("true", "false", "null")


@dataclass(frozen=True)
class TornRead:
    """What a torn trace held before its cut.

    Attributes:
        trace: The members read whole (``traceEvents``: the events before the cut, when the
            cut fell inside or after them; absent when it fell before).
        events: How many events were read.
        at: The character offset of the first thing lost (the torn member's or event's
            start).
        header: Whether ``otherData`` was read whole.
        length: The length of the text, in characters (``write_trace`` writes ASCII: its
            bytes).
    """

    trace: dict[str, Any]
    events: int
    at: int
    header: bool
    length: int


def _at_end(text: str, err: json.JSONDecodeError) -> bool:
    """Whether ``json.loads``'s error ``err`` on ``text`` is the text's end, not a bad byte."""
    rest = text[err.pos :]
    stripped = rest.strip()
    if not stripped:
        return True
    if err.msg.startswith("Unterminated string") and "\n" not in rest:
        return True
    if any(lit.startswith(stripped) for lit in _LITERALS):
        return True
    return _NUMBER_PREFIX.fullmatch(stripped) is not None


def decode_torn(raw: bytes) -> tuple[str, bool]:
    """``raw`` as UTF-8 text, and whether its last character was cut (dropped).

    Raises:
        UnicodeDecodeError: A byte that is not UTF-8 before the end.
    """
    try:
        return raw.decode("utf-8"), False
    except UnicodeDecodeError as e:
        if e.reason != "unexpected end of data":
            raise
        return raw[: e.start].decode("utf-8"), True


_WS = re.compile(r"\s*")


def _skip(text: str, pos: int) -> int:
    return _WS.match(text, pos).end()  # type: ignore[union-attr]  # \s* always matches


def _elements(text: str, pos: int, dec: json.JSONDecoder, into: list[Any]) -> tuple[int, bool]:
    """Append the whole elements of the array whose ``[`` ends before ``pos``; returns the
    position after its ``]`` and True, or the cut's position and False."""
    while True:
        pos = _skip(text, pos)
        if text.startswith("]", pos):
            return pos + 1, True
        try:
            element, end = dec.raw_decode(text, pos)
        except json.JSONDecodeError:
            return pos, False
        into.append(element)
        pos = _skip(text, end)
        if text.startswith(",", pos):
            pos += 1
        elif text.startswith("]", pos):
            return pos + 1, True
        else:
            return pos, False


def read_torn(text: str, constant: Any = None) -> TornRead | None:
    """The members and events whole before the cut of ``text``, or None when ``text`` is not
    a JSON object cut short (it parses, or its error is not at its end, or it does not open
    with ``{``). ``constant``: ``json``'s ``parse_constant`` (to refuse ``NaN``)."""
    if not text.strip():  # cut at its first byte
        return TornRead(trace={}, events=0, at=0, header=False, length=len(text))
    try:
        json.loads(text, parse_constant=constant)
        return None
    except json.JSONDecodeError as e:
        if not _at_end(text, e):
            return None
    dec = json.JSONDecoder(parse_constant=constant)
    pos = _skip(text, 0)
    if not text.startswith("{", pos):
        return None
    pos += 1
    out: dict[str, Any] = {}
    events: list[Any] = []
    while True:  # member by member, until the cut
        pos = cut = _skip(text, pos)
        try:
            key, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError:
            break
        pos = _skip(text, pos)
        if not isinstance(key, str) or not text.startswith(":", pos):
            break
        pos = _skip(text, pos + 1)
        if key == "traceEvents" and text.startswith("[", pos):
            out[key] = events
            pos, closed = _elements(text, pos + 1, dec, events)
            if not closed:
                cut = pos
                break
        else:
            try:
                out[key], pos = dec.raw_decode(text, pos)
            except json.JSONDecodeError:
                break
        pos = _skip(text, pos)
        if not text.startswith(",", pos):
            cut = pos
            break
        pos += 1
    header = isinstance(out.get("otherData"), dict)
    return TornRead(trace=out, events=len(events), at=cut, header=header, length=len(text))
