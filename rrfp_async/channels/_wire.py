"""The p2p channel's wire format: the int64 header of every message and its codes.

A message is a fixed-size int64 header, then its payload (inline behind the header, or as a
message of its own)::

    [magic, kind, seq, step, stage, task kind, microbatch, dtype, ndim, d0 .. d6]

A CLOSE carries its cause instead: ``[magic, CLOSE, cause, step, n, global rank 0 .. n-1]``.
Pure data and functions; nothing here touches torch.distributed.
"""

from __future__ import annotations

import ctypes
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
HEADER_LEN = 16
HEADER_BYTES = HEADER_LEN * 8
MAX_NDIM = HEADER_LEN - 9
DATA, CLOSE, DATA_INLINE = 1, 2, 3
DEFAULT_INLINE_BYTES = 1 << 16
"""Initial payload bytes an edge carries inline, behind the header (it grows as needed)."""
DEFAULT_MAX_BYTES = 256 << 20
"""Largest payload a header may announce, by default (a bad header never allocates more)."""
# The cause a CLOSE carries: [MAGIC, CLOSE, cause, step, n, global rank 0 .. n-1].
CLEAN, FAILED, LOST, TIMED_OUT = 0, 1, 2, 3
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


def encode_header(
    seq: int, step: int, task: Task, payload: torch.Tensor | None, *, inline: bool = False
) -> list[int]:
    """The int64 header of a data message (pure; used by tests to forge bad ones).

    ``inline``: the payload follows in the same message (else as a message of its own).
    """
    shape: tuple[int, ...]
    if payload is None:
        dtype, shape = NO_PAYLOAD, ()
    else:
        if payload.dtype not in DTYPE_CODE:
            raise ProtocolError(f"cannot send {task}: unsupported dtype {payload.dtype}")
        if payload.dim() > MAX_NDIM:
            raise ProtocolError(f"cannot send {task}: {payload.dim()} dims > {MAX_NDIM}")
        dtype, shape = DTYPE_CODE[payload.dtype], tuple(payload.shape)
    kind = DATA_INLINE if inline else DATA
    h = [MAGIC, kind, seq, step, task.stage, KIND_CODE[task.kind], task.mb, dtype, len(shape)]
    h += list(shape) + [0] * (MAX_NDIM - len(shape))
    return h


_HEADER = struct.Struct(f"={HEADER_LEN}q")


def write_ints(fmt: struct.Struct, buf: torch.Tensor, values: Sequence[int]) -> None:
    """Write ``values`` packed as ``fmt`` at the start of ``buf`` (a CPU tensor of at least
    ``fmt.size`` bytes): one ``memmove``, no torch call (a few µs less per message)."""
    ctypes.memmove(buf.data_ptr(), fmt.pack(*values), fmt.size)


def read_ints(fmt: struct.Struct, buf: torch.Tensor) -> tuple[int, ...]:
    """The integers packed as ``fmt`` at the start of ``buf`` (a CPU tensor)."""
    return fmt.unpack(ctypes.string_at(buf.data_ptr(), fmt.size))


def pack_inline(header: list[int], payload: torch.Tensor | None) -> torch.Tensor:
    """One uint8 message: the header, then ``payload`` (contiguous) right behind it.

    On the CPU the bytes are moved with ``memmove`` (a few µs; the torch calls of the same
    copy cost several times that per message).
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


def blame_text(cause: int, ranks: str) -> str:
    """Why a peer failed, from the cause its CLOSE carries."""
    if cause == LOST:
        return f"it lost {ranks} (the connection broke: the process died or was killed)"
    if cause == TIMED_OUT:
        return f"it timed out waiting for {ranks} (hung, stopped, lost or waiting itself)"
    return f"{ranks} failed with an error of its own (see that rank's output)"


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
