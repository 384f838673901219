"""NCCL's rules, checked on a CPU: a test double over gloo, not a transport.

Design note
-----------
No GPU is needed to see whether a transport would deadlock or race under NCCL: NCCL's rules
are about order, threads and memory, and gloo can carry the bytes while a wrapper checks the
rules. ``CheckedGroup`` wraps a gloo process group and presents it to ``torch.distributed``
as an NCCL one (``dist.get_backend`` says ``"nccl"``, ``dist.get_group_rank`` works); a
transport uses it as it would use NCCL, and every rule it breaks raises ``NCCLRuleError``
at the call that breaks it (and is logged). What it models, from NCCL's and torch's
documented semantics:

* **One issuing thread per communicator**; and no two threads issue NCCL operations at once
  in one process, not even on different communicators of one device (NCCL's thread-safety
  rules). Each issue is a short window the checker watches.
* **Same order on both ends.** Each (communicator, rank pair) is one stream: its operations
  execute in issue order, a send matches the peer's receive of the same position, with the
  same byte count (NCCL matches no tags and no sizes). A model device thread per pair runs
  the operations in that order on the gloo group underneath, so a design whose two ends
  disagree stalls in the checker as it would on a GPU (a stall of ``RRFP_NCCL_RULES_STALL`` seconds
  is logged as one), and ``check_logs`` compares the two ends' logs position by position:
  two ranks that both post a receive first (each keeps a header receive posted while
  sending) is the deadlock it names.
* **Deferred completion.** ``Work.wait()`` does not wait: it orders the *current stream*
  after the operation and returns (torch's ``ProcessGroupNCCL``). The model runs each
  operation a little later (``RRFP_NCCL_RULES_LAG`` seconds, a millisecond by default) on
  its device thread; a receive buffer holds poison (all bits set: NaN, -1) until then; the
  completion reaches whoever waits on an event recorded after ``wait()`` on a host stream
  (``rrfp_async._streams``). So a tensor read before the event of its receive reads poison,
  and a ``wait()`` with no stream current (the default stream: NCCL would stall everything
  ordered after it there) is an error. A send reads its tensor when it runs: a tensor freed
  before (not kept alive until its send completed) is an error, a reused buffer sends what
  it holds then.
* **A receive is posted only after its header said it comes** (a receive kept posted on an
  NCCL communicator blocks the stream behind it): ``observe`` wraps the gloo control group,
  reads the headers that go by, and counts those announcing a device payload (kind
  ``DATA_DEVICE``, and the ``WARMUP`` that opens an edge) per edge; a receive on a checked
  group beyond that count is an error; a ``DATA_DEVICE`` header sent before its payload's
  send was issued is one too (the receiver would post a receive whose send may never be
  enqueued).
* **Communicators are created at their first operation**, which blocks the issuing thread
  until the peer's first operation on it (NCCL's lazy ``ncclCommInitRank`` of a p2p
  communicator): modelled by a handshake on the gloo group underneath, so a transport whose
  ranks open their communicators in orders that do not match stalls (and is logged).
* **Device memory only.** A tensor on a checked group must be on the communicator's device,
  contiguous, not pinned host memory, and not a buffer the host packed
  (``_wire.pack_inline``/``pack_tree``: NCCL needs device memory, and packing a device tensor
  on the host reads it); a payload sent or received over NCCL is never read by the host
  inside the transport (``tolist``, ``item``, ``numpy``, ``ctypes`` on its storage).

The switch: ``RRFP_NCCL_RULES`` (``1`` or a directory for the logs) makes ``build_groups``
build the pipelines' payload communicators as checked gloo groups, in every rank it spawns
(the variable is inherited). ``check_logs(directory)`` returns every problem found: the
violations the ranks logged and the pairs whose two ends disagree.

This module is the test double (the registry, the host-read guards, ``CheckedGroup``);
``_nccl_logs`` watches the gloo control group (``ObservedGroup``) and reads the logs
(``check_logs``).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import queue
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .._bridges import after_fork_in_child
from .._streams import Pending, current_host_stream

__all__ = [
    "RULES_ENV",
    "CheckedGroup",
    "NCCLRuleError",
    "enabled",
    "log_dir",
]

RULES_ENV = "RRFP_NCCL_RULES"
"""Environment variable: ``1`` (logs under the temp directory) or a directory for the logs
switches the checker on in ``build_groups`` (spawned ranks inherit it)."""
LAG_ENV = "RRFP_NCCL_RULES_LAG"
"""Seconds the model device lets pass before it runs an operation (default 0.001)."""
REPORT_ENV = "RRFP_NCCL_RULES_REPORT"
"""``1``: log each violation and go on (to list every rule a design breaks) instead of
raising at the first."""
_INIT_TAG = 0x1717
"""gloo tag of the handshake that models a communicator's creation (``CheckedGroup._open``)."""
STALL_ENV = "RRFP_NCCL_RULES_STALL"
"""Seconds after which an operation still running is logged as a stall (default 10)."""


_ORIG_TOLIST = torch.Tensor.tolist
"""``Tensor.tolist`` before the guards wrap it (the checker's own reads of headers)."""


class NCCLRuleError(RuntimeError):
    """A rule of NCCL that a transport broke (see the module's design note)."""


def enabled() -> bool:
    """Whether ``RRFP_NCCL_RULES`` switches the checker on."""
    return os.environ.get(RULES_ENV, "") not in ("", "0")


def log_dir() -> Path:
    """Where this process logs (``RRFP_NCCL_RULES`` when it names a directory)."""
    v = os.environ.get(RULES_ENV, "")
    if v in ("", "0", "1"):
        return Path(tempfile.gettempdir()) / "rrfp-nccl-rules"
    return Path(v)


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


def _ptr(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return int(s.data_ptr()), int(s.nbytes())


class _Registry:
    """What one process knows: the log, the tensors on checked groups, the headers seen."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # a violation is logged with it held
        self.issuing: tuple[str, str] | None = None  # (thread, communicator) in an issue
        self.made: dict[tuple[int, ...], int] = {}  # checked groups made per rank set
        # storage address -> (tensor, what): payloads on checked groups, host-packed buffers
        self.nccl: dict[int, tuple[weakref.ref[torch.Tensor], int, str]] = {}
        self.host: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}
        self.announced: dict[tuple[int, int], int] = {}  # (src, dst) global: headers received
        self.posted: dict[tuple[int, int], int] = {}  # receives posted on checked groups
        self.issued: dict[tuple[int, int], int] = {}  # sends issued on checked groups
        self.headers_sent: dict[tuple[int, int], int] = {}
        self.running: dict[int, tuple[float, str]] = {}  # id(pair model) -> (since, what)
        self.stalled: set[str] = set()
        self.violations: list[str] = []
        self.report = os.environ.get(REPORT_ENV, "") == "1"
        self.job = (
            f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}:"
            f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}"
        )
        # The test that started this rank (pytest sets it; a child inherits it): named in
        # violations, so that a stall in a tier of many tests says where it happened.
        self.test = os.environ.get("PYTEST_CURRENT_TEST", "").removesuffix(" (call)")
        self._file: Any = None
        self._dir = log_dir()  # fixed when made: a later registry (a test's) logs elsewhere
        self._closed = False
        self._watchdog: threading.Thread | None = None

    def log(self, record: dict[str, Any]) -> None:
        line = json.dumps({"job": self.job, "pid": os.getpid(), **record})
        with self.lock:
            if self._closed:  # a model device of a registry that was replaced: dropped
                return
            if self._file is None:
                d = self._dir
                d.mkdir(parents=True, exist_ok=True)
                self._file = open(d / f"ops-{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115
            self._file.write(line + "\n")

    def close(self) -> None:
        """Close the log (a test that starts a fresh registry closes the old one)."""
        with self.lock:
            self._closed = True
            if self._file is not None:
                self._file.close()
                self._file = None

    def violate(self, text: str) -> NCCLRuleError:
        """Log a violation; the error to raise."""
        self.violations.append(text)
        self.log({"kind": "violation", "text": text, "test": self.test})
        return NCCLRuleError(f"NCCL rule broken: {text}")

    def refuse(self, text: str) -> None:
        """Log a violation and raise it (unless ``RRFP_NCCL_RULES_REPORT=1``)."""
        err = self.violate(text)
        if not self.report:
            raise err

    def tensor_of(self, addr: int, n: int = 1) -> str | None:
        """What the checked payload whose storage holds ``[addr, addr + n)`` is, if any."""
        with self.lock:
            for base, (ref, size, what) in list(self.nccl.items()):
                if ref() is None:
                    del self.nccl[base]
                elif base <= addr < base + max(size, 1) or addr <= base < addr + n:
                    return what
        return None

    def host_made(self, t: torch.Tensor) -> str | None:
        base, _ = _ptr(t)
        with self.lock:
            got = self.host.get(base)
            if got is None:
                return None
            if got[0]() is None:
                del self.host[base]
                return None
            return got[1]

    def start_watchdog(self) -> None:
        if self._watchdog is not None:
            return
        self._watchdog = threading.Thread(target=self._watch, name="rrfp-nccl-rules-watch")
        self._watchdog.daemon = True
        self._watchdog.start()

    def _watch(self) -> None:
        limit = _env_float(STALL_ENV, 10.0)
        nap = min(1.0, limit / 4)
        woke = time.monotonic()
        while True:
            time.sleep(nap)
            if not threading.main_thread().is_alive():
                # The program is exiting: its exit hooks wait for closing channels' threads
                # (``channels._strays``), and what is still pending then is no disagreement.
                return
            now = time.monotonic()
            # The process did not run for a while (SIGSTOP, a suspended machine): that time
            # is no peer's delay, so what was running waits as long again from now on.
            lost = now - woke - nap
            woke = now
            with self.lock:
                if lost > max(1.0, nap):
                    self.running = {k: (s + lost, w) for k, (s, w) in self.running.items()}
                    continue
                late = [w for since, w in self.running.values() if now - since > limit]
            for what in late:
                if what not in self.stalled:
                    self.stalled.add(what)
                    self.log(
                        {
                            "kind": "violation",
                            "text": f"stalled for {limit:g} s: {what} (under NCCL the stream"
                            " would hang here: the two ends disagree on the order)",
                            "test": self.test,
                        }
                    )


_registry: _Registry | None = None
_registry_lock = threading.Lock()


def _reg() -> _Registry:
    global _registry
    with _registry_lock:
        if _registry is None:
            _registry = _Registry()
            _install_guards()
        return _registry


def _forget() -> None:
    global _registry
    _registry = None


after_fork_in_child(_forget)


# ----------------------------------------------------------------------- host-read guards

_GUARDED = False


def _caller_is_transport(depth: int = 2) -> bool:
    name = str(sys._getframe(depth).f_globals.get("__name__", ""))
    return name.startswith("rrfp_async.channels") and name != __name__


def _install_guards() -> None:
    """Once per process: host reads of checked payloads, and buffers the host packed (the
    guards look the registry up at each call: a test may start a fresh one)."""
    global _GUARDED
    if _GUARDED:
        return
    _GUARDED = True

    def guard_tensor(name: str) -> None:
        orig = getattr(torch.Tensor, name)

        def guarded(self: torch.Tensor, *a: Any, **k: Any) -> Any:
            reg = _registry
            if reg is not None and self.device.type != "meta" and _caller_is_transport():
                base, n = _ptr(self)
                what = reg.tensor_of(base, n)
                if what is not None:
                    reg.refuse(
                        f"the transport reads {what} on the host (Tensor.{name}): a device"
                        " payload under NCCL; read it on the device, or not at all"
                    )
            return orig(self, *a, **k)

        guarded.__name__ = name
        setattr(torch.Tensor, name, guarded)

    for name in ("tolist", "item", "numpy"):
        guard_tensor(name)

    def guard_ctypes(name: str, reads: Callable[[tuple[Any, ...]], list[tuple[int, int]]]) -> None:
        orig = getattr(ctypes, name)

        def guarded(*a: Any) -> Any:
            reg = _registry
            if reg is None:
                return orig(*a)
            for addr, n in reads(a):
                what = reg.tensor_of(int(addr), int(n)) if isinstance(addr, int) else None
                if what is not None:
                    reg.refuse(
                        f"the host touches {what} through ctypes.{name}: a device payload"
                        " under NCCL (a host read of device memory)"
                    )
            return orig(*a)

        setattr(ctypes, name, guarded)

    guard_ctypes("memmove", lambda a: [(a[0], a[2]), (a[1], a[2])] if len(a) == 3 else [])
    guard_ctypes("string_at", lambda a: [(a[0], a[1] if len(a) > 1 else 1)])

    # Buffers packed by the host: wrap the packing helpers wherever the transport imported them.
    from ..channels import wire as _wire

    for fname in ("pack_inline", "pack_tree"):
        orig = getattr(_wire, fname)

        def tagged(*a: Any, _orig: Any = orig, _name: str = fname, **k: Any) -> Any:
            out = _orig(*a, **k)
            reg = _registry
            if reg is None:
                return out
            t = out[0] if isinstance(out, tuple) else out
            base, _ = _ptr(t)
            with reg.lock:
                reg.host[base] = (weakref.ref(t), f"a buffer packed on the host by {_name}")
            return out

        for mod in list(sys.modules.values()):
            modname = getattr(mod, "__name__", "") or ""
            if modname.startswith("rrfp_async.channels") and getattr(mod, fname, None) is orig:
                setattr(mod, fname, tagged)


# ----------------------------------------------------------------------- checked groups


def _global_ranks(group: Any) -> dict[int, int]:
    """Group rank -> global rank of a real process group."""
    ranks = dist.distributed_c10d._world.pg_group_ranks.get(group)
    if ranks is None:  # the default group
        return {r: r for r in range(group.size())}
    return {g_rank: g for g, g_rank in ranks.items()}


def _register(wrapper: Any, inner: Any, backend: str) -> None:
    """Let ``torch.distributed`` take ``wrapper`` for a group (backend, rank lookups)."""
    w = dist.distributed_c10d._world
    got = w.pg_map.get(inner)
    store = got[1] if got is not None else None
    w.pg_map[wrapper] = (backend, store)  # type: ignore[assignment]
    ranks = w.pg_group_ranks.get(inner)
    w.pg_group_ranks[wrapper] = dict(ranks) if ranks is not None else {}


class _Pair:
    """The model device of one (communicator, rank pair): its operations run in order."""

    def __init__(self, group: CheckedGroup, peer: int) -> None:
        self.group = group
        self.peer = peer
        self.queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.issuer: threading.Thread | None = None
        self.count = 0
        self.broken: BaseException | None = None
        self.thread = threading.Thread(
            target=self._run, name=f"rrfp-nccl-model-{group.comm}-{peer}", daemon=True
        )
        self.thread.start()

    def _run(self) -> None:
        reg, lag = self.group.reg, self.group.lag
        while True:
            item = self.queue.get()
            if item is None:
                return
            op, ref, shape, dtype, tag, deps, pending, what = item
            if self.broken is not None:
                pending.set(self.broken)
                continue
            time.sleep(lag)
            with reg.lock:
                reg.running[id(self)] = (time.monotonic(), what)
            try:
                for d in deps:
                    d.wait()
                    if d.error is not None:
                        raise d.error
                inner = self.group.inner
                if op == "send":
                    t = ref()
                    if t is None:
                        raise reg.violate(
                            f"{what}: its tensor was freed before the operation ran on the"
                            " stream (keep it alive, or record_stream it, until its work"
                            " completes)"
                        )
                    buf = t.detach().clone()  # what the tensor holds *now*, when the send runs
                    del t
                    inner.send([buf], self.peer, tag).wait()
                else:
                    buf = torch.empty(shape, dtype=dtype)
                    inner.recv([buf], self.peer, tag).wait()
                    with torch.no_grad():
                        ref.copy_(buf)
                del item, ref
                pending.set()
            except BaseException as e:
                self.broken = e
                pending.set(e)
            finally:
                with reg.lock:
                    reg.running.pop(id(self), None)


class _DeferredWork:
    """What an operation on a checked group returns: ``wait()`` orders the current stream."""

    def __init__(self, reg: _Registry, pending: Pending, what: str) -> None:
        self._reg = reg
        self._pending = pending
        self._what = what

    def wait(self, timeout: Any = None) -> bool:
        s = current_host_stream()
        if s is None:
            self._reg.refuse(
                f"Work.wait() of {self._what} with no comm stream current: under NCCL it makes"
                " this thread's current stream (the default stream) wait for the operation,"
                " and everything later ordered on the default stream stalls until the peer's"
                " message; complete it on a stream of its own and record an event there"
            )
            return True  # (report mode) nothing host-side waits, as under NCCL
        s.add([self._pending])
        return True

    synchronize = wait

    def is_completed(self) -> bool:
        return self._pending.is_set()

    def is_success(self) -> bool:
        return self._pending.is_set() and self._pending.error is None

    def exception(self) -> BaseException | None:
        return self._pending.error

    def get_future(self) -> Any:
        raise RuntimeError(
            "Work::getFuture not implemented (a checked NCCL p2p work: under NCCL its future"
            " completes at enqueue and bounds nothing)"
        )

    def source_rank(self) -> int:
        raise self._reg.violate(f"source_rank() of {self._what}: NCCL has no receive from any")


class CheckedGroup:
    """A gloo process group that stands in for an NCCL one and checks NCCL's rules.

    Args:
        inner: The gloo group that carries the bytes (its ranks are the communicator's).
        device: The device the communicator is bound to (its tensors must be there).
        register: Register it with ``torch.distributed`` as an NCCL group (so that
            ``dist.get_backend`` and ``dist.get_group_rank`` take it); False for tests that
            run without an initialized default group.
        ranks: Group rank -> global rank (default: read from ``torch.distributed``).
        model_init: Model NCCL's lazy communicator creation: the first operation on a pair
            blocks its issuing thread until the peer's first operation on it (False for
            single-threaded unit tests that issue both ends from one thread).
    """

    def __init__(
        self,
        inner: Any,
        *,
        device: torch.device | str = "cpu",
        register: bool = True,
        ranks: dict[int, int] | None = None,
        model_init: bool = True,
    ) -> None:
        self.inner = inner
        self.model_init = model_init
        self.reg = _reg()
        self.device = torch.device(device)
        self.lag = _env_float(LAG_ENV, 0.001)
        self._global = dict(ranks) if ranks is not None else _global_ranks(inner)
        self.me = self._global[inner.rank()]
        key = tuple(sorted(self._global.values()))
        with self.reg.lock:
            k = self.reg.made.get(key, 0)
            self.reg.made[key] = k + 1
        self.comm = "-".join(map(str, key)) + f"#{k}"
        self._pairs: dict[int, _Pair] = {}
        self.aborted = False
        if register:
            _register(self, inner, "nccl")
        self.reg.start_watchdog()
        if model_init:
            # The model devices start with the group, not at its first operation, so that the
            # checker's own threads appear when the groups are built (a test counting the
            # threads a stage leaves behind sees none of them come and go).
            for r in range(self.size()):
                if r != self.rank():
                    self._pairs[r] = _Pair(self, r)

    def rank(self) -> int:
        """This process's rank in the group."""
        return int(self.inner.rank())

    def size(self) -> int:
        """The group's size."""
        return int(self.inner.size())

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> _DeferredWork:
        """An NCCL send, checked (see the module's design note)."""
        return self._issue("send", tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> _DeferredWork:
        """An NCCL receive, checked (see the module's design note)."""
        return self._issue("recv", tensors, src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Any:
        raise self.reg.violate(f"recv_anysource on communicator {self.comm}: NCCL has none")

    def abort(self) -> None:
        """Abort the communicator (NCCL: ``ncclCommAbort``; in the checker its model devices
        stop)."""
        self.aborted = True
        self.reg.log({"kind": "abort", "comm": self.comm, "rank": self.me})
        err = RuntimeError(f"communicator {self.comm} aborted")
        for p in self._pairs.values():
            p.broken = err
            p.queue.put(None)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _check_tensor(self, t: torch.Tensor, what: str) -> None:
        reg = self.reg
        if t.device != self.device:
            reg.refuse(
                f"{what}: a tensor on {t.device} on a communicator bound to {self.device} (NCCL"
                " carries device memory only: a CPU-staged payload)"
            )
        if not t.is_contiguous():
            reg.refuse(f"{what}: a non-contiguous tensor")
        with contextlib.suppress(RuntimeError):
            if t.device.type == "cpu" and t.is_pinned():
                reg.refuse(f"{what}: pinned host memory (a staging buffer) on NCCL")
        made = reg.host_made(t)
        if made is not None:
            reg.refuse(
                f"{what}: {made} (NCCL needs device memory, and packing a device payload on the"
                " host reads it there; pack it on the device)"
            )

    def _open(self, pair: _Pair, what: str) -> None:
        """The communicator's creation at its first operation on ``pair``: NCCL creates a
        p2p communicator lazily, and ``ncclCommInitRank`` blocks until the peer joins, i.e.
        until the peer issues its own first operation on it. Modelled by a handshake on the
        gloo group underneath (both ends post a send and a receive, then wait), so a
        transport that opens its communicators in an order the peers do not share stalls
        here (logged as a stall) as it would hang under NCCL."""
        reg = self.reg
        key = -id(pair)
        with reg.lock:
            reg.running[key] = (
                time.monotonic(),
                f"creating communicator {self.comm} at {what}: it waits for the peer's first"
                " operation on the communicator (NCCL's lazy init)",
            )
        try:
            mine, theirs = torch.zeros(1), torch.zeros(1)
            ws = self.inner.send([mine], pair.peer, _INIT_TAG)
            wr = self.inner.recv([theirs], pair.peer, _INIT_TAG)
            wr.wait()
            ws.wait()
        finally:
            with reg.lock:
                reg.running.pop(key, None)

    def _issue(self, op: str, tensors: list[torch.Tensor], peer: int, tag: int) -> _DeferredWork:
        reg = self.reg
        me = threading.current_thread()
        peer_g = self._global.get(peer, -1)
        if len(tensors) != 1:
            reg.refuse(f"{op} of {len(tensors)} tensors on {self.comm} (NCCL p2p: one)")
        t = tensors[0]
        with reg.lock:
            pair = self._pairs.get(peer)
            if pair is None:
                pair = self._pairs[peer] = _Pair(self, peer)
        what = (
            f"{op} #{pair.count} on communicator {self.comm} (global rank {self.me}"
            f" {'->' if op == 'send' else '<-'} {peer_g}, {t.nbytes} bytes)"
        )
        with reg.lock:
            if pair.issuer is None:
                pair.issuer = me
            elif pair.issuer is not me:
                reg.refuse(
                    f"{what} issued by thread {me.name!r}, but thread {pair.issuer.name!r}"
                    " issues on this communicator (NCCL: one issuing thread per communicator)"
                )
            if reg.issuing is not None:
                reg.refuse(
                    f"{what} issued by thread {me.name!r} while thread {reg.issuing[0]!r} issues"
                    f" on communicator {reg.issuing[1]} (NCCL: no two threads issue at once,"
                    " not even on different communicators of one device)"
                )
            reg.issuing = (me.name, self.comm)
        try:
            time.sleep(self.lag / 4)  # widen the window so that concurrent issues meet
            if self.aborted:
                raise RuntimeError(f"communicator {self.comm} was aborted")
            self._check_tensor(t, what)
            edge = (self.me, peer_g) if op == "send" else (peer_g, self.me)
            with reg.lock:
                if op == "recv":
                    n = reg.posted[edge] = reg.posted.get(edge, 0) + 1
                    announced = reg.announced.get(edge, 0)
                else:
                    reg.issued[edge] = reg.issued.get(edge, 0) + 1
            if op == "recv" and n > announced:
                reg.refuse(
                    f"{what} posted before a header announced its payload ({announced}"
                    f" announced on edge global {edge[0]} -> {edge[1]}, this is receive {n}):"
                    " a receive kept posted on an NCCL communicator blocks its stream; post the"
                    " payload's receive once its header (on the gloo control group) has come"
                )
            reg.log(
                {
                    "kind": "op",
                    "comm": self.comm,
                    "rank": self.me,
                    "peer": peer_g,
                    "op": op,
                    "n": pair.count,
                    "nbytes": t.nbytes,
                    "thread": me.name,
                }
            )
            if pair.count == 0 and self.model_init:
                self._open(pair, what)
            pair.count += 1
            deps = s.snapshot() if (s := current_host_stream()) is not None else []
            pending = Pending(what)
            if op == "recv":
                with torch.no_grad():
                    t.view(torch.uint8).view(-1).fill_(0xFF)  # poison until the data lands
            base, size = _ptr(t)
            with reg.lock:
                reg.nccl[base] = (weakref.ref(t), size, f"the payload of {what}")
            # A send's tensor is the transport's to keep alive until the send ran (NCCL reads
            # it then); a receive's buffer is held by its work, as ProcessGroupNCCL's work
            # holds it (the transport may keep only views of it: an unpacked pytree).
            held: Any = weakref.ref(t) if op == "send" else t
            pair.queue.put((op, held, t.shape, t.dtype, tag, deps, pending, what))
        finally:
            with reg.lock:
                reg.issuing = None
        return _DeferredWork(reg, pending, what)
