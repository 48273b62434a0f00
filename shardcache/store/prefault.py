"""Prefaulting: a mapped shard's pages mapped in by a background thread, ahead of its reads.

Off by default; ``SHARDCACHE_PREFAULT=1`` turns it on.

The first read of a memory-mapped shard in a process takes a page fault per 64 KiB of it
(the kernel's fault-around), on the reading thread: ~4 ms for the 62 MB harness cache.
When it is on and :class:`~shardcache.store.cache.Cache` maps a shard, :func:`prefault`
hands its bytes to one daemon thread, which touches a byte per page (a strided numpy
``max``), so that the faults are taken on another core while the reader works on the rows
it already has.

Why off: measured side by side on the benchmark machine (2 cores; ``bench_cold.py
--prefault-ab``, 15 fresh processes each, interleaved), a cold pass was faster without it:
concat 31.2 / 32.7 ms (min / median) off against 35.3-36.9 / 38.9-39.1 ms on, pad 31.7 / 32.9
against 37.2 / 42.9 ms. The thread's numpy reduction waits on the GIL while the reader
holds it (alone it touches the 62 MB in 3.7 ms; beside a busy Python thread it took 36 ms),
and even a GIL-free ``madvise(MADV_POPULATE_READ)`` in a
thread was slower (35.4 / 36.5 ms) than letting the reader take its own faults: the two
threads' faults on one mapping contend in the kernel. Mapping the pages in on the reading
thread first (the same ``madvise``, synchronous) gained nothing (31.8 / 32.8 ms).

It is a hint: a read never waits for it and is the same without it. The thread holds a
reference to the array while it touches it, so the mapping stays valid (a shard's mapping
is released only when nothing refers to it). Bounded: at most :data:`PENDING` shards wait;
one submitted beyond that is not prefaulted (its reads fault as before). Each process has
its own thread (a forked DataLoader worker starts one when it maps its first shard).
"""

from __future__ import annotations

import collections
import os
import threading

import numpy as np

PREFAULT_ENV = "SHARDCACHE_PREFAULT"
#: Shards that may wait for the thread; more are not prefaulted.
PENDING = 8
#: One byte is touched per this many: a page (fault-around then maps up to 16 at once).
PAGE = 4096


class Prefaulter:
    """One daemon thread that touches the pages of the arrays given to :meth:`submit`."""

    def __init__(self) -> None:
        self._jobs: collections.deque[np.ndarray] = collections.deque()
        self._ready = threading.Condition()
        self._busy = False
        self._thread: threading.Thread | None = None
        self.touched = 0  # arrays prefaulted (tests)
        self.dropped = 0  # arrays refused for a full queue (tests)

    def submit(self, array: np.ndarray) -> bool:
        """Queue the pages of ``array`` (any dtype, contiguous); False when the queue is full
        or prefaulting is off (the default)."""
        if not enabled() or array.nbytes < PAGE:
            return False
        with self._ready:
            if len(self._jobs) >= PENDING:
                self.dropped += 1
                return False
            self._jobs.append(array)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="shardcache-prefault", daemon=True
                )
                self._thread.start()
            self._ready.notify()
        return True

    def wait(self) -> None:
        """Until every queued array is touched (tests, benchmarks)."""
        with self._ready:
            while self._jobs or self._busy:
                self._ready.wait()

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._jobs:
                    self._ready.wait()
                array = self._jobs.popleft()
                self._busy = True
            try:
                flat = array.reshape(-1).view(np.uint8)
                flat[::PAGE].max()  # a read per page; numpy leaves the GIL meanwhile
            finally:
                del array
                with self._ready:
                    self.touched += 1
                    self._busy = False
                    self._ready.notify_all()

    def _forked(self) -> None:
        """In a forked child: the parent's thread does not exist here."""
        self._jobs = collections.deque()
        self._ready = threading.Condition()
        self._busy = False
        self._thread = None


def enabled() -> bool:
    """Whether ``SHARDCACHE_PREFAULT`` turns prefaulting on (off by default: see above)."""
    return os.environ.get(PREFAULT_ENV, "0").lower() in ("1", "true", "yes", "on")


PREFAULTER = Prefaulter()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=PREFAULTER._forked)


def prefault(array: np.ndarray) -> bool:
    """Touch the pages of the mapped ``array`` in the background (see the module text)."""
    return PREFAULTER.submit(array)
