"""The activation meter: the bytes a forward task keeps alive until its backward.

What is counted (the bytes a pipeline must budget per in-flight microbatch):

* every tensor autograd saves for the backward during the forward (``saved`` mode: seen
  through ``torch.autograd.graph.saved_tensors_hooks``), and what the caller keeps until the
  backward itself: the stage's received input (``keep=``, the executor's stash holds it for
  its gradient whether or not an op saves it) and the stage's outputs (``hold``, stashed for
  the backward's seeds);
* each storage ONCE: a tensor saved twice, an output saved by the op that made it, a view
  saved beside its base all share one ``untyped_storage`` (keyed by device and data
  pointer), and the whole storage counts (a view keeps all of it alive);
* NOT the weights: storages of the module's parameters and buffers (``exclude=``, see
  ``weight_storages``) are resident whatever runs, so a ``weight.t()`` that ``linear`` saves
  counts nothing. A weight copy made in the forward (autocast's low-precision copy) has a
  storage of its own and counts: it lives until the backward;
* only what is still alive when the forward ends: a saved tensor whose graph the forward
  dropped (a discarded branch) was freed, so each saved tensor is held by a weak reference
  and read at the end, never summed as it goes.

The first stage's microbatch data counts where an op saves it (token ids for an embedding):
the caller holds the microbatch all step anyway, so this over-counts by what is saved of it,
usually small. Activation checkpointing (``torch.utils.checkpoint``, non-reentrant) installs
hooks of its own inside the checkpointed region, which take precedence: what it recomputes
is not counted (correct: it is not kept); the region's inputs, which it saves outside its
hooks, are (checked: a checkpointed ``exp(2 tanh(x))`` counts ``x`` only, 1/3 of the
uncheckpointed count).

Why hooks that are not the identity. ``pack = lambda t: t`` changes what autograd does in two
ways (checked on torch 2.13): an output saved by the op that made it then holds itself (a
reference cycle through its ``grad_fn`` that nothing frees, not even ``gc``), and torch skips
its version-counter check for a saved tensor that has hooks ("one of the variables needed for
gradient computation has been modified by an inplace operation" is never raised). So
``pack`` keeps what torch itself keeps: the tensor as it is when it is no output of the node
saving it (torch keeps the original variable then, and so its Python object stays alive as
long as the graph does), a detached alias when it is one (no ``grad_fn``, so no cycle; torch
keeps the tensor's data then too), with its version; ``unpack`` raises torch's error itself
when the version moved. An output is told by its ``grad_fn`` being the newest node of the
thread (``torch._C._autograd._get_sequence_nr``: a built-in op creates its node, saves its
inputs, runs, then saves its outputs, and creates no node in between); a custom
``autograd.Function``'s node, whose forward may create nodes after it, and every tensor when
that private function is missing, get the alias whatever they are (safe: the alias holds the
same storage). The backward reads the same values, so training results are bitwise those
without the meter.

``allocator`` mode (CUDA): ``torch.cuda.memory_allocated`` after the forward minus before,
plus the ``keep=`` inputs (allocated before it). It measures every block the forward
allocated and still holds at its end: the saved tensors and the outputs, rounded up to the
allocator's block sizes (512 bytes), and anything else the forward kept (a module's cache).
It sees the whole device: another thread allocating on it during the forward (a second
stage's compute thread on the same GPU, a receive's buffer) adds its blocks, and one freeing
blocks subtracts them. Two host-side reads, no device sync, no per-tensor Python call.
Weights are not in the delta (allocated before); ``exclude`` and ``hold`` are not needed.

The cost (``saved`` mode): one Python call and a detached alias per saved tensor, and the
sum at the end; ``scripts/activation_meter_cost.py`` measures it. ``enabled=False`` turns
the meter into a no-op (``measure`` yields a measurement of 0 bytes, installs nothing).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
from torch import nn
from torch.autograd.function import BackwardCFunction

from .._errors import PlanError

__all__ = [
    "ActivationMeter",
    "ForwardBytes",
    "Measurement",
    "MeterMode",
    "StorageKey",
    "storage_bytes",
    "weight_storages",
]

MeterMode = Literal["saved", "allocator"]
"""``"saved"``: the storages autograd saves, through saved-tensor hooks (any device);
``"allocator"``: the CUDA caching allocator's bytes in use, after minus before the forward."""

StorageKey = tuple[torch.device, int]
"""A storage's identity while it lives: its device and its data pointer."""

_Packed = tuple[torch.Tensor, int]  # (the tensor or its detached alias, its version when saved)

# The thread's next autograd sequence number (private torch API: None where it is missing).
_next_sequence_nr: Callable[[], int] | None = getattr(torch._C._autograd, "_get_sequence_nr", None)


def _key_and_bytes(t: torch.Tensor) -> tuple[StorageKey | tuple[str, int], int]:
    """``t``'s storage identity and size; a tensor without a storage of its own (a wrapper
    subclass: FSDP's and TP's ``DTensor`` parameters, whose storage object exists but has no
    data, so that its ``data_ptr`` raises) is keyed by the object and counts its elements'
    bytes."""
    try:
        s = t.untyped_storage()
        return (s.device, s.data_ptr()), s.nbytes()
    except (RuntimeError, NotImplementedError):
        return ("object", id(t)), t.numel() * t.element_size()


def storage_bytes(tensors: Iterable[torch.Tensor], exclude: Collection[StorageKey] = ()) -> int:
    """The bytes of the distinct storages of ``tensors``, each counted once, those in
    ``exclude`` not at all (a meta tensor's storage counts 0).

    Args:
        tensors: The tensors.
        exclude: Storages not to count (``weight_storages``).

    Returns:
        The sum of ``nbytes`` over the distinct storages.
    """
    seen: set[object] = set()
    total = 0
    for t in tensors:
        key, n = _key_and_bytes(t)
        if key in seen or key in exclude:
            continue
        seen.add(key)
        total += n
    return total


def weight_storages(module: nn.Module) -> frozenset[StorageKey]:
    """The storages of ``module``'s parameters and buffers: weights and state, resident
    whatever the forward does, so never activations (``ActivationMeter.measure(exclude=)``).

    A parameter replaced or re-allocated (``p.data = ...``) moves to another storage: list
    them again after that (the executor lists them once per step)."""
    out: set[StorageKey] = set()
    for t in (*module.parameters(), *module.buffers()):
        key, _ = _key_and_bytes(t)
        if isinstance(key[0], torch.device):
            out.add((key[0], int(key[1])))
    return frozenset(out)


def _may_be_saving(fn: Any) -> bool:
    """Whether the node ``fn`` may be the one now saving a tensor it made (module note)."""
    if _next_sequence_nr is None or isinstance(fn, BackwardCFunction):
        return True
    return bool(fn._sequence_nr() >= _next_sequence_nr() - 1)


def _unpack(packed: _Packed) -> torch.Tensor:
    t, version = packed
    if t._version != version:
        # torch's own check, which it skips for a tensor saved through hooks (see above)
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an"
            f" inplace operation: [{t.type()} {list(t.shape)}] is at version {t._version};"
            f" expected version {version} instead. (Checked by the activation meter's"
            " saved-tensor hooks in place of torch's check; TorchStageExecutor("
            "measure_activations=False) runs without them.)"
        )
    return t


class Measurement:
    """What one ``ActivationMeter.measure`` counted; ``bytes`` is final once it exits.

    Attributes:
        bytes: The activation bytes of the measured forward (0 until the measurement ends,
            and with a disabled meter).
        saved_tensors: How many tensors autograd saved during it (``saved`` mode; 0 in
            ``allocator`` mode).
    """

    __slots__ = ("_held", "_packed", "bytes", "saved_tensors")

    def __init__(self) -> None:
        self.bytes = 0
        self.saved_tensors = 0
        self._packed: list[weakref.ref[torch.Tensor]] = []
        self._held: list[torch.Tensor] = []

    def hold(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count ``tensors`` too: what the caller keeps from this forward until its backward
        (the outputs it stashes). In ``saved`` mode their storages count once with the saved
        ones; in ``allocator`` mode they were allocated during the forward and are in the
        delta already (nothing is added).

        Args:
            tensors: The tensors kept.
        """
        self._held.extend(tensors)

    def _pack(self, t: torch.Tensor) -> _Packed:
        fn = t.grad_fn
        if fn is not None and _may_be_saving(fn):
            t = t.detach()  # an output of the node saving it: no grad_fn, no cycle
        self._packed.append(weakref.ref(t))
        return t, t._version


class ActivationMeter:
    """Measures the activation bytes a forward keeps for its backward (module note above).

    Args:
        mode: ``"saved"`` (default; any device) or ``"allocator"`` (CUDA only).
        device: The CUDA device whose allocator ``"allocator"`` mode reads (default: the
            current one).
        enabled: False: ``measure`` does nothing and counts 0 bytes.

    Raises:
        PlanError: An unknown ``mode``, ``enabled`` that is no bool, or ``"allocator"`` mode
            without CUDA.

    Attributes:
        enabled: Whether ``measure`` measures.
        mode: The mode.
        seconds: Time spent in the meter's own work at the end of each measurement (the
            sum over storages; the per-tensor hooks are not in it: they run inside the
            forward, see ``scripts/activation_meter_cost.py``).
    """

    def __init__(
        self,
        *,
        mode: MeterMode = "saved",
        device: torch.device | str | int | None = None,
        enabled: bool = True,
    ) -> None:
        if mode not in ("saved", "allocator"):
            raise PlanError(f"ActivationMeter mode must be 'saved' or 'allocator', got {mode!r}")
        if not isinstance(enabled, bool):
            raise PlanError(f"ActivationMeter enabled must be True or False, got {enabled!r}")
        if mode == "allocator" and enabled and not torch.cuda.is_available():
            raise PlanError(
                "ActivationMeter(mode='allocator') reads the CUDA allocator, and CUDA is not"
                " available: use mode='saved'"
            )
        self.mode: MeterMode = mode
        self.enabled = enabled
        self.seconds = 0.0
        self._device = device

    @contextmanager
    def measure(
        self,
        *,
        exclude: Collection[StorageKey] = (),
        keep: Iterable[torch.Tensor] = (),
    ) -> Iterator[Measurement]:
        """Measure the forward run inside the ``with`` block, on this thread
        (saved-tensor hooks are thread-local).

        Args:
            exclude: Storages never counted: the module's weights (``weight_storages``).
            keep: Tensors that exist before the forward and that the caller keeps until its
                backward (a received input): counted once.

        Yields:
            The measurement: ``hold`` more tensors inside the block; ``bytes`` after it.
        """
        m = Measurement()
        if not self.enabled:
            yield m
            return
        kept = list(keep)
        if self.mode == "allocator":
            before = torch.cuda.memory_allocated(self._device)
            yield m
            t0 = time.perf_counter()
            after = torch.cuda.memory_allocated(self._device)
            m.bytes = max(0, after - before) + storage_bytes(kept)
            self.seconds += time.perf_counter() - t0
            return
        with torch.autograd.graph.saved_tensors_hooks(m._pack, _unpack):
            yield m
        t0 = time.perf_counter()
        alive = [t for r in m._packed if (t := r()) is not None]
        m.saved_tensors = len(m._packed)
        m.bytes = storage_bytes([*alive, *kept, *m._held], exclude)
        m._packed.clear()  # (the pack hook may outlive the block in the graph)
        m._held.clear()
        self.seconds += time.perf_counter() - t0


class ForwardBytes:
    """A stage executor's record of the bytes each training forward of a step kept: a
    meter for the executor's device, the step's ``{(virtual stage, microbatch): bytes}`` and
    each stage's weight storages (listed once per step; a parameter may be replaced between
    steps).

    Args:
        device: The executor's device (``_streams.Device``): a CUDA one is measured by its
            allocator (cheaper than a Python call per saved tensor, and it sees module
            caches), any other by saved-tensor hooks.
        enabled: False: nothing is measured, ``bytes`` stays empty.
    """

    def __init__(self, device: Any, *, enabled: bool) -> None:
        on_cuda = bool(device.is_cuda)
        self.meter = ActivationMeter(
            mode="allocator" if on_cuda else "saved",
            device=device.device if on_cuda else None,
            enabled=enabled,
        )
        self.bytes: dict[tuple[int, int], int] = {}
        self._weights: dict[int, frozenset[StorageKey]] = {}

    @property
    def enabled(self) -> bool:
        """Whether forwards are measured."""
        return self.meter.enabled

    def enable(self, on: bool) -> None:
        """Measure the forwards from the next one on (``on``), or stop."""
        self.meter.enabled = on

    def reset(self) -> None:
        """A step begins: forget the last one's bytes and weights."""
        self.bytes = {}
        self._weights = {}

    @contextmanager
    def forward(
        self, stage: int, mb: int, module: nn.Module, inputs: Iterable[torch.Tensor]
    ) -> Iterator[Measurement]:
        """Measure the forward of microbatch ``mb`` on virtual stage ``stage`` run inside
        the block (``hold`` what the backward keeps besides the saved tensors)."""
        weights = self._weights.get(stage)
        if weights is None:
            weights = self._weights[stage] = weight_storages(module)
        with self.meter.measure(exclude=weights, keep=inputs) as m:
            yield m
        self.bytes[(stage, mb)] = m.bytes
