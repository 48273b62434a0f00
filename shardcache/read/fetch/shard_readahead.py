"""Read-ahead from object storage, driven by the epoch plan.

The plan says from the start which shards each batch of this reader needs, in order.
``ReadAhead`` downloads them in that order on a small thread pool into the local shard cache:
the first batch's shards first and alone; every shard of the window pinned (no process evicts
it) until the consumer has passed the last batch that needs it; the window bounded in shards,
bytes and ``SHARDCACHE_CACHE_SIZE``. A failed read-ahead is retried when its batch comes; a
shard that still cannot be had raises ``CacheError`` at that batch, never in the background.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardcache.config import check_fraction, check_int, parse_size
from shardcache.errors import CacheError, ConfigError, ShardcacheError
from shardcache.read.selection.mixture import MixtureIndex
from shardcache.store.cache import Cache
from shardcache.store.remote import RemoteCache, cache_size_bytes

logger = logging.getLogger("shardcache")

#: How far past the consumer the window looks for shards (batches): bounds the work of one
#: top-up when many batches share few shards.
LOOKAHEAD_BATCHES = 1024
#: Batches after the first before the wait share is judged (``ReadStats``).
WARN_AFTER_BATCHES = 8
#: The share of the time the consumer must spend on its own work (between taking a batch and
#: asking for the next) before the wait share is judged: a pass with no model spends all its
#: time in the reader, and its wait share says nothing about a training step.
MIN_CONSUMER_SHARE = 0.05

Key = Hashable
Release = Callable[[], None]


@dataclass(frozen=True)
class ReadAheadOptions:
    """How far a reader of a cache in object storage downloads ahead of its batches.

    Args:
        shards: shards downloaded ahead of the batch being read (0: on demand only).
        bytes: bytes downloaded ahead (an int or a size like ``"2GiB"``; None: no bound but
            ``SHARDCACHE_CACHE_SIZE``).
        threads: downloads in parallel (at least 1).
        warn_share: warn (once) when the consumer waits for downloads more than this share
            of the time after its first batch (judged once the consumer computes between
            batches: ``MIN_CONSUMER_SHARE`` of the time).

    Raises:
        ConfigError: a value is out of range.
    """

    shards: int = 16
    bytes: int | str | None = None
    threads: int = 4
    warn_share: float = 0.05

    def __post_init__(self) -> None:
        check_int("readahead.shards", self.shards, 0)
        check_int("readahead.threads", self.threads, 1, 64)
        check_fraction("readahead.warn_share", self.warn_share)
        if self.bytes is not None:
            size = parse_size(self.bytes, "readahead.bytes")
            object.__setattr__(self, "bytes", size)

    @property
    def byte_bound(self) -> int:
        """The bound in bytes (a very large number when none)."""
        return int(self.bytes) if self.bytes is not None else 1 << 62


def readahead_options(value: Any) -> ReadAheadOptions:
    """``ShardDataset(readahead=...)`` (options, an int of shards ahead, or None) as options."""
    if value is None:
        return ReadAheadOptions()
    if isinstance(value, ReadAheadOptions):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return ReadAheadOptions(shards=value)
    raise ConfigError(
        f"readahead: got {value!r}, expected a ReadAheadOptions, a number of shards (0: "
        "download on demand only) or None (the defaults)"
    )


@dataclass
class ReadStats:
    """What a reader of object storage waited for and downloaded (this process)."""

    batches: int = 0
    first_wait_s: float = 0.0
    wait_s: float = 0.0
    longest_wait_s: float = 0.0
    elapsed_s: float = 0.0
    consumer_s: float = 0.0
    bytes_ahead: int = 0
    bytes_on_demand: int = 0
    shards_ahead: int = 0
    shards_on_demand: int = 0
    retried: int = 0
    warned: bool = False
    _first_ready: float | None = field(default=None, repr=False)

    def as_dict(self) -> dict[str, Any]:
        """The figures as a JSON-able dict, plus ``wait_share`` (``wait_s / elapsed_s``)."""
        out = {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
        out["wait_share"] = self.wait_s / self.elapsed_s if self.elapsed_s > 0 else 0.0
        return out

    def waited(self, first: bool, seconds: float, now: float) -> None:
        """Count one batch's wait."""
        self.batches += 1
        if first or self._first_ready is None:
            self.first_wait_s += seconds
            self._first_ready = now - self.elapsed_s  # (a later pass continues the clock)
            return
        self.wait_s += seconds
        self.longest_wait_s = max(self.longest_wait_s, seconds)
        self.elapsed_s = now - self._first_ready

    def consumed(self, seconds: float) -> None:
        """Count the consumer's own time with one batch (from its hand-out to the next ask)."""
        self.consumer_s += seconds

    def check(self, options: ReadAheadOptions, where: str) -> None:
        """Log a warning once when the waits exceed ``options.warn_share`` of the time.

        Judged only once the consumer's own time is ``MIN_CONSUMER_SHARE`` of the time or more:
        without a training step between batches, the elapsed time is the reader's own.
        """
        if self.warned or self.batches <= WARN_AFTER_BATCHES or self.elapsed_s <= 0:
            return
        if self.consumer_s < MIN_CONSUMER_SHARE * self.elapsed_s:
            return
        share = self.wait_s / self.elapsed_s
        if share <= options.warn_share:
            return
        self.warned = True
        logger.warning(
            "%s: the training loop waited for downloads %.1f%% of the time after the first "
            "batch (%.2f s of %.2f s, %.2f s computing; longest wait %.3f s; %d bytes "
            "downloaded ahead, %d on demand); "
            "read further ahead (ShardDataset(readahead=ReadAheadOptions(shards=..., "
            "threads=...)), now %d shards, %d threads) or raise SHARDCACHE_CACHE_SIZE if the "
            "window is held back by it",
            where,
            100 * share,
            self.wait_s,
            self.elapsed_s,
            self.consumer_s,
            self.longest_wait_s,
            self.bytes_ahead,
            self.bytes_on_demand,
            options.shards,
            options.threads,
        )


@dataclass
class _Pin:
    size: int
    last: int  # the last position of the window that needs it
    future: Future[Release] | None = None
    release: Release | None = None


class ReadAhead:
    """Downloads the shards of a pass's batches ahead of the consumer.

    The consumer calls ``ready(position)`` for each position in order before reading its batch and
    ``close`` at the end; everything but the downloads runs in the consumer's thread. The cache is
    seen through callables (``fetch(key, background)`` returns the release of the held shard;
    ``trim(keep, room)`` closes the consumer's open shards outside ``keep``).
    """

    def __init__(
        self,
        count: int,
        needs: Callable[[int], list[Key]],
        size: Callable[[Key], int],
        fetch: Callable[[Key, bool], Release],
        present: Callable[[Key], bool],
        options: ReadAheadOptions,
        stats: ReadStats,
        cache_bound: int,
        trim: Callable[[set[Key], int], None] | None = None,
        describe: Callable[[Key], str] = str,
        where: str = "shardcache",
    ) -> None:
        self.count = count
        self.needs = needs
        self.size = size
        self.fetch = fetch
        self.present = present
        self.options = options
        self.stats = stats
        self.cache_bound = cache_bound
        self.trim = trim
        self.describe = describe
        self.where = where
        self._pins: dict[Key, _Pin] = {}
        self._scheduled = -1  # the last position whose shards are all pinned
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()  # guards the byte counters the pool threads add to
        self._first = True

    # ---- consumer side ---------------------------------------------------------------------

    def ready(self, position: int) -> None:
        """Make the shards of the batch at ``position`` local and pinned, then top up the window.

        Raises ``CacheError`` when a shard cannot be downloaded even when retried now.
        """
        start = time.perf_counter()
        for key in [k for k, pin in self._pins.items() if pin.last < position]:
            self._unpin(key)
        keys = self.needs(position)
        new = []
        for key in keys:
            pin = self._pins.get(key)
            if pin is None:
                pin = self._pins[key] = _Pin(self.size(key), position)
                new.append(key)
            pin.last = max(pin.last, position)
        self._make_room()
        if self.options.shards and len(new) > 1:  # several at once on the pool
            for key in new:
                self._pins[key].future = self._submit(key, ahead=False)
        for key in keys:
            self._resolve(key, position)
        self._scheduled = max(self._scheduled, position)
        now = time.perf_counter()
        self.stats.waited(self._first, now - start, now)
        self._first = False
        self.stats.check(self.options, self.where)
        self._top_up(position, set(keys))

    def _resolve(self, key: Key, position: int) -> None:
        """Wait for ``key``'s download, or download it now (on demand, or retried)."""
        pin = self._pins[key]
        if pin.release is not None:
            return
        if pin.future is not None:
            try:
                pin.release = pin.future.result()
                return
            except Exception as err:  # retried below, in this thread
                pin.future = None
                self.stats.retried += 1
                logger.info(
                    "%s: reading ahead %s failed (%s: %s); retrying it now",
                    self.where, self.describe(key), type(err).__name__, err,
                )  # fmt: skip
        for attempt in (1, 2):  # a download that failed on demand gets one more try
            try:
                pin.release = self._fetch(key, ahead=False, background=False)
                return
            except ShardcacheError:  # corrupt or missing: another try gives the same
                del self._pins[key]
                raise
            except Exception as err:
                if attempt == 1:
                    self.stats.retried += 1
                    continue
                del self._pins[key]
                raise CacheError(
                    f"{self.describe(key)}: download failed ({type(err).__name__}: {err}) "
                    f"for batch {position} of this reader, after the retries of the "
                    "filesystem layer; check the object store and the network, then resume "
                    "from the last checkpoint"
                ) from err

    def _top_up(self, position: int, current: set[Key]) -> None:
        """Pin and download the shards of the batches after ``position``, within bounds."""
        if not self.options.shards:
            return
        ahead = [k for k in self._pins if k not in current]
        ahead_bytes = sum(self._pins[k].size for k in ahead)
        total = sum(pin.size for pin in self._pins.values())
        new: list[Key] = []
        nxt = max(self._scheduled, position) + 1
        stop = min(self.count, position + 1 + LOOKAHEAD_BATCHES)
        while nxt < stop:
            keys = self.needs(nxt)
            fresh = [k for k in dict.fromkeys(keys) if k not in self._pins]
            cost = sum(self.size(k) for k in fresh)
            deep = len(ahead) + len(new) + len(fresh) > self.options.shards or (
                ahead_bytes + cost > self.options.byte_bound
            )
            # (the next batch is always read ahead, however many shards it needs, when the
            # local shard cache has room for it)
            if (deep and (ahead or new)) or total + cost > self.cache_bound:
                break  # backpressure: the consumer's progress frees room
            for key in keys:
                pin = self._pins.get(key)
                if pin is None:
                    pin = self._pins[key] = _Pin(self.size(key), nxt)
                    new.append(key)
                pin.last = max(pin.last, nxt)
            ahead_bytes += cost
            total += cost
            self._scheduled = nxt
            nxt += 1
        self._make_room()
        for key in new:
            self._pins[key].future = self._submit(key, ahead=True)

    def _make_room(self) -> None:
        """Close the consumer's open shards that the pins leave no room for under the bound."""
        if self.trim is not None:
            total = sum(pin.size for pin in self._pins.values())
            self.trim(set(self._pins), max(0, self.cache_bound - total))

    def _submit(self, key: Key, ahead: bool) -> Future[Release]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.options.threads, "shardcache-readahead")
        return self._pool.submit(self._fetch, key, ahead, True)

    def _fetch(self, key: Key, ahead: bool, background: bool) -> Release:
        downloads = not self.present(key)
        release = self.fetch(key, background)
        if downloads:
            with self._lock:
                if ahead:
                    self.stats.bytes_ahead += self.size(key)
                    self.stats.shards_ahead += 1
                else:
                    self.stats.bytes_on_demand += self.size(key)
                    self.stats.shards_on_demand += 1
        return release

    def _unpin(self, key: Key) -> None:
        pin = self._pins.pop(key)
        release = pin.release
        if release is None and pin.future is not None:
            if pin.future.cancel():
                return
            try:
                release = pin.future.result()
            except Exception:  # nobody needs it any more: its batch retries if it comes
                return
        if release is not None:
            release()

    @property
    def pinned(self) -> dict[Key, int]:
        """The pinned shards and the last position that needs each."""
        return {key: pin.last for key, pin in self._pins.items()}

    def close(self) -> None:
        """Cancel pending downloads, wait for running ones, release every pin (idempotent)."""
        for pin in self._pins.values():
            if pin.future is not None:
                pin.future.cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for key in list(self._pins):
            self._unpin(key)


def shards_of(shard_starts: np.ndarray, ids: np.ndarray) -> list[int]:
    """The shards holding some sample ids, in order of first use."""
    shards = np.searchsorted(shard_starts, np.asarray(ids, dtype=np.int64), side="right") - 1
    _, first = np.unique(shards, return_index=True)
    return [int(s) for s in shards[np.sort(first)]]


def cache_readahead(
    caches: list[Cache],
    index: MixtureIndex | None,
    close_idle: Callable[[list[set[int] | None], int], Any],
    plan: Any,
    batches: np.ndarray,
    options: ReadAheadOptions,
    stats: ReadStats,
    where: str,
) -> ReadAhead | None:
    """A ``ReadAhead`` for this reader's shards in object storage (None when none).

    ``caches`` are the sources (one for one cache), ``index`` maps a mixture's ids to them
    (None for one cache), ``close_idle(shards, room)`` closes every source's other shards;
    ``plan.batch(j)`` gives the sample ids of global batch ``j``.
    """
    remotes = [c.remote for c in caches]
    if all(r is None for r in remotes):
        return None

    def needs(position: int) -> list[Key]:
        ids = plan.batch(int(batches[position]))
        if index is None:
            return [(0, s) for s in shards_of(caches[0].shard_starts, ids)]
        source, local = index.locate(ids)
        keys: list[Key] = []
        for s in dict.fromkeys(source.tolist()):  # sources in order of first use
            if remotes[s] is not None:
                keys += [(s, sh) for sh in shards_of(caches[s].shard_starts, local[source == s])]
        return keys

    def remote_of(key: Any) -> tuple[RemoteCache, dict[str, Any]]:
        source, shard = key
        remote = remotes[source]
        assert remote is not None  # (needs() keys only remote sources)
        return remote, caches[source].shards[shard]

    def fetch(key: Key, background: bool) -> Release:
        remote, info = remote_of(key)
        return remote.fetch_shard(info, background=background)[1]

    def present(key: Key) -> bool:
        remote, info = remote_of(key)
        return remote.has_shard(info)

    def describe(key: Key) -> str:
        remote, info = remote_of(key)
        return f"shard {info['name']} of {remote.url!r} ({remote.shard_url(info)})"

    def trim(keep: set[Key], room: int) -> None:
        shards = [set() if r is not None else None for r in remotes]
        for source, shard in keep:  # type: ignore[misc]
            shards[source].add(shard)  # type: ignore[union-attr]
        close_idle(shards, room)

    return ReadAhead(
        len(batches),
        needs,
        lambda key: int(remote_of(key)[1]["bytes"]),
        fetch,
        present,
        options,
        stats,
        cache_size_bytes(),
        trim,
        describe,
        where,
    )
