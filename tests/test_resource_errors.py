"""Threads, descriptors and ports that cannot be had are ``ResourceError``s naming the
resource, the count in use and the fix (issue 41, deliverable 4); the multi-process cases are
in ``tests/distributed/test_resource_limits.py``."""

from __future__ import annotations

import errno
import pickle
import socket
import threading
from typing import Any

import pytest

import rrfp_async.errors as errors
from rrfp_async._bridges import ComputeWorker
from rrfp_async.distributed import _sync_face
from rrfp_async.testing import free_port

pytestmark = pytest.mark.timeout(60)


def _no_threads(monkeypatch: pytest.MonkeyPatch, prefix: str) -> None:
    start = threading.Thread.start

    def refuse(self: threading.Thread) -> None:
        if self.name.startswith(prefix):
            raise RuntimeError("can't start new thread")
        start(self)

    monkeypatch.setattr(threading.Thread, "start", refuse)


async def test_a_compute_thread_that_cannot_start_is_a_resource_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    worker = ComputeWorker(name="rrfp-compute-test")
    _no_threads(monkeypatch, "rrfp-compute-test")
    with pytest.raises(errors.ResourceError) as info:
        await worker.run(lambda: 1)
    e = info.value
    assert e.resource == "threads" and isinstance(e.__cause__, RuntimeError)
    assert "ComputeWorker 'rrfp-compute-test" in str(e) and "Python threads" in str(e)
    assert "ulimit" in str(e)
    worker.close()


def test_the_sync_face_without_a_thread_or_descriptor_is_a_resource_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def aenter() -> None:
        raise AssertionError("not reached")

    for exc, resource in (
        (RuntimeError("can't start new thread"), "threads"),
        (OSError(errno.EMFILE, "Too many open files"), "file descriptors"),
    ):

        def portal(exc: BaseException = exc) -> Any:
            raise exc

        monkeypatch.setattr(_sync_face, "SyncPortal", portal)
        with pytest.raises(errors.ResourceError) as info:
            _sync_face.BlockingFace.open(aenter, "rank 1 (global 1)")
        assert info.value.resource == resource
        assert str(info.value).startswith("rank 1 (global 1): "), info.value
        assert "event loop" in str(info.value)


@pytest.mark.parametrize(
    ("err", "resource", "words"),
    [
        (errno.EMFILE, "file descriptors", "RLIMIT_NOFILE"),
        (errno.EADDRINUSE, "ports", "ip_local_port_range"),
    ],
)
def test_free_port_without_a_socket_or_a_port_is_a_resource_error(
    monkeypatch: pytest.MonkeyPatch, err: int, resource: str, words: str
) -> None:
    def bind(self: socket.socket, addr: Any) -> None:
        raise OSError(err, "no")

    monkeypatch.setattr(socket.socket, "bind", bind)
    with pytest.raises(errors.ResourceError) as info:
        free_port()
    assert info.value.resource == resource and words in str(info.value), info.value


def test_a_resource_error_pickles_with_its_attributes() -> None:
    e = errors.ResourceError("x", resource="threads", rank=3, limit=10, in_use=9)
    f = pickle.loads(pickle.dumps(e))
    assert (str(f), f.resource, f.rank, f.limit, f.in_use) == ("x", "threads", 3, 10, 9)
    assert isinstance(f, OSError) and isinstance(f, errors.RRFPError)
