"""Prefaulting: a mapped shard's pages mapped in by a background thread, ahead of its reads.

The first read of a memory-mapped shard in a process takes a page fault per 64 KiB of it
(the kernel's fault-around), on the reading thread: ~8 us each on the benchmark machine,
~4 ms for the 62 MB harness cache, a sixth of one cold pass, paid again by every fresh
process (each DataLoader worker of each epoch with ``persistent_workers=False``). When
:class:`~shardcache.store.cache.Cache` maps a shard, :func:`prefault` hands its bytes to
one daemon thread, which touches a byte per page (a strided numpy ``max``, which runs
without the GIL), so the faults are taken on another core while the reader works on the
rows it already has.

It is a hint: a read never waits for it and is the same without it. The thread holds a
reference to the array while it touches it, so the mapping stays valid (a shard's mapping
is released only when nothing refers to it). Bounded: at most :data:`PENDING` shards wait;
one submitted beyond that is not prefaulted (its reads fault as before). Set
``SHARDCACHE_PREFAULT=0`` to turn it off. Each process has its own thread (a forked
DataLoader worker starts one when it maps its first shard).
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
        or prefaulting is off."""
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
    return os.environ.get(PREFAULT_ENV, "1").lower() not in ("0", "false", "no")


PREFAULTER = Prefaulter()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=PREFAULTER._forked)


def prefault(array: np.ndarray) -> bool:
    """Touch the pages of the mapped ``array`` in the background (see the module text)."""
    return PREFAULTER.submit(array)
