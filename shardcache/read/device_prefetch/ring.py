"""The prefetch ring: pinned host slots, the packer thread, and the copies on one copy stream.

Invariants:

* Backpressure: the packer takes one of ``depth + 1`` tokens before ``next(upstream)``; the
  consumer returns it when it hands the batch out, so the upstream is read at most
  ``depth + 1`` batches ahead.
* Host slots: ``depth + 1`` of them, each one flat pinned ``uint8`` buffer (256-byte aligned
  tensors, one copy a batch). A slot is written again only after its copy's ``copy_done``
  event completed (waited on the packer thread, never the consumer's). A slot grows to the
  next power of two of a batch, capped at ``max_pinned_bytes // (depth + 1)``, and never
  shrinks while open.
* Device buffers: allocated on the consumer stream S; the copy stream waits on an event
  recorded on S after the allocation, and S waits on ``copy_done`` at hand-off. No
  ``record_stream``. A batch issued but never delivered is dropped after its copy completed.

Copies are issued from the consumer thread inside ``next()``; the packer thread does host
work only (one torch thread) and starts after ``iter(upstream)``, so DataLoader workers are
forked before it exists. A dropped iterator stops its epoch from the generator's ``finally``,
which may run inside garbage collection on a thread holding ``Ring.lock``: the lock is
reentrant, and a stopped epoch is never stopped twice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
import time
import warnings
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from shardcache.errors import ConfigError
from shardcache.read.device_prefetch.backend import DeviceBackend
from shardcache.read.device_prefetch.options import PrefetchOptions, PrefetchStats
from shardcache.read.device_prefetch.tree import (
    cast_tree,
    flatten,
    packed_offsets,
    packed_view,
    unflatten,
)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclasses.dataclass
class _Counters:
    """Counters shared by the consumer and packer threads (guarded by ``lock``)."""

    batches: int = 0
    bytes_copied: int = 0
    consumer_wait_s: float = 0.0
    consumer_wait_max_s: float = 0.0
    consumer_next_s: float = 0.0
    source_wait_s: float = 0.0
    pack_s: float = 0.0
    slot_wait_s: float = 0.0
    copies_timed: int = 0
    copy_s: float = 0.0
    copy_bytes_timed: int = 0
    slot_grows: int = 0
    depth_sum: int = 0
    depth_min: int = -1
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


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


class Ring:
    """The prefetch pipeline of one ``DevicePrefetcher``: slots, copy stream, epochs, stats.

    ``backend=None`` is the synchronous pass-through.
    """

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
        self.lock = threading.RLock()  # guards epoch start/stop and close
        self.timing_lock = threading.Lock()  # guards pending_timings (next() vs stats())

    # ---- lifecycle -------------------------------------------------------------------------

    def _open(self) -> None:
        if self.backend is not None and self.copy_stream is None:
            # One copy stream per prefetcher, reused over epochs (Megatron-LM#6885: streams
            # created per iterator inflate reserved memory).
            self.copy_stream = self.backend.new_stream(self.options.copy_stream_priority)
            self.slots = [_Slot() for _ in range(self.depth + 1)]

    def start_epoch(self) -> _Epoch:
        """Start an epoch (stopping an unfinished one); its packer thread runs from here."""
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
        """Stop an epoch's packer; drop its staged batches once their copies completed."""
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
        """Stop the current epoch and free the slots and the copy stream (idempotent)."""
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
        spec = flatten(batch, leaves)
        # tensors already on a device are passed through unchanged
        cpu = [i for i, t in enumerate(leaves) if t.device.type == "cpu"]
        offsets, used = packed_offsets([leaves[i] for i in cpu])
        layout: list[tuple[int, int, int, torch.dtype, torch.Size]] = [
            (i, at, leaves[i].numel() * leaves[i].element_size(), leaves[i].dtype, leaves[i].shape)
            for i, at in zip(cpu, offsets)
        ]
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
                packed_view(host, offset, dtype, shape).copy_(leaves[i])  # type: ignore[arg-type]
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
        """The next batch of an epoch on the device, ready on the current stream, or the end marker.

        Re-raises what the upstream iterator or the packer raised (the same object).
        """
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
        for i, offset, _, dtype, shape in staged.layout:
            t = packed_view(dev, offset, dtype, shape)
            leaves[i] = t.to(cast[dtype]) if dtype in cast else t
        out = unflatten(staged.spec, leaves)
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
        """The next upstream batch as it is (no accelerator), cast when asked, or the end marker."""
        t0 = time.perf_counter()
        try:
            batch = next(ep.source)  # type: ignore[arg-type]
        except StopIteration:
            return _END
        if self.cast:
            batch = cast_tree(batch, self.cast)
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
        """One epoch's iterator: starts it, yields its batches, stops it on exit."""
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
        """A snapshot of the counters since construction (never synchronises the device)."""
        if self.backend is not None and self.options.timing:
            self._harvest()
        c = self.counters
        with c.lock:
            counts = {
                k: v for k, v in vars(c).items() if k not in ("lock", "depth_sum", "depth_min")
            }
            return PrefetchStats(
                passthrough=self.backend is None,
                queue_depth_mean=c.depth_sum / c.batches if c.batches else 0.0,
                queue_depth_min=max(c.depth_min, 0),
                pinned_bytes=sum(s.capacity for s in self.slots),
                slots=len(self.slots),
                **counts,
            )
