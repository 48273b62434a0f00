"""A thread lock that finalizers can use without deadlocking.

What this module owns
---------------------
Closing a shard from a finalizer (``ShardCache.__del__``, ``ShardReader.__del__``) updates
process-wide tables: it drops the shard's decoded record batches from the LRU
(:data:`~shardcache.store.shards.DECODED`) and releases a remote shard's hold
(``store/remote.py``). Each table is guarded by a lock. The cyclic garbage collector may
run a finalizer at any allocation, and so while this very thread holds one of those locks:
a finalizer that then waited for the lock would wait forever. This was seen, not imagined:
a test run hung in ``_DecodedBatches.drop`` called from ``ShardCache.__del__`` that the
collector had run inside another ``drop`` on the same thread.

:class:`DeferredLock` is a plain lock (``with lock:``) plus :meth:`DeferredLock.run_or_defer`,
which never waits. It runs its work holding the lock when the lock is free. When the lock
is held (by another thread, or by this one below the finalizer), it queues the work, and
whoever holds the lock runs the queue before releasing it. A ``deque`` append is atomic,
so queueing takes no lock.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any


class DeferredLock:
    """A lock whose holder also runs the work that :meth:`run_or_defer` queued meanwhile."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: collections.deque[Callable[[], None]] = collections.deque()

    def __enter__(self) -> DeferredLock:
        self._lock.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._release()

    def run_or_defer(self, work: Callable[[], None]) -> None:
        """Run ``work`` holding the lock, now if the lock is free, else by its holder before
        the holder releases it. Never waits, so a finalizer may call it."""
        self._pending.append(work)
        if self._lock.acquire(blocking=False):
            self._release()

    @property
    def pending(self) -> int:
        """Work queued and not yet run (tests)."""
        return len(self._pending)

    def reset(self) -> None:
        """In a forked child: a new lock (the parent's may have been held by a thread that
        does not exist here), and no queued work (it was the parent's)."""
        self._lock = threading.Lock()
        self._pending = collections.deque()

    def _release(self) -> None:
        # Work queued after the queue was run but before the lock was released found the lock
        # held: look again once it is released, and run it if the lock is still free.
        while True:
            try:
                while self._pending:
                    self._pending.popleft()()
            finally:
                self._lock.release()
            if not self._pending or not self._lock.acquire(blocking=False):
                return
