"""DevicePrefetcher: move upstream CPU batches to the accelerator without stalling training.

What this module owns
---------------------
A background *packer* thread, a bounded ring of reusable pinned host slots, one dedicated copy
stream and the events that order it against the consumer's (compute) stream. The point is not
PCIe bandwidth: a token batch of 16 x 8192 int64 ids is ~1 MiB, about 20 us at ~55 GB/s. The
point is never stalling the compute stream:

* no pageable ``.to(device)`` on the compute stream (a pageable H2D copy performs a stream sync
  before it starts, which kills the CPU's run-ahead);
* no per-batch ``pin_memory()`` of fresh memory (with variable shapes the caching host allocator
  keeps creating size classes and pinned memory grows without bound, pytorch#97432);
* the DataLoader's receive + unpickle cost moved off the training thread (it runs in the
  packer thread, which blocks in ``next(upstream)``);
* correct buffer lifetimes on both sides, written down below and pinned by tests.

Data flow (one epoch)::

    upstream iterator --(packer thread: next(), pack every CPU tensor into one pinned slot)-->
    ready FIFO --(consumer, inside next(): allocate device buffer on the compute stream S,
    copy stream C waits on an event recorded on S, one H2D copy on C, record copy_done)-->
    S waits on copy_done --> batch of device views handed to the caller

Packing: every CPU tensor of a batch is copied into one flat ``uint8`` pinned slot at 256-byte
aligned offsets, so each batch costs exactly one H2D copy; the device side is one ``uint8``
buffer and the tensors are views into it (then optionally cast, e.g. int32 -> int64 on the device,
which halves the bytes moved). Containers are rebuilt with their own type: dicts (and dict
subclasses), other Mappings, lists, tuples, namedtuples and dataclasses. Non-tensor values and
tensors that are not on the CPU are passed through unchanged (same object).

Invariants
----------
* **Backpressure.** The packer takes one of ``depth + 1`` tokens *before* it calls
  ``next(upstream)``; the consumer returns it when it hands the batch out. So at any moment
  ``upstream batches requested - batches delivered <= depth + 1`` (``depth`` staged ahead plus one
  being packed), and the upstream is never read further ahead than that.
* **Host slots.** There are ``depth + 1`` slots. A slot goes back to the free pool as soon as its
  copy is *issued*, tagged with that copy's ``copy_done`` event; the packer waits for that event
  (``query()``, else ``synchronize()`` on the packer thread, never on the consumer) before it
  writes the slot again. So a pinned source is never overwritten mid-copy (pytorch#127612).
  A slot's capacity only changes while it is free and its copy has completed; it grows to the
  next power of two of the batch size, capped at ``max_pinned_bytes // (depth + 1)``; it never
  shrinks while the prefetcher is open. Pinned bytes therefore stay flat over epochs.
* **Device buffers.** Each batch's device buffer is allocated from the caching allocator *on the
  consumer stream S* (the stream current when ``next()`` runs); C waits on an event recorded on S
  right after that allocation, so the copy cannot write a block S may still read from a previous
  life. At hand-off, S waits on ``copy_done`` (a device-side wait; the host does not block). No
  ``record_stream``: lifetimes are deterministic and memory does not balloon when the CPU runs
  ahead. A batch issued but never delivered (``close()`` mid-epoch) is dropped only after its
  ``copy_done`` completed.

Ownership rule
--------------
**A yielded batch is never overwritten by the prefetcher: its tensors are ordinary device tensors
owned by the caller and may be kept for any time.** The prefetcher reuses only its own pinned
host slots, and only after the copy that read them completed. The batch is ready for work on the
stream that was current when ``next()`` was called; to read it on another stream, make that
stream wait on this one (and ``record_stream`` it if it outlives that use), as for any tensor.

Streams and threads
-------------------
The H2D copies are issued from the consumer thread inside ``next()``, so the "current stream" is
the training stream and nothing is shared between threads but host memory and events. At
``next(k)`` copies for batches up to ``k + depth`` are issued, so copy ``k + depth`` overlaps
compute step ``k``. The packer thread does host work only (the upstream ``next()``, memcpy into
pinned memory, rare slot growth with ``cudaHostAlloc``); it runs ``torch.set_num_threads(1)``
(thread-local) so the memcpy does not spread over every core (pytorch#25010). Every blocking
call uses a short timeout and checks a stop flag. The thread is started after
``iter(upstream)``, i.e. after the DataLoader forked its workers (fork + live thread can
deadlock, pytorch#130610).

Use the upstream ``DataLoader`` with ``pin_memory=False``: this class owns pinning; a pinned
upstream batch would be pinned twice (still correct, just wasted work and memory).

Errors and shutdown
-------------------
End of data and upstream exceptions travel in-band through the ready FIFO, after all earlier
batches; an exception is re-raised in the consumer as the same object, so its original
traceback (the upstream frames) is kept. End of data, ``close()``, ``break`` out of a ``for``
loop (the epoch generator is closed), the ``with`` block and garbage collection (a
``weakref.finalize``) all stop the packer thread, wait for outstanding copies, and drop the pinned
slots (they go back to torch's caching host allocator; ``torch.accelerator.empty_host_cache()``
returns them to the OS). One epoch is live at a time: ``iter()`` again stops the previous epoch.
The packer cannot be interrupted while it is blocked inside the upstream ``next()``; ``close()``
joins it with a timeout and the thread is a daemon (use ``DataLoader(timeout=...)`` for upstreams
that may hang).

Metrics
-------
``stats()`` never synchronises the device: host timers (consumer wait = the stall, upstream wait,
pack time, slot wait), queue depth sampled at each ``next()``, byte counters, and per-copy device
time from timing events resolved lazily, only once ``query()`` says they completed. The three waits
tell the story: high ``source_wait_s`` means the producer is the bottleneck; high
``consumer_wait_s`` with low ``source_wait_s`` means packing/transfer; high ``slot_wait_s`` with
~0 ``consumer_wait_s`` is the healthy, compute-bound case.

Device-agnostic
---------------
Device work goes through a small backend object (:class:`DeviceBackend`). The real one,
:class:`TorchDeviceBackend`, uses ``torch.accelerator`` / ``torch.Stream`` / ``torch.Event`` where
the installed torch has them (>= 2.7) and ``torch.cuda`` otherwise; tests inject a fake backend
that performs copies asynchronously. Without an accelerator (CPU-only torch, or
``device="cpu"``) the prefetcher is a synchronous pass-through with the same API that never calls
``pin_memory()`` (it raises on CPU builds of torch). Only CUDA has been the design target;
other accelerators should work through ``torch.accelerator`` but are untested.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import queue
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from shardcache.errors import ConfigError, ShardcacheError

__all__ = [
    "DeviceBackend",
    "DevicePrefetcher",
    "PrefetchOptions",
    "PrefetchStats",
    "TorchDeviceBackend",
]

# Offsets of packed tensors are multiples of this: every dtype view is legal and device kernels
# get aligned loads. The padding costs < 256 bytes per tensor (a token batch has ~4 tensors).
_ALIGN = 256
_MAX_DEPTH = 64


# --------------------------------------------------------------------------------------------
# Options and stats
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PrefetchOptions:
    """Less common knobs of :class:`DevicePrefetcher`, validated at construction.

    ``max_pinned_bytes`` caps the pinned host memory of all slots together (each of the
    ``depth + 1`` slots may hold up to ``max_pinned_bytes // (depth + 1)``); a larger batch raises
    :class:`ConfigError`. ``min_slot_bytes`` is the smallest slot capacity (slots grow in powers of
    two). ``copy_stream_priority`` is passed to the copy stream (lower = higher priority on CUDA).
    ``timing`` records timing events around each copy for ``stats()``. ``poll_interval_s`` is the
    timeout of every blocking wait between stop-flag checks; ``join_timeout_s`` bounds how long
    ``close()`` waits for the packer thread.
    """

    max_pinned_bytes: int = 1 << 30
    min_slot_bytes: int = 1 << 16
    copy_stream_priority: int = 0
    timing: bool = True
    poll_interval_s: float = 0.05
    join_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        _check_int("max_pinned_bytes", self.max_pinned_bytes, 1, None, "bytes")
        _check_int("min_slot_bytes", self.min_slot_bytes, 1, None, "bytes")
        _check_int("copy_stream_priority", self.copy_stream_priority, -64, 64, "")
        if not isinstance(self.timing, bool):
            raise ConfigError(f"PrefetchOptions.timing={self.timing!r}: must be True or False.")
        for name, lo, hi in (("poll_interval_s", 1e-4, 10.0), ("join_timeout_s", 1e-3, 3600.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(
                    f"PrefetchOptions.{name}={value!r}: must be a number of seconds "
                    f"in [{lo}, {hi}]."
                )
            if not lo <= value <= hi:
                raise ConfigError(
                    f"PrefetchOptions.{name}={value!r}: out of range; allowed [{lo}, {hi}] seconds."
                )


def _check_int(name: str, value: object, lo: int, hi: int | None, unit: str) -> None:
    allowed = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
    unit = f" {unit}" if unit else ""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"PrefetchOptions.{name}={value!r}: must be an integer {allowed}{unit}.")
    if value < lo or (hi is not None and value > hi):
        raise ConfigError(
            f"PrefetchOptions.{name}={value!r}: out of range; allowed {allowed}{unit}."
        )


@dataclasses.dataclass(frozen=True)
class PrefetchStats:
    """A snapshot of the prefetcher's counters (cumulative since construction).

    Times are host seconds unless the name says otherwise. ``consumer_wait_s`` is the stall: time
    ``next()`` blocked waiting for the packer. ``consumer_next_s`` is all host time spent in
    ``next()`` (the wait plus issuing copies and building views). ``copy_s`` and
    ``copy_bytes_timed`` cover only copies whose timing events were already complete when last
    looked at (``copies_timed`` of them), so they lag a few batches behind ``batches``.
    """

    passthrough: bool
    batches: int
    bytes_copied: int
    consumer_wait_s: float
    consumer_wait_max_s: float
    consumer_next_s: float
    source_wait_s: float
    pack_s: float
    slot_wait_s: float
    queue_depth_mean: float
    queue_depth_min: int
    copies_timed: int
    copy_s: float
    copy_bytes_timed: int
    pinned_bytes: int
    slots: int
    slot_grows: int

    @property
    def copy_gbps(self) -> float:
        """Achieved H2D bandwidth over the timed copies, in GB/s (1e9 bytes); 0 when none."""
        return self.copy_bytes_timed / self.copy_s / 1e9 if self.copy_s > 0 else 0.0

    @property
    def mean_copy_ms(self) -> float:
        """Mean device time of one timed copy in milliseconds; 0 when none."""
        return 1e3 * self.copy_s / self.copies_timed if self.copies_timed else 0.0


class _Counters:
    """Mutable counters shared by the consumer and packer threads (guarded by one lock)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.batches = 0
        self.bytes_copied = 0
        self.consumer_wait_s = 0.0
        self.consumer_wait_max_s = 0.0
        self.consumer_next_s = 0.0
        self.source_wait_s = 0.0
        self.pack_s = 0.0
        self.slot_wait_s = 0.0
        self.depth_sum = 0
        self.depth_min = -1
        self.copies_timed = 0
        self.copy_s = 0.0
        self.copy_bytes_timed = 0
        self.slot_grows = 0


# --------------------------------------------------------------------------------------------
# Backends
# --------------------------------------------------------------------------------------------


@runtime_checkable
class DeviceBackend(Protocol):
    """The only place device APIs are touched. Streams and events are opaque to the prefetcher.

    ``alloc_device`` must allocate on the *current* stream of the calling thread (the caching
    allocator ties the block to it). ``copy_async`` enqueues ``dst.copy_(src)`` on ``stream``
    without blocking the host; the copy may read ``src`` at any time until an event recorded on
    ``stream`` after it completes. ``wait(stream, event)`` orders future work on ``stream`` after
    ``event`` without blocking the host; ``synchronize(event)`` blocks the calling thread.
    """

    device: torch.device

    def current_stream(self) -> Any: ...
    def new_stream(self, priority: int) -> Any: ...
    def new_event(self, timing: bool) -> Any: ...
    def record(self, event: Any, stream: Any) -> None: ...
    def wait(self, stream: Any, event: Any) -> None: ...
    def query(self, event: Any) -> bool: ...
    def synchronize(self, event: Any) -> None: ...
    def elapsed_ms(self, start: Any, end: Any) -> float: ...
    def alloc_pinned(self, nbytes: int) -> torch.Tensor: ...
    def alloc_device(self, nbytes: int) -> torch.Tensor: ...
    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None: ...
    def init_thread(self) -> None: ...


def _has_generic_api() -> bool:
    """True when torch has the device-agnostic stream API we need (torch >= 2.7)."""
    acc = getattr(torch, "accelerator", None)
    return (
        acc is not None
        and all(hasattr(acc, n) for n in ("set_device_index", "set_stream", "current_stream"))
        and hasattr(torch, "Stream")
        and hasattr(torch, "Event")
    )


def _parse_device(device: object) -> torch.device:
    try:
        return torch.device(device)  # type: ignore[arg-type]
    except (RuntimeError, TypeError, ValueError) as err:
        raise ConfigError(
            f"DevicePrefetcher device={device!r}: not a device torch understands ({err}); "
            "use None, 'cpu', 'cuda' or 'cuda:N'."
        ) from err


def _default_device() -> torch.device:
    """The current accelerator device, or CPU when there is none."""
    if _has_generic_api() and torch.accelerator.is_available():
        acc = torch.accelerator.current_accelerator()
        if acc is not None:
            return torch.device(acc.type, torch.accelerator.current_device_index())
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class TorchDeviceBackend:
    """Real backend: ``torch.accelerator``/``torch.Stream``/``torch.Event``, else ``torch.cuda``."""

    def __init__(self, device: torch.device) -> None:
        acc = None
        if _has_generic_api() and torch.accelerator.is_available():
            acc = torch.accelerator.current_accelerator()
        self._generic = acc is not None and acc.type == device.type
        if not self._generic and device.type != "cuda":
            raise ConfigError(
                f"DevicePrefetcher device={str(device)!r}: no usable accelerator of that type "
                f"(current accelerator: {acc}); use device=None or a device torch reports."
            )
        if not self._generic and not torch.cuda.is_available():
            raise ConfigError(
                f"DevicePrefetcher device={str(device)!r}: torch.cuda.is_available() is False; "
                "use device=None (pass-through without an accelerator) or install a CUDA torch."
            )
        if device.index is None:
            index = (
                torch.accelerator.current_device_index()
                if self._generic
                else torch.cuda.current_device()
            )
            device = torch.device(device.type, index)
        self.device = device

    def current_stream(self) -> Any:
        if self._generic:
            return torch.accelerator.current_stream(self.device)
        return torch.cuda.current_stream(self.device)

    def new_stream(self, priority: int) -> Any:
        if self._generic:
            return torch.Stream(device=self.device, priority=priority)
        return torch.cuda.Stream(self.device, priority=priority)

    def new_event(self, timing: bool) -> Any:
        # Sync-only events (no timing) are the cheapest for stream waits and queries.
        if self._generic:
            return torch.Event(device=self.device, enable_timing=timing)
        return torch.cuda.Event(enable_timing=timing)

    def record(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def query(self, event: Any) -> bool:
        return bool(event.query())

    def synchronize(self, event: Any) -> None:
        event.synchronize()

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return float(start.elapsed_time(end))

    def alloc_pinned(self, nbytes: int) -> torch.Tensor:
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        # pytorch#149032: pinning before the device is initialised returned unpinned memory in
        # some versions; an unpinned slot would silently turn every copy into a synchronous one.
        if not host.is_pinned():
            raise ShardcacheError(
                f"DevicePrefetcher: allocating {nbytes} bytes of pinned host memory returned "
                "unpinned memory; the device may not be initialised or memlock is limited. "
                "Initialise the device first (e.g. torch.cuda.init()) or raise the memlock limit."
            )
        return host

    def alloc_device(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        # set_stream in the calling thread only; a shared `with stream:` object is not
        # thread-safe (torch.Stream keeps the saved stream on the object).
        if self._generic:
            prev = torch.accelerator.current_stream(self.device)
            torch.accelerator.set_stream(stream)
            try:
                dst.copy_(src, non_blocking=True)
            finally:
                torch.accelerator.set_stream(prev)
        else:
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)

    def init_thread(self) -> None:
        # The current device is per thread; the packer allocates pinned slots on it.
        if self._generic:
            torch.accelerator.set_device_index(self.device.index)
        else:
            torch.cuda.set_device(self.device)


# --------------------------------------------------------------------------------------------
# Batch structure: flatten to tensor leaves, rebuild with the same container types
# --------------------------------------------------------------------------------------------


def _flatten(obj: Any, leaves: list[torch.Tensor]) -> tuple:
    """A spec tree for ``obj``; tensors are appended to ``leaves`` and referenced by index."""
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        return ("t", len(leaves) - 1)
    if isinstance(obj, Mapping):
        return ("map", obj, tuple((k, _flatten(v, leaves)) for k, v in obj.items()))
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return ("ntuple", type(obj), tuple(_flatten(v, leaves) for v in obj))
    if isinstance(obj, (list, tuple)):
        return ("seq", type(obj), tuple(_flatten(v, leaves) for v in obj))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = tuple(
            (f.name, _flatten(getattr(obj, f.name), leaves)) for f in dataclasses.fields(obj)
        )
        return ("dc", obj, fields)
    return ("const", obj)


def _unflatten(spec: tuple, leaves: list[Any]) -> Any:
    kind = spec[0]
    if kind == "t":
        return leaves[spec[1]]
    if kind == "const":
        return spec[1]
    if kind == "map":
        obj, items = spec[1], spec[2]
        values = {k: _unflatten(s, leaves) for k, s in items}
        if type(obj) is dict:
            return values
        if isinstance(obj, dict):  # dict subclass: keep the type and its extra state
            new = copy.copy(obj)
            new.update(values)
            return new
        try:
            return type(obj)(values)
        except TypeError:
            return values
    if kind == "ntuple":
        return spec[1](*(_unflatten(s, leaves) for s in spec[2]))
    if kind == "seq":
        typ, items = spec[1], [_unflatten(s, leaves) for s in spec[2]]
        return items if typ is list else (tuple(items) if typ is tuple else typ(items))
    # dataclass: a shallow copy keeps non-init fields and works for frozen classes too
    new = copy.copy(spec[1])
    for name, s in spec[2]:
        object.__setattr__(new, name, _unflatten(s, leaves))
    return new


def _cast_tree(batch: Any, cast: Mapping[torch.dtype, torch.dtype]) -> Any:
    leaves: list[torch.Tensor] = []
    spec = _flatten(batch, leaves)
    return _unflatten(spec, [t.to(cast[t.dtype]) if t.dtype in cast else t for t in leaves])


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


# --------------------------------------------------------------------------------------------
# The pipeline core (never references the DevicePrefetcher, so GC can finalize it)
# --------------------------------------------------------------------------------------------


class _Slot:
    """One reusable pinned host buffer; ``copy_done`` is the event of the last copy reading it."""

    __slots__ = ("capacity", "copy_done", "host")

    def __init__(self) -> None:
        self.host: torch.Tensor | None = None
        self.capacity = 0
        self.copy_done: Any = None


@dataclasses.dataclass
class _Staged:
    """A batch packed into a slot, waiting for its H2D copy."""

    slot: _Slot
    used: int
    spec: tuple
    leaves: list[Any]  # non-packed leaves in place; packed ones are filled at hand-off
    layout: list[tuple[int, int, int, torch.dtype, torch.Size]]  # leaf, offset, nbytes, ...


@dataclasses.dataclass
class _Issued:
    staged: _Staged
    device_buf: torch.Tensor
    copy_done: Any


class _End:
    pass


_END = _End()


@dataclasses.dataclass
class _Failure:
    error: BaseException


class _Epoch:
    """Per-epoch state: the thread, the FIFO, the tokens and the free-slot queue."""

    def __init__(self, depth: int, slots: list[_Slot]) -> None:
        self.stop = threading.Event()
        self.ready: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.tokens = threading.Semaphore(depth + 1)
        self.free: queue.SimpleQueue[_Slot] = queue.SimpleQueue()
        for slot in slots:
            self.free.put(slot)
        self.issued: deque[_Issued] = deque()
        self.terminal: _End | _Failure | None = None
        self.source: Iterator[Any] | None = None
        self.thread: threading.Thread | None = None
        self.stopped = False


class _Core:
    def __init__(
        self,
        iterable: Iterable[Any],
        backend: DeviceBackend | None,
        depth: int,
        cast: Mapping[torch.dtype, torch.dtype],
        options: PrefetchOptions,
    ) -> None:
        self.iterable = iterable
        self.backend = backend
        self.depth = depth
        self.cast = dict(cast)
        self.options = options
        self.counters = _Counters()
        self.slot_limit = options.max_pinned_bytes // (depth + 1)
        self.slots: list[_Slot] = []
        self.copy_stream: Any = None
        self.pending_timings: deque[tuple[Any, Any, int]] = deque()
        self.epoch: _Epoch | None = None
        self.lock = threading.Lock()  # guards epoch start/stop and close
        self.timing_lock = threading.Lock()  # guards pending_timings (next() vs stats())

    # ---- lifecycle -------------------------------------------------------------------------

    def _open(self) -> None:
        if self.backend is not None and self.copy_stream is None:
            # One copy stream per prefetcher, reused over epochs (Megatron-LM#6885: streams
            # created per iterator inflate reserved memory).
            self.copy_stream = self.backend.new_stream(self.options.copy_stream_priority)
            self.slots = [_Slot() for _ in range(self.depth + 1)]

    def start_epoch(self) -> _Epoch:
        with self.lock:
            if self.epoch is not None:
                self._stop_epoch(self.epoch)
            self._open()
            ep = _Epoch(self.depth, self.slots)
            self.epoch = ep
        return ep

    def _launch(self, ep: _Epoch) -> None:
        # iter() first: a DataLoader forks its workers here, before our thread exists.
        ep.source = iter(self.iterable)
        if self.backend is not None:
            ep.thread = threading.Thread(
                target=self._pack_loop, args=(ep,), name="shardcache-prefetch", daemon=True
            )
            ep.thread.start()

    def stop_epoch(self, ep: _Epoch) -> None:
        with self.lock:
            self._stop_epoch(ep)

    def _stop_epoch(self, ep: _Epoch) -> None:
        if ep.stopped:
            return
        ep.stopped = True
        ep.stop.set()
        thread = ep.thread
        exited = thread is None
        if thread is not None and thread is not threading.current_thread():
            thread.join(self.options.join_timeout_s)
            exited = not thread.is_alive()
            if not exited:
                warnings.warn(
                    f"DevicePrefetcher: the packer thread did not stop within "
                    f"{self.options.join_timeout_s} s (it is probably blocked inside the "
                    "upstream next()); it is a daemon and will exit when that call returns. "
                    "Give the DataLoader a timeout= to bound this.",
                    ResourceWarning,
                    stacklevel=3,
                )
        # Staged but never issued: nothing reads the slot, give it back.
        while True:
            try:
                item = ep.ready.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Staged):
                ep.free.put(item.slot)
        # Issued but never delivered: the copy engine may still write the device buffer; drop
        # it only after the copy completed, or its block could be reused mid-write.
        if self.backend is not None:
            for issued in ep.issued:
                self.backend.synchronize(issued.copy_done)
        ep.issued.clear()
        source, ep.source = ep.source, None
        if exited and source is not None and hasattr(source, "close"):
            source.close()  # run a generator's finally blocks now, not at some later GC
        if self.epoch is ep:
            self.epoch = None

    def close(self) -> None:
        with self.lock:
            if self.epoch is not None:
                self._stop_epoch(self.epoch)
            if self.backend is not None:
                for slot in self.slots:
                    if slot.copy_done is not None:
                        self.backend.synchronize(slot.copy_done)
                self._harvest(drain=True)
            self.pending_timings.clear()
            self.slots = []
            self.copy_stream = None

    # ---- packer thread ---------------------------------------------------------------------

    def _pack_loop(self, ep: _Epoch) -> None:
        poll = self.options.poll_interval_s
        c = self.counters
        try:
            assert self.backend is not None
            self.backend.init_thread()
            torch.set_num_threads(1)  # thread-local: keep the memcpy on this core
            while True:
                while not ep.tokens.acquire(timeout=poll):
                    if ep.stop.is_set():
                        return
                if ep.stop.is_set():
                    return
                t0 = time.perf_counter()
                try:
                    batch = next(ep.source)  # type: ignore[arg-type]
                except StopIteration:
                    ep.ready.put(_END)
                    return
                except Exception as err:
                    ep.ready.put(_Failure(err))
                    return
                t1 = time.perf_counter()
                slot = None
                while slot is None:
                    if ep.stop.is_set():
                        return
                    with contextlib.suppress(queue.Empty):
                        slot = ep.free.get(timeout=poll)
                t2 = time.perf_counter()
                try:
                    staged = self._pack(batch, slot)
                except Exception as err:
                    ep.free.put(slot)
                    ep.ready.put(_Failure(err))
                    return
                t3 = time.perf_counter()
                with c.lock:
                    c.source_wait_s += t1 - t0
                    c.slot_wait_s += t2 - t1
                    c.pack_s += t3 - t2
                ep.ready.put(staged)
        except BaseException as err:  # never die silently: the consumer would wait forever
            ep.ready.put(_Failure(err))

    def _pack(self, batch: Any, slot: _Slot) -> _Staged:
        backend = self.backend
        assert backend is not None
        leaves: list[Any] = []
        spec = _flatten(batch, leaves)
        layout: list[tuple[int, int, int, torch.dtype, torch.Size]] = []
        used = 0
        for i, t in enumerate(leaves):
            if t.device.type != "cpu":
                continue  # already on a device: passed through unchanged
            nbytes = t.numel() * t.element_size()
            layout.append((i, used, nbytes, t.dtype, t.shape))
            used += -(-nbytes // _ALIGN) * _ALIGN
        if used > self.slot_limit:
            raise ConfigError(
                f"DevicePrefetcher: a batch needs {used} bytes of pinned staging but "
                f"PrefetchOptions.max_pinned_bytes={self.options.max_pinned_bytes} allows "
                f"{self.slot_limit} per slot (max_pinned_bytes // (depth + 1), depth="
                f"{self.depth}); raise max_pinned_bytes to at least {used * (self.depth + 1)}."
            )
        # THE reuse rule: never write a slot before the copy that last read it completed.
        if slot.copy_done is not None:
            if not backend.query(slot.copy_done):
                backend.synchronize(slot.copy_done)
            slot.copy_done = None
        if slot.host is None or used > slot.capacity:
            # Only here, with the slot free and its copy done, may the capacity change.
            cap = min(max(_next_pow2(used), self.options.min_slot_bytes), self.slot_limit)
            slot.host = None  # release the old block before asking for a bigger one
            slot.host = backend.alloc_pinned(cap)
            slot.capacity = cap
            with self.counters.lock:
                self.counters.slot_grows += 1
        host = slot.host
        for i, offset, nbytes, dtype, shape in layout:
            if nbytes:
                host[offset : offset + nbytes].view(dtype).view(shape).copy_(leaves[i])  # type: ignore[index]
            leaves[i] = None  # do not keep the CPU tensor alive past packing
        return _Staged(slot=slot, used=used, spec=spec, leaves=leaves, layout=layout)

    # ---- consumer side (the training thread) -----------------------------------------------

    def _issue(self, ep: _Epoch, staged: _Staged) -> None:
        b = self.backend
        assert b is not None
        compute = b.current_stream()
        # Allocated on the compute stream: when the caller drops the batch, the block is reused
        # only by work ordered after everything already queued on that stream.
        dev = b.alloc_device(staged.used)
        fence = b.new_event(False)
        b.record(fence, compute)
        b.wait(self.copy_stream, fence)  # the copy may not write a block still read by compute
        timing = self.options.timing
        if timing:
            start = b.new_event(True)
            b.record(start, self.copy_stream)
        b.copy_async(dev, staged.slot.host[: staged.used], self.copy_stream)  # type: ignore[index]
        if timing:
            end = b.new_event(True)
            b.record(end, self.copy_stream)
            self.pending_timings.append((start, end, staged.used))
        done = b.new_event(False)
        b.record(done, self.copy_stream)
        staged.slot.copy_done = done  # set before the slot is visible to the packer again
        ep.free.put(staged.slot)
        ep.issued.append(_Issued(staged, dev, done))

    def _take(self, ep: _Epoch, item: Any) -> None:
        if isinstance(item, _Staged):
            self._issue(ep, item)
        else:
            ep.terminal = item

    def _top_up(self, ep: _Epoch) -> None:
        # Issue copies up to `depth` batches beyond the one about to be handed out.
        while ep.terminal is None and len(ep.issued) <= self.depth:
            try:
                item = ep.ready.get_nowait()
            except queue.Empty:
                return
            self._take(ep, item)

    def _harvest(self, drain: bool = False) -> None:
        """Fold finished copy timings into the counters; blocks on the device only if drain."""
        with self.timing_lock:
            self._harvest_locked(drain)

    def _harvest_locked(self, drain: bool) -> None:
        b = self.backend
        c = self.counters
        while self.pending_timings:
            start, end, nbytes = self.pending_timings[0]
            if not drain and not b.query(end):  # type: ignore[union-attr]
                return
            if drain:
                b.synchronize(end)  # type: ignore[union-attr]
            self.pending_timings.popleft()
            ms = b.elapsed_ms(start, end)  # type: ignore[union-attr]
            with c.lock:
                c.copies_timed += 1
                c.copy_s += ms / 1e3
                c.copy_bytes_timed += nbytes

    def next_batch(self, ep: _Epoch) -> Any:
        t0 = time.perf_counter()
        poll = self.options.poll_interval_s
        b = self.backend
        assert b is not None
        if ep.stopped:
            return _END
        if self.options.timing:
            self._harvest()
        ahead = len(ep.issued) + ep.ready.qsize()  # packed and waiting; 0 = starving
        self._top_up(ep)
        wait_s = 0.0
        if not ep.issued and ep.terminal is None:
            tw = time.perf_counter()
            item = None
            while item is None:
                try:
                    item = ep.ready.get(timeout=poll)
                except queue.Empty:
                    if ep.stop.is_set():
                        return _END
            wait_s = time.perf_counter() - tw
            self._take(ep, item)
        if not ep.issued:
            terminal = ep.terminal
            if isinstance(terminal, _Failure):
                ep.terminal = _END  # raise once; afterwards the epoch is simply over
                raise terminal.error
            return _END
        issued = ep.issued.popleft()
        b.wait(b.current_stream(), issued.copy_done)  # device-side; the host does not block
        staged, dev = issued.staged, issued.device_buf
        leaves = staged.leaves
        cast = self.cast
        for i, offset, nbytes, dtype, shape in staged.layout:
            t = dev[offset : offset + nbytes].view(dtype).view(shape)
            leaves[i] = t.to(cast[dtype]) if dtype in cast else t
        out = _unflatten(staged.spec, leaves)
        c = self.counters
        with c.lock:
            c.batches += 1
            c.bytes_copied += staged.used
            c.consumer_wait_s += wait_s
            c.consumer_wait_max_s = max(c.consumer_wait_max_s, wait_s)
            c.depth_sum += ahead
            c.depth_min = ahead if c.depth_min < 0 else min(c.depth_min, ahead)
            c.consumer_next_s += time.perf_counter() - t0
        ep.tokens.release()  # after `batches` is counted: requested - delivered <= depth + 1
        return out

    def passthrough_next(self, ep: _Epoch) -> Any:
        t0 = time.perf_counter()
        try:
            batch = next(ep.source)  # type: ignore[arg-type]
        except StopIteration:
            return _END
        if self.cast:
            batch = _cast_tree(batch, self.cast)
        dt = time.perf_counter() - t0
        c = self.counters
        with c.lock:
            c.batches += 1
            c.consumer_wait_s += dt
            c.consumer_wait_max_s = max(c.consumer_wait_max_s, dt)
            c.consumer_next_s += dt
            c.source_wait_s += dt
            c.depth_min = 0
        return batch

    def run(self) -> Iterator[Any]:
        ep = self.start_epoch()
        step = self.next_batch if self.backend is not None else self.passthrough_next
        try:
            self._launch(ep)
            while True:
                batch = step(ep)
                if batch is _END:
                    return
                yield batch
        finally:
            self.stop_epoch(ep)

    def stats(self) -> PrefetchStats:
        if self.backend is not None and self.options.timing:
            self._harvest()
        c = self.counters
        with c.lock:
            return PrefetchStats(
                passthrough=self.backend is None,
                batches=c.batches,
                bytes_copied=c.bytes_copied,
                consumer_wait_s=c.consumer_wait_s,
                consumer_wait_max_s=c.consumer_wait_max_s,
                consumer_next_s=c.consumer_next_s,
                source_wait_s=c.source_wait_s,
                pack_s=c.pack_s,
                slot_wait_s=c.slot_wait_s,
                queue_depth_mean=c.depth_sum / c.batches if c.batches else 0.0,
                queue_depth_min=max(c.depth_min, 0),
                copies_timed=c.copies_timed,
                copy_s=c.copy_s,
                copy_bytes_timed=c.copy_bytes_timed,
                pinned_bytes=sum(s.capacity for s in self.slots),
                slots=len(self.slots),
                slot_grows=c.slot_grows,
            )


# --------------------------------------------------------------------------------------------
# Public class
# --------------------------------------------------------------------------------------------


class DevicePrefetcher:
    """Yield each upstream batch on the device, in order, with copies overlapping compute.

    ``iterable`` is re-iterated once per epoch (e.g. a ``DataLoader`` built with
    ``pin_memory=False``). ``device=None`` picks the current accelerator, or a CPU pass-through
    when there is none. ``depth`` batches are staged ahead of the one being consumed (plus one
    being packed). ``cast`` maps a host dtype to the dtype handed out, converted on the device
    after the copy (e.g. ``{torch.int32: torch.int64}``). ``backend`` replaces the torch device
    backend (tests, other accelerators). See the module docstring for the ownership rule::

        with DevicePrefetcher(loader, depth=2) as batches:
            for batch in batches:
                loss = model(**batch)
    """

    def __init__(
        self,
        iterable: Iterable[Any],
        device: torch.device | str | None = None,
        depth: int = 2,
        *,
        cast: Mapping[torch.dtype, torch.dtype] | None = None,
        options: PrefetchOptions | None = None,
        backend: DeviceBackend | None = None,
    ) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth <= _MAX_DEPTH:
            raise ConfigError(
                f"DevicePrefetcher depth={depth!r}: must be an integer in [1, {_MAX_DEPTH}] "
                "(batches staged ahead; 2 double-buffers, 3-4 absorb producer jitter)."
            )
        if options is None:
            options = PrefetchOptions()
        elif not isinstance(options, PrefetchOptions):
            raise ConfigError(
                f"DevicePrefetcher options={options!r}: must be a PrefetchOptions or None."
            )
        cast = dict(cast or {})
        for src, dst in cast.items():
            if not isinstance(src, torch.dtype) or not isinstance(dst, torch.dtype):
                raise ConfigError(
                    f"DevicePrefetcher cast={{{src!r}: {dst!r}}}: keys and values must be "
                    "torch.dtype, e.g. {torch.int32: torch.int64}."
                )
        if backend is not None:
            if not isinstance(backend, DeviceBackend):
                raise ConfigError(
                    f"DevicePrefetcher backend={backend!r}: does not implement DeviceBackend."
                )
            if device is not None and _parse_device(device) != backend.device:
                raise ConfigError(
                    f"DevicePrefetcher device={str(device)!r} differs from the backend's device "
                    f"{str(backend.device)!r}; pass only one of them."
                )
        else:
            dev = _default_device() if device is None else _parse_device(device)
            if dev.type != "cpu":
                backend = TorchDeviceBackend(dev)
        self.device: torch.device = backend.device if backend is not None else torch.device("cpu")
        self.depth = depth
        self._core = _Core(iterable, backend, depth, cast, options)
        # Runs at close() or when this object is garbage collected; holds only the core.
        self._finalizer = weakref.finalize(self, self._core.close)

    @property
    def passthrough(self) -> bool:
        """True when there is no accelerator and batches are handed out as they come."""
        return self._core.backend is None

    def __iter__(self) -> Iterator[Any]:
        """Start an epoch (stopping a previous, unfinished one) and iterate over it."""
        return self._iterate()

    def _iterate(self) -> Iterator[Any]:
        # A generator method, so a live epoch keeps this object (and its finalizer) alive;
        # `break` closes the generator, which stops the epoch in run()'s finally.
        yield from self._core.run()

    def __len__(self) -> int:
        return len(self._core.iterable)  # type: ignore[arg-type]

    def stats(self) -> PrefetchStats:
        """A snapshot of the metrics; never synchronises the device."""
        return self._core.stats()

    def close(self) -> None:
        """Stop the packer thread, wait for outstanding copies, free the pinned slots.

        Idempotent. A later ``iter()`` starts afresh (re-allocating slots and the copy stream).
        """
        self._core.close()

    def __enter__(self) -> DevicePrefetcher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
