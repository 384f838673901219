"""The NCCL-rules checker's other half: the observed gloo control group and the logs.

``ObservedGroup`` wraps the gloo group that carries a checked transport's headers and counts
the headers that announce a device payload (and that open an edge), per edge, so that the
checked groups of ``_nccl_rules`` can refuse a receive posted before its header and a header
posted before its payload's send; ``check_logs`` reads what every rank logged and compares
both ends of every communicator position by position. See ``_nccl_rules``' design note.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from ..channels import wire
from . import _nccl_rules as core

__all__ = ["ObservedGroup", "check_logs", "observe"]


# ----------------------------------------------------------------------- the control group


def _header(t: torch.Tensor) -> tuple[int, int] | None:
    """(magic, kind) at the start of a message buffer (host memory), or None."""
    if t.device.type != "cpu" or t.nbytes < 16:
        return None
    raw = t.detach().reshape(-1).view(torch.uint8)[:16]
    b = bytes(core._ORIG_TOLIST(raw))
    return int.from_bytes(b[:8], "little", signed=True), int.from_bytes(b[8:], "little")


class _ObservedWork:
    def __init__(self, work: Any, group: ObservedGroup, buf: torch.Tensor, src: int | None):
        self._work = work
        self._group = group
        self._buf = buf
        self._src = src

    def wait(self, *a: Any) -> Any:
        out = self._work.wait(*a)
        src = self._src if self._src is not None else self._work.source_rank()
        self._group._seen(self._buf, src)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class ObservedGroup:
    """The gloo control group, observed: counts the headers that announce a device payload
    per edge (see the module's design note); every operation goes through unchanged.

    Args:
        inner: The gloo group.
        register: As for ``CheckedGroup``.
        ranks: As for ``CheckedGroup``.
    """

    def __init__(self, inner: Any, *, register: bool = True, ranks: dict[int, int] | None = None):
        self.inner = inner
        self.reg = core._reg()
        self._global = dict(ranks) if ranks is not None else core._global_ranks(inner)
        self.me = self._global[inner.rank()]
        if register:
            core._register(self, inner, "gloo")

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:
        h = _header(tensors[0])
        if h == (wire.MAGIC, wire.WARMUP):
            # The header that opens an edge's payload communicator goes *before* its 1-byte
            # send (the send blocks until the communicator exists, which needs the peer's
            # receive, which needs this header); it counts as an announcement.
            edge = (self.me, self._global[dst])
            with self.reg.lock:
                self.reg.headers_sent[edge] = self.reg.headers_sent.get(edge, 0) + 1
        elif h is not None and h == (wire.MAGIC, wire.DATA_DEVICE):
            edge = (self.me, self._global[dst])
            reg = self.reg
            with reg.lock:
                n = reg.headers_sent.get(edge, 0) + 1
                issued = reg.issued.get(edge, 0)
                if issued >= n:
                    reg.headers_sent[edge] = n
            if issued < n:
                reg.refuse(
                    f"header {n} announcing a device payload on edge global {edge[0]} ->"
                    f" {edge[1]} posted before its payload's send was issued ({issued} issued):"
                    " the receiver would post a receive whose send may never be enqueued"
                )
        return self.inner.send(tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> _ObservedWork:
        return _ObservedWork(self.inner.recv(tensors, src, tag), self, tensors[0], src)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> _ObservedWork:
        return _ObservedWork(self.inner.recv_anysource(tensors, tag), self, tensors[0], None)

    def _seen(self, buf: torch.Tensor, src: int) -> None:
        if buf.nbytes >= wire.HEADER_BYTES and _header(buf) in (
            (wire.MAGIC, wire.DATA_DEVICE),
            (wire.MAGIC, wire.WARMUP),
        ):
            edge = (self._global[src], self.me)
            with self.reg.lock:
                self.reg.announced[edge] = self.reg.announced.get(edge, 0) + 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def observe(group: Any) -> ObservedGroup:
    """``group`` (gloo) as the observed control group of a checked transport."""
    return ObservedGroup(group)


# ----------------------------------------------------------------------- the logs


def _read(directory: Path) -> list[dict[str, Any]]:
    out = []
    for f in sorted(directory.glob("ops-*.jsonl")):
        for line in f.read_text().splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out


def check_logs(directory: str | Path, *, jobs: Iterable[str] | None = None) -> list[str]:
    """Every problem the logs under ``directory`` show: the violations ranks logged, and
    the (communicator, rank pair)s whose two ends disagree, position by position, on what
    comes next (two receives: the deadlock; two sends; other byte counts).

    Args:
        directory: The ``RRFP_NCCL_RULES`` directory.
        jobs: Only these jobs (default: every job logged there).
    """
    records = _read(Path(directory))
    keep = None if jobs is None else set(jobs)
    problems: list[str] = []
    seqs: dict[tuple[str, str, int, int], list[dict[str, Any]]] = {}
    for r in records:
        if keep is not None and r.get("job") not in keep:
            continue
        if r.get("kind") == "violation":
            where = f" in {r['test']}" if r.get("test") else ""
            problems.append(f"job {r['job']} pid {r['pid']}{where}: {r['text']}")
        elif r.get("kind") == "op":
            seqs.setdefault((r["job"], r["comm"], r["rank"], r["peer"]), []).append(r)
    done: set[tuple[str, str, int, int]] = set()
    for (job, comm, a, b), mine in sorted(seqs.items()):
        if (job, comm, a, b) in done:
            continue
        done |= {(job, comm, a, b), (job, comm, b, a)}
        theirs = seqs.get((job, comm, b, a), [])
        for k, (x, y) in enumerate(zip(mine, theirs, strict=False)):
            if x["op"] == y["op"]:
                both = "receive" if x["op"] == "recv" else "send"
                problems.append(
                    f"job {job} communicator {comm}, operation {k} of global ranks {a} and {b}:"
                    f" both {both} ({x['nbytes']} and {y['nbytes']} bytes; threads"
                    f" {x['thread']!r}, {y['thread']!r}): under NCCL each waits for the other,"
                    " a deadlock"
                )
                break
            if x["nbytes"] != y["nbytes"]:
                problems.append(
                    f"job {job} communicator {comm}, operation {k} of global ranks {a} and {b}:"
                    f" rank {a} {x['op']}s {x['nbytes']} bytes, rank {b} {y['op']}s"
                    f" {y['nbytes']} (NCCL matches the count exactly)"
                )
                break
    return problems
