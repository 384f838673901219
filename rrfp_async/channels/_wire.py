"""The p2p channel's wire format: the int64 header of every message and its codes.

A message is a fixed-size int64 header, then its payload (inline behind the header, or as a
message of its own)::

    [magic, kind, seq, step, stage, task kind, microbatch, dtype, ndim, d0 .. d6, plan]

``plan`` is the sender's tag of the step's plan (``P2PChannel.at_step``; 0: none): a receiver
that runs the step under another tag fails it at once (see ``Inlet``), so a rank whose plan
differs from its neighbour's never waits for a message that will not come.

A CLOSE carries its cause instead: ``[magic, CLOSE, cause, step, n, global rank 0 .. n-1]``;
a clean one (``CLEAN``) carries the closing rank's last step and itself (``n`` 1), so a peer
that still needed it says "rank 3 left after step 1"; a rank that fails because a peer left
passes that on (``LEFT``, the step and the rank that left), as it passes on a lost rank,
and a rank whose policy did not return a decision before its step's watchdog fired says so
(``POLICY``, the step and itself).
A DATA_DEVICE header (the device path: see ``_p2p_device``) has a data header's fields; its
payload travels on the edge's payload communicator (NCCL), not behind it; for a pytree the
shape is ``(device bytes, structure bytes)`` and the structure (JSON, host bytes) is the
control message's inline part, or a message of its own when it does not fit the edge's
capacity (the same rule as an inline payload). The device bytes are the tensor leaves only,
each at a multiple of 8 bytes from 0 (``pack_tree_device``): the layout of ``pack_tree``'s
leaf part, so a staged copy (doc, padding, device bytes) is a ``pack_tree`` payload.
A WARMUP header (no fields) opens an edge's payload communicator.
An ABORT (a step failed on some rank: see ``P2PChannel``'s design note) is
``[magic, ABORT, failure kind, step, origin global rank, n, 0 ..]`` followed, when
``n > 0``, by a message of ``n`` bytes: the cause as UTF-8 text (at most ``MAX_ABORT_TEXT``
bytes). The failure kind (a ``FailureKind`` code, 0 to ``MAX_FAILURE_KIND``) is what a
receiver tests; the text is only ever for a message. It takes no sequence number of the edge
(its third field, a data header's sequence number, carries the kind): it may be posted from
another thread than the data.

The dtype field also carries ``REQUIRES_GRAD`` (a flag bit: the sender's tensor required
grad, so the consumer's copy does too). A payload that is not one tensor (a tuple, a dict,
``rr.Args``, nested: see ``rrfp_async._pytree``) travels as one uint8 payload with dtype code
``TREE`` and shape ``(total bytes, structure bytes)``: its JSON structure, then each tensor
leaf's bytes, each part starting at a multiple of 8 bytes (so every leaf is an aligned view
of the received buffer). Pure data and functions; nothing in this module touches torch.distributed.
"""

from __future__ import annotations

import ctypes
import math
import struct
from collections.abc import Sequence

import torch

from .._errors import ProtocolError
from .._tasks import Kind, Task

__all__ = [
    "DEFAULT_INLINE_BYTES",
    "DEFAULT_MAX_BYTES",
    "HEADER_BYTES",
    "HEADER_LEN",
    "MAGIC",
    "MAX_NDIM",
    "encode_header",
]


MAGIC = 0x52524650  # "RRFP"
HEADER_LEN = 17
HEADER_BYTES = HEADER_LEN * 8
MAX_NDIM = 7
PLAN_FIELD = HEADER_LEN - 1
"""Index of a data header's plan tag (the sender's ``at_step`` tag of the step; 0: none)."""
DATA, CLOSE, DATA_INLINE, ABORT = 1, 2, 3, 4
DATA_DEVICE = 5
"""Kind of a header whose payload travels on the edge's payload communicator (NCCL), not
on the control group: the header (and a pytree's structure, inline behind it) on gloo, the
payload's bytes on the device."""
WARMUP = 6
"""Kind of the header that opens an edge's payload communicator (see ``_p2p_device``)."""
MAX_FAILURE_KIND = 255
"""Largest failure kind code an ABORT header may carry (a larger one is a corrupt header)."""
MAX_ABORT_TEXT = 1024
"""Most bytes of cause text an ABORT carries (longer text is cut; a header announcing more
is refused)."""
DEFAULT_INLINE_BYTES = 1 << 16
"""Initial payload bytes an edge carries inline, behind the header (it grows as needed)."""
DEFAULT_MAX_BYTES = 256 << 20
"""Largest payload a header may announce, by default (a bad header never allocates more)."""
# The cause a CLOSE carries: [MAGIC, CLOSE, cause, step, n, global rank 0 .. n-1].
# POLICY: the rank named's policy did not return a decision before its step's watchdog fired.
CLEAN, FAILED, LOST, TIMED_OUT, LEFT, POLICY = 0, 1, 2, 3, 4, 5
CLOSE_CAUSES = (CLEAN, FAILED, LOST, TIMED_OUT, LEFT, POLICY)
MAX_BLAMED = HEADER_LEN - 5
KINDS: tuple[Kind, ...] = ("F", "B", "I", "W")
KIND_CODE = {k: i for i, k in enumerate(KINDS)}
DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
DTYPE_CODE = {d: i for i, d in enumerate(DTYPES)}
ITEMSIZE = {d: torch.empty((), dtype=d).element_size() for d in DTYPES}
NO_PAYLOAD = -1
TREE = 127
"""dtype code of a pytree payload (see the module docstring)."""
REQUIRES_GRAD = 1 << 8
"""Flag bit of the dtype field: the tensor required grad at the sender."""
_ALIGN = 8


def dtype_code(dtype: torch.dtype) -> int:
    """The wire code of ``dtype``.

    Raises:
        ProtocolError: A dtype the wire does not carry.
    """
    code = DTYPE_CODE.get(dtype)
    if code is None:
        raise ProtocolError(f"unsupported dtype {dtype} (the wire carries {list(DTYPES)})")
    return code


def encode_header(
    seq: int,
    step: int,
    task: Task,
    payload: torch.Tensor | None,
    *,
    inline: bool = False,
    tree: int | None = None,
    device: bool = False,
    plan: int = 0,
) -> list[int]:
    """The int64 header of a data message (pure; used by tests to forge bad ones).

    ``inline``: the payload follows in the same message (else as a message of its own).
    ``tree``: the payload is a packed pytree (``pack_tree``, or ``pack_tree_device``'s leaf
    bytes with ``device``) whose structure takes ``tree`` bytes. ``device``: the payload
    travels on the edge's payload communicator (kind ``DATA_DEVICE``). ``plan``: the
    sender's tag of the step's plan (0: none).
    """
    shape: tuple[int, ...]
    if payload is None:
        dtype, shape = NO_PAYLOAD, ()
    elif tree is not None:
        dtype, shape = TREE, (payload.numel(), tree)
    else:
        if payload.dtype not in DTYPE_CODE:
            raise ProtocolError(f"cannot send {task}: unsupported dtype {payload.dtype}")
        if payload.dim() > MAX_NDIM:
            raise ProtocolError(f"cannot send {task}: {payload.dim()} dims > {MAX_NDIM}")
        dtype, shape = DTYPE_CODE[payload.dtype], tuple(payload.shape)
        if payload.requires_grad:
            dtype |= REQUIRES_GRAD
    kind = DATA_DEVICE if device else DATA_INLINE if inline else DATA
    h = [MAGIC, kind, seq, step, task.stage, KIND_CODE[task.kind], task.mb, dtype, len(shape)]
    h += list(shape) + [0] * (MAX_NDIM - len(shape))
    h.append(plan)
    return h


def encode_abort(step: int, origin: int, cause: str, kind: int = 0) -> tuple[list[int], bytes]:
    """The header of an ABORT of ``step`` (failed first on global rank ``origin``, a failure
    of kind ``kind``: a ``FailureKind`` code) and the text that follows it (``cause``, cut to
    ``MAX_ABORT_TEXT`` bytes of UTF-8).

    Raises:
        ValueError: A ``kind`` outside 0 .. ``MAX_FAILURE_KIND``.
    """
    if not 0 <= kind <= MAX_FAILURE_KIND:
        raise ValueError(f"an ABORT's failure kind is 0 .. {MAX_FAILURE_KIND}, got {kind}")
    text = cause.encode("utf-8", "replace")[:MAX_ABORT_TEXT]
    h = [MAGIC, ABORT, int(kind), step, origin, len(text)] + [0] * (HEADER_LEN - 6)
    return h, text


def decode_abort(h: Sequence[int]) -> tuple[int, int, int, int]:
    """An ABORT header's ``(step, origin, text bytes, failure kind)`` (pure).

    Raises:
        ProtocolError: A corrupt header (a negative step or origin, a text length or a kind
            out of range).
    """
    kind, step, origin, n = h[2], h[3], h[4], h[5]
    if step < 0 or origin < 0 or not 0 <= n <= MAX_ABORT_TEXT or not 0 <= kind <= MAX_FAILURE_KIND:
        raise ProtocolError(
            f"corrupt ABORT header (failure kind, step, origin, text bytes); header {list(h)}"
        )
    return step, origin, n, kind


_HEADER = struct.Struct(f"={HEADER_LEN}q")


def write_ints(fmt: struct.Struct, buf: torch.Tensor, values: Sequence[int]) -> None:
    """Write ``values`` packed as ``fmt`` at the start of ``buf`` (a CPU tensor of at least
    ``fmt.size`` bytes): one ``memmove``, no torch call (it runs once per message)."""
    ctypes.memmove(buf.data_ptr(), fmt.pack(*values), fmt.size)


def read_ints(fmt: struct.Struct, buf: torch.Tensor) -> tuple[int, ...]:
    """The integers packed as ``fmt`` at the start of ``buf`` (a CPU tensor)."""
    return fmt.unpack(ctypes.string_at(buf.data_ptr(), fmt.size))


def write_header(buf: torch.Tensor, header: Sequence[int]) -> None:
    """Write a header at the start of ``buf`` (host memory of at least ``HEADER_BYTES``)."""
    write_ints(_HEADER, buf, header)


def up8(n: int) -> int:
    """``n`` rounded up to the wire's alignment (8 bytes)."""
    return _up(n)


def pack_inline(header: list[int], payload: torch.Tensor | None) -> torch.Tensor:
    """One uint8 message: the header, then ``payload`` (contiguous) right behind it.

    On the CPU the bytes are moved with ``memmove`` (the torch calls of the same copy cost
    several times as much per message).
    """
    nbytes = 0 if payload is None else payload.nbytes
    buf = torch.empty(HEADER_BYTES + nbytes, dtype=torch.uint8)
    write_ints(_HEADER, buf, header)
    if payload is not None and nbytes:
        if payload.device.type == "cpu" and payload.is_contiguous():
            ctypes.memmove(buf.data_ptr() + HEADER_BYTES, payload.data_ptr(), nbytes)
        else:
            buf[HEADER_BYTES:].view(payload.dtype).view(payload.shape).copy_(payload)
    return buf


def read_header(raw: torch.Tensor) -> list[int]:
    """The header at the start of a received message (uint8 on the CPU, else int64)."""
    if raw.device.type == "cpu" and raw.dtype == torch.uint8:
        return list(read_ints(_HEADER, raw))
    return raw[:HEADER_LEN].tolist()


def unpack_inline(
    raw: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], nbytes: int
) -> torch.Tensor:
    """A copy of the inline payload behind the header of ``raw`` (uint8, CPU)."""
    out = torch.empty(shape, dtype=dtype)
    if nbytes:
        ctypes.memmove(out.data_ptr(), raw.data_ptr() + HEADER_BYTES, nbytes)
    return out


def _up(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def pack_tree(tree: object) -> tuple[torch.Tensor, int]:
    """A pytree as one uint8 CPU payload and the length of its structure (see the module
    docstring). Tensor leaves are copied in (from any device).

    Raises:
        ProtocolError: A leaf or container the wire does not carry, or an unsupported dtype.
    """
    from .._pytree import encode_structure

    doc, leaves = encode_structure(tree, dtype_code)
    offsets = []
    off = _up(len(doc))
    for t in leaves:
        if t.dim() > 64:
            raise ProtocolError(f"a tensor leaf has {t.dim()} dims")
        offsets.append(off)
        off = _up(off + t.numel() * t.element_size())
    buf = torch.empty(off, dtype=torch.uint8)
    base = buf.data_ptr()
    ctypes.memmove(base, doc, len(doc))
    # The alignment padding is zeroed: a payload's bytes are a function of its value (not
    # of whatever the allocator left there), like the device path's zero parts.
    ends = [len(doc)] + [
        o + t.numel() * t.element_size() for t, o in zip(leaves, offsets, strict=True)
    ]
    for end, start in zip(ends, [*offsets, off], strict=True):
        if start > end:
            ctypes.memset(base + end, 0, start - end)
    for t, o in zip(leaves, offsets, strict=True):
        n = t.numel() * t.element_size()
        if not n:
            continue
        t = t.detach()
        if t.device.type == "cpu" and t.is_contiguous():
            ctypes.memmove(base + o, t.data_ptr(), n)
        else:
            buf[o : o + n].view(t.dtype).view(t.shape).copy_(t)
    return buf, len(doc)


def unpack_tree(
    raw: torch.Tensor, doc_len: int, device: torch.device, *, non_blocking: bool = False
) -> object:
    """The pytree packed in ``raw`` (uint8, CPU) by ``pack_tree``; tensor leaves are views of
    ``raw`` (moved to ``device`` if it is not the CPU, ``non_blocking`` from pinned memory:
    then the caller waits for the current stream before reusing ``raw``), ``requires_grad``
    as at the sender.

    Raises:
        ProtocolError: The structure is corrupt or its leaves do not fill ``raw`` exactly.
    """
    from .._pytree import decode_structure

    total = raw.numel()
    if not 0 <= doc_len <= total:
        raise ProtocolError(f"structure of {doc_len} bytes in a payload of {total}")
    doc = ctypes.string_at(raw.data_ptr(), doc_len)
    off = _up(doc_len)

    def make(code: int, shape: tuple[int, ...], rg: bool) -> torch.Tensor:
        nonlocal off
        if not 0 <= code < len(DTYPES) or len(shape) > 64:
            raise ProtocolError(f"corrupt structure: dtype code {code}, shape {shape}")
        dtype = DTYPES[code]
        n = math.prod(shape) * ITEMSIZE[dtype]
        if off + n > total:
            raise ProtocolError(
                f"corrupt structure: a {shape} {dtype} leaf at byte {off} overruns the"
                f" payload of {total} bytes"
            )
        t = raw[off : off + n].view(dtype).view(shape)
        off = _up(off + n)
        if device.type != "cpu":
            t = t.to(device, non_blocking=non_blocking)
        if rg and t.is_floating_point():
            t.requires_grad_(True)
        return t

    tree = decode_structure(doc, make)
    if off != total:
        raise ProtocolError(f"corrupt structure: its leaves end at byte {off}, payload {total}")
    return tree


def pack_tree_device(tree: object, device: torch.device) -> tuple[bytes, torch.Tensor | None]:
    """A pytree's structure (host bytes, for the control message) and its tensor leaves'
    bytes packed into one uint8 tensor on ``device`` with torch ops only (``cat`` of byte
    views, on the current stream): nothing of a device tensor is read by the host. Each
    leaf starts at a multiple of 8 bytes from 0. None when the leaves hold no bytes. A leaf
    on another device is copied to ``device`` first.

    Raises:
        ProtocolError: A leaf or container the wire does not carry.
    """
    from .._pytree import encode_structure

    doc, leaves = encode_structure(tree, dtype_code)
    parts: list[torch.Tensor] = []
    off = 0
    for t in leaves:
        if t.dim() > 64:
            raise ProtocolError(f"a tensor leaf has {t.dim()} dims")
        n = t.numel() * t.element_size()
        if not n:
            continue
        x = t.detach()
        if x.device != device:
            x = x.to(device)
        parts.append(x.contiguous().reshape(-1).view(torch.uint8))
        end = _up(off + n)
        if end > off + n:
            parts.append(torch.zeros(end - off - n, dtype=torch.uint8, device=device))
        off = end
    if not parts:
        return doc, None
    return doc, torch.cat(parts)


def unpack_tree_device(doc: bytes, flat: torch.Tensor | None, device: torch.device) -> object:
    """The pytree whose structure is ``doc`` and whose leaves' bytes are ``flat`` (as
    ``pack_tree_device`` made them): tensor leaves are views of ``flat`` (no copy, no host
    read), ``requires_grad`` as at the sender.

    Raises:
        ProtocolError: The structure is corrupt or its leaves do not fill ``flat`` exactly.
    """
    from .._pytree import decode_structure

    total = 0 if flat is None else flat.numel()
    off = 0

    def make(code: int, shape: tuple[int, ...], rg: bool) -> torch.Tensor:
        nonlocal off
        if not 0 <= code < len(DTYPES) or len(shape) > 64:
            raise ProtocolError(f"corrupt structure: dtype code {code}, shape {shape}")
        dtype = DTYPES[code]
        n = math.prod(shape) * ITEMSIZE[dtype]
        if not n:
            t = torch.empty(shape, dtype=dtype, device=device)
        elif flat is None or off + n > total:
            raise ProtocolError(
                f"corrupt structure: a {shape} {dtype} leaf at byte {off} overruns the"
                f" payload of {total} bytes"
            )
        else:
            t = flat[off : off + n].view(dtype).view(shape)
            off = _up(off + n)
        if rg and t.is_floating_point():
            t.requires_grad_(True)
        return t

    tree = decode_structure(doc, make)
    if off != total:
        raise ProtocolError(f"corrupt structure: its leaves end at byte {off}, payload {total}")
    return tree


CONNECTION_BROKE = "the connection broke: the process died or was killed"
"""The cause every lost-peer message gives (a failed send or decision, a peer's CLOSE)."""


def blame_text(cause: int, ranks: str) -> str:
    """Why a peer failed, from the cause its CLOSE carries."""
    if cause == LOST:
        return f"it lost {ranks} ({CONNECTION_BROKE})"
    if cause == TIMED_OUT:
        return f"it timed out waiting for {ranks} (hung, stopped, lost or waiting itself)"
    if cause == LEFT:
        return f"{ranks} left (its stage closed cleanly)"
    if cause == POLICY:
        return f"the policy of {ranks} did not return a decision (its step's watchdog fired)"
    return f"{ranks} failed with an error of its own (see that rank's output)"


def origin_text(cause: int, step: int, ranks: str, via: str) -> str:
    """The failure a peer's CLOSE passed on, origin first: what happened to ``ranks`` at
    ``step``, as the peer ``via`` that closed its channel because of it told."""
    if cause == LOST:
        return (
            f"{ranks} was lost at step {step} ({via} lost it: {CONNECTION_BROKE}; {via} then"
            " closed its channel)"
        )
    if cause == LEFT:
        return (
            f"{ranks} left after step {step} (its stage closed cleanly; {via} then closed its"
            " channel)"
        )
    if cause == POLICY:
        return (
            f"the policy of {ranks} did not return a decision at step {step} (its step's"
            f" watchdog fired there; {via} then closed its channel)"
        )
    if cause == TIMED_OUT:
        return (
            f"{via} failed at step {step}: it timed out waiting for {ranks} (hung, stopped,"
            " lost or waiting itself)"
        )
    return (
        f"{ranks} failed at step {step} with an error of its own (see that rank's output;"
        f" {via} then closed its channel)"
    )


def size_text(n: int) -> str:
    """``n`` bytes, readable: ``256 MiB``."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.3g} {unit}"
    return f"{n} B"


def grow(cap: int, nbytes: int, limit: int) -> int:
    """The edge capacity after a payload of ``nbytes`` did not fit inline (both sides)."""
    need = HEADER_BYTES + nbytes
    return min(max(cap, need + need // 4), HEADER_BYTES + limit)
