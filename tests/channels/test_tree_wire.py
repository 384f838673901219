"""Pytree payloads on the wire: one message per boundary value, no pickle, flags kept, bad
structures refused (pure packing, then two processes through the real channel)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import torch

import rrfp_async as rr
from rrfp_async._pytree import MAX_DEPTH, call_module, map_tensors, tensor_leaves
from rrfp_async.channels._p2p import P2PChannel
from rrfp_async.channels._wire import (
    HEADER_LEN,
    MAGIC,
    REQUIRES_GRAD,
    TREE,
    encode_header,
    pack_tree,
    pack_tree_device,
    unpack_tree,
    unpack_tree_device,
)
from tests._pool import pooled_spawn

CPU = torch.device("cpu")


def _value() -> Any:
    h = torch.randn(2, 3, 4).requires_grad_()
    return (
        h,
        torch.ones(2, 3, dtype=torch.bool),
        {"pos": torch.arange(3), "scale": 0.5, "name": "x", "none": None, 7: [1, 2.5, True]},
        rr.Args(torch.zeros(0), k=torch.tensor(3.0, dtype=torch.float64), inf=float("inf")),
    )


def _same(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.detach(), b.detach())
        assert a.requires_grad == b.requires_grad
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, rr.Args):
        _same(a.args, b.args)
        _same(a.kwargs, b.kwargs)
    else:
        assert a == b


def test_pack_unpack_round_trip_keeps_structure_values_and_flags() -> None:
    v = _value()
    buf, doc = pack_tree(v)
    assert buf.dtype == torch.uint8 and buf.numel() % 8 == 0
    json.loads(bytes(buf[:doc].tolist()))  # the structure is plain JSON, nothing pickled
    got = unpack_tree(buf, doc, CPU)
    _same(got, v)
    # leaves are aligned views of the one received buffer (no copy per leaf)
    assert all(t.untyped_storage().data_ptr() == buf.data_ptr() for t in tensor_leaves(got))


def test_header_of_a_tree_and_of_a_tensor_that_requires_grad() -> None:
    buf, doc = pack_tree((torch.zeros(2), None))
    h = encode_header(3, 1, rr.Task(1, "F", 0), buf, tree=doc)
    assert h[:2] == [MAGIC, 1] and h[7] == TREE and h[8:11] == [2, buf.numel(), doc]
    h = encode_header(0, 0, rr.Task(1, "F", 0), torch.zeros(2).requires_grad_())
    assert h[7] == REQUIRES_GRAD | 0 and len(h) == HEADER_LEN


@pytest.mark.parametrize(
    ("mutate", "why"),
    [
        (lambda d: d.replace(b'"T"', b'"Q"', 1), "unknown tag 'Q'"),
        (lambda d: d.replace(b"[2,3,4]", b"[2,3,400]", 1), "overruns the payload"),
        (lambda d: d.replace(b"[2,3,4]", b"[2,-3,4]", 1), "tensor shape"),
        (lambda d: b"{" + d[1:], "not valid JSON"),
        (lambda d: d.replace(b'["T",0', b'["T",99', 1), "dtype code 99"),
    ],
)
def test_corrupt_structures_are_protocol_errors(mutate: Any, why: str) -> None:
    buf, doc = pack_tree(_value())
    raw = bytes(buf.tolist())
    bad = mutate(raw[:doc])
    assert bad != raw[:doc]
    up = lambda n: (n + 7) // 8 * 8  # noqa: E731 - the wire's alignment
    body = bad.ljust(up(len(bad)), b"\0") + raw[up(doc) :]  # same leaves behind it
    t = torch.frombuffer(bytearray(body), dtype=torch.uint8)
    with pytest.raises(rr.errors.ProtocolError, match=why):
        unpack_tree(t, len(bad), CPU)


def test_trailing_bytes_and_deep_or_unsupported_values_are_refused() -> None:
    buf, doc = pack_tree([torch.zeros(2)])
    longer = torch.cat([buf, torch.zeros(8, dtype=torch.uint8)])
    with pytest.raises(rr.errors.ProtocolError, match="leaves end at byte"):
        unpack_tree(longer, doc, CPU)
    deep: Any = torch.zeros(1)
    for _ in range(MAX_DEPTH + 2):
        deep = [deep]
    with pytest.raises(rr.errors.ProtocolError, match="nested deeper"):
        pack_tree(deep)
    with pytest.raises(rr.errors.ProtocolError, match=r"boundary value\[1\]: .* got object"):
        pack_tree((torch.zeros(1), object()))
    with pytest.raises(rr.errors.ProtocolError, match="dict keys must be str or int"):
        pack_tree({(1, 2): torch.zeros(1)})


def test_device_packing_round_trips_as_views_of_one_buffer() -> None:
    v = _value()
    doc, flat = pack_tree_device(v, CPU)
    assert flat is not None and flat.dtype == torch.uint8 and flat.numel() % 8 == 0
    got = unpack_tree_device(doc, flat, CPU)
    _same(got, v)
    # Leaves are views of the one received buffer, each at a multiple of 8 bytes.
    for t in tensor_leaves(got):
        if t.numel():
            assert t.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
            assert (t.data_ptr() - flat.data_ptr()) % 8 == 0
    # The layout of pack_tree's leaf part: a staged copy (doc, padding, leaves) is a
    # pack_tree payload (the gloo-on-GPU staging path relies on it).
    buf, n = pack_tree(v)
    up = (n + 7) // 8 * 8
    assert bytes(buf[:n].tolist()) == doc
    assert torch.equal(buf[up:], flat)
    # Leaves without bytes: no device buffer at all (the message goes over gloo alone).
    doc, flat = pack_tree_device((torch.zeros(0), {"k": 3}), CPU)
    assert flat is None
    _same(unpack_tree_device(doc, None, CPU), (torch.zeros(0), {"k": 3}))


def test_device_packing_reads_nothing_on_the_host(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """The NCCL path's packing uses torch ops only: with the NCCL-rules checker's host-read
    guards on, a leaf registered as a device payload is never read through ctypes, tolist,
    item or numpy while it is packed or unpacked (``pack_tree`` is, and is refused)."""
    import weakref

    from rrfp_async.testing import nccl_rules as rules

    monkeypatch.setenv(rules.RULES_ENV, str(tmp_path))
    monkeypatch.setattr(rules, "_registry", None)
    reg = rules._reg()
    try:
        v = _value()
        for i, t in enumerate(tensor_leaves(v)):
            if t.numel():
                base, size = rules._ptr(t)
                reg.nccl[base] = (weakref.ref(t), size, f"leaf {i}")
        doc, flat = pack_tree_device(v, CPU)
        assert flat is not None
        base, size = rules._ptr(flat)
        reg.nccl[base] = (weakref.ref(flat), size, "the packed leaves")
        _same(unpack_tree_device(doc, flat, CPU), v)
        assert reg.violations == []
        with pytest.raises(rules.NCCLRuleError, match=r"ctypes\.memmove"):
            pack_tree(v)  # the host path reads the leaves through ctypes
    finally:
        reg.close()


def test_corrupt_device_structures_are_protocol_errors() -> None:
    doc, flat = pack_tree_device([torch.zeros(2), torch.ones(3)], CPU)
    assert flat is not None
    with pytest.raises(rr.errors.ProtocolError, match="leaves end at byte"):
        unpack_tree_device(doc, torch.cat([flat, torch.zeros(8, dtype=torch.uint8)]), CPU)
    with pytest.raises(rr.errors.ProtocolError, match="overruns the payload"):
        unpack_tree_device(doc, flat[:8], CPU)
    with pytest.raises(rr.errors.ProtocolError, match="overruns the payload"):
        unpack_tree_device(doc, None, CPU)


def test_call_rule_and_map() -> None:
    seen: list[Any] = []

    def f(*a: Any, **k: Any) -> None:
        seen.append((len(a), sorted(k)))

    call_module(f, (1, 2), {"m": 0})
    call_module(f, rr.Args(1, x=2), {"m": 0, "x": 9})  # the value's own keyword wins
    call_module(f, [1, 2], {})
    call_module(f, {"a": 1}, {"m": 0})  # str keys: keywords
    call_module(f, {1: 1}, {})  # other keys: one argument
    call_module(f, rr.Args({"a": 1}), {})  # a dict as one argument
    assert seen == [(2, ["m"]), (1, ["m", "x"]), (1, []), (0, ["a", "m"]), (1, []), (1, [])]
    m = map_tensors(_value(), lambda t: t.detach() * 0)
    assert all(not t.requires_grad for t in tensor_leaves(m))


# ------------------------------------------------------------------ through the channel


class _Sink:
    def __init__(self, want: int) -> None:
        self.got: list[Any] = []
        self.errors: list[BaseException] = []
        self.want = want
        self.done = asyncio.Event()

    def deliver(self, step: int, task: rr.Task, payload: Any, src: int) -> None:
        self.got.append(payload)
        if len(self.got) >= self.want:
            self.done.set()

    def fail(self, exc: BaseException) -> None:
        self.errors.append(exc)
        self.done.set()


async def _trees(rank: int) -> Any:
    ch = P2PChannel(
        rank,
        global_ranks={0: 0, 1: 1},
        inbound=[0] if rank else [],
        outbound=[1] if rank == 0 else [],
        inline_bytes=256,  # the large tree goes as header + payload, then grows the edge
    )
    sink = _Sink(4)
    ch.bind(sink)
    async with ch:
        if rank == 0:
            torch.manual_seed(0)
            ch.send(1, 0, rr.Task(1, "F", 0), _value())
            ch.send(1, 0, rr.Task(1, "F", 1), (torch.randn(64, 64), {"m": torch.ones(3)}))
            ch.send(1, 0, rr.Task(1, "F", 2), torch.randn(3).requires_grad_())
            ch.send(1, 0, rr.Task(1, "F", 3), torch.randn(3))
            return None
        await asyncio.wait_for(sink.done.wait(), 60)
        assert not sink.errors, sink.errors
        # own copies (the leaves are views of one buffer, which torch.save refuses)
        return [
            map_tensors(g, lambda t: t.detach().clone().requires_grad_(t.requires_grad))
            for g in sink.got
        ]


def _tree_worker(rank: int, world: int) -> Any:
    return rr.run(_trees(rank))


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.usefixtures("p2p_io")
def test_trees_and_requires_grad_flags_cross_processes() -> None:
    got = pooled_spawn(_tree_worker, 2, timeout=100)[1]
    torch.manual_seed(0)
    want = [
        _value(),
        (torch.randn(64, 64), {"m": torch.ones(3)}),
        torch.randn(3).requires_grad_(),
        torch.randn(3),
    ]
    for g, w in zip(got, want, strict=True):
        _same(g, w)


def test_pack_tree_zeroes_its_alignment_padding() -> None:
    """A payload's bytes are a function of its value: the padding between the structure and
    the leaves, and between leaves, is zero whatever the allocator left there (it was not:
    two packings of one value differed, and stale process memory went on the wire)."""
    v = (
        torch.ones(3, dtype=torch.uint8),
        torch.ones(5, dtype=torch.float16),
        torch.ones(1, dtype=torch.uint8),
    )
    size = pack_tree(v)[0].numel()
    for _ in range(20):
        junk = torch.full((size,), 0xAB, dtype=torch.uint8)  # a freed block of junk to reuse
        del junk
        buf, n = pack_tree(v)
        off = (n + 7) // 8 * 8  # the leaves start 8-aligned after the structure
        pad = buf[n:off].tolist()
        for t in v:  # each leaf padded up to the next multiple of 8 bytes
            end = off + t.numel() * t.element_size()
            off = (end + 7) // 8 * 8
            pad += buf[end:off].tolist()
        assert buf.numel() == off and not any(pad), pad
