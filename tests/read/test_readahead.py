"""The read-ahead's logic without an object store: which shards it fetches in what order,
what it pins, its backpressure, retries and errors, and its threads."""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest

from shardcache.errors import CacheError, ConfigError
from shardcache.read.fetch.shard_readahead import (
    ReadAhead,
    ReadAheadOptions,
    ReadStats,
    readahead_options,
    shards_of,
)


class FakeStore:
    """Shards by key, each ``size`` bytes; records fetches and which keys are held."""

    def __init__(self, size: int = 10, fail: set | None = None, fail_once: set | None = None):
        self.sizes: dict = {}
        self.default = size
        self.fetched: list = []  # (key, background) in the order fetches started
        self.held_at_start: dict = {}  # key -> the keys held when its fetch started
        self.held: dict = {}
        self.fail = set(fail or ())
        self.fail_once = set(fail_once or ())
        self.lock = threading.Lock()
        self.gate = threading.Event()
        self.gate.set()

    def size(self, key) -> int:
        return self.sizes.get(key, self.default)

    def present(self, key) -> bool:
        return False

    def fetch(self, key, background):
        if background:
            self.gate.wait()
        with self.lock:
            self.fetched.append((key, background))
            self.held_at_start.setdefault(key, set(self.held))
            if key in self.fail or key in self.fail_once:
                self.fail_once.discard(key)
                raise OSError(f"store down for {key}")
            self.held[key] = self.held.get(key, 0) + 1

        def release() -> None:
            with self.lock:
                self.held[key] -= 1
                if not self.held[key]:
                    del self.held[key]

        return release


def make(batches, store, options=None, bound=1 << 40, trim=None):
    stats = ReadStats()
    ra = ReadAhead(
        len(batches),
        lambda p: list(batches[p]),
        store.size,
        store.fetch,
        store.present,
        options or ReadAheadOptions(shards=4, threads=2),
        stats,
        bound,
        trim,
        lambda k: f"shard {k} of 's3://b/c'",
    )
    return ra, stats


def consume(ra, n, check=None):
    for position in range(n):
        ra.ready(position)
        if check is not None:
            check(position)
    ra.close()


def test_options_are_checked_at_construction():
    assert readahead_options(None) == ReadAheadOptions()
    assert readahead_options(0).shards == 0
    assert ReadAheadOptions(bytes="1MiB").bytes == 1 << 20
    for bad in ({"shards": -1}, {"threads": 0}, {"warn_share": 2.0}, {"bytes": "lots"}):
        with pytest.raises(ConfigError):
            ReadAheadOptions(**bad)
    with pytest.raises(ConfigError, match="readahead"):
        readahead_options("deep")


def test_shards_of_keeps_the_order_of_first_use():
    starts = np.array([0, 10, 20, 30])
    assert shards_of(starts, np.array([25, 3, 27, 12, 4])) == [2, 0, 1]


def test_every_batch_shard_is_held_while_read_and_fetched_once_in_plan_order():
    batches = [[i // 2] for i in range(20)]  # shards 0..9, two batches each
    store = FakeStore()
    ra, stats = make(batches, store)

    def check(position):
        assert batches[position][0] in store.held  # pinned while its batch is read
        assert len(ra.pinned) <= 1 + 4  # the batch's shard and at most 4 ahead

    consume(ra, len(batches), check)
    keys = [k for k, _ in store.fetched]
    assert keys == list(range(10))  # plan order, each once
    assert store.held == {}  # close released every pin
    assert stats.batches == 20
    assert stats.shards_ahead + stats.shards_on_demand == 10
    assert stats.shards_ahead == 9  # all but the first batch's shard came ahead


def test_first_batch_shards_come_alone_then_the_window():
    batches = [[0, 1, 2], [3], [4], [5]]
    store = FakeStore()
    ra, _ = make(batches, store)
    try:
        ra.ready(0)
        # nothing of later batches before the first batch is in (later ones may start as
        # soon as it is: they are checked against what was held when they started)
        assert {k for k, _ in store.fetched[:3]} == {0, 1, 2}
        later = [k for k, _ in store.fetched[3:]]
        assert all({0, 1, 2} <= store.held_at_start[k] for k in later)
    finally:
        ra.close()


def test_backpressure_bounds_the_window_by_the_cache_size():
    batches = [[i] for i in range(12)]
    store = FakeStore(size=10)
    # the local shard cache holds 35 bytes: the current shard + 2 ahead at most
    ra, _ = make(batches, store, ReadAheadOptions(shards=8, threads=3), bound=35)
    seen = []

    def check(position):
        seen.append(sum(store.size(k) for k in ra.pinned))

    consume(ra, len(batches), check)
    assert max(seen) <= 35
    assert [k for k, _ in store.fetched] == list(range(12))


def test_backpressure_by_bytes_and_trim_makes_room():
    batches = [[i] for i in range(6)]
    store = FakeStore(size=10)
    trims = []
    options = ReadAheadOptions(shards=8, bytes=20, threads=1)
    ra, _ = make(batches, store, options, bound=100, trim=lambda keep, room: trims.append(room))
    ra.ready(0)
    assert set(ra.pinned) == {0, 1, 2}  # 20 bytes ahead
    assert trims[-1] == 100 - 30  # the consumer's other open shards may hold the rest
    ra.close()


def test_a_shard_used_again_later_stays_pinned_through_its_batches():
    batches = [[0], [1], [0], [2]]
    store = FakeStore()
    ra, _ = make(batches, store)
    ra.ready(0)
    ra.ready(1)
    assert 0 in store.held and ra.pinned[0] == 2
    ra.ready(2)
    ra.ready(3)
    assert 0 not in store.held
    ra.close()
    assert [k for k, _ in store.fetched].count(0) == 1


def test_a_failed_read_ahead_is_retried_at_its_batch():
    batches = [[i] for i in range(8)]
    store = FakeStore(fail_once={3, 5})
    ra, stats = make(batches, store)
    consume(ra, len(batches), lambda p: store.held.get(batches[p][0]))
    keys = [k for k, _ in store.fetched]
    assert keys.count(3) == 2 and keys.count(5) == 2
    assert stats.retried == 2
    assert store.held == {}


def test_a_shard_that_cannot_be_had_fails_at_its_batch_naming_it():
    batches = [[i] for i in range(8)]
    store = FakeStore(fail={4})
    ra, _ = make(batches, store)
    for position in range(4):
        ra.ready(position)  # the earlier batches are unaffected
    with pytest.raises(CacheError, match=r"shard 4 of 's3://b/c'.*batch 4"):
        ra.ready(4)
    ra.close()
    assert store.held == {}


def test_on_demand_only_fetches_in_the_consumer_thread():
    batches = [[i] for i in range(5)]
    store = FakeStore()
    ra, stats = make(batches, store, ReadAheadOptions(shards=0))
    consume(ra, len(batches))
    assert store.fetched == [(i, False) for i in range(5)]
    assert stats.shards_on_demand == 5 and stats.shards_ahead == 0


def test_close_stops_early_with_no_thread_left_and_nothing_held():
    batches = [[i] for i in range(50)]
    store = FakeStore()
    store.gate.clear()  # read-ahead downloads block until released
    ra, _ = make(batches, store, ReadAheadOptions(shards=8, threads=4))
    ra.ready(0)  # the first batch's one shard: fetched in this thread
    threading.Timer(0.05, store.gate.set).start()  # close() waits for the 4 running
    ra.close()
    ra.close()  # idempotent
    assert len(store.fetched) == 1 + 4  # the 4 queued downloads were cancelled
    assert store.held == {}
    assert not [t for t in threading.enumerate() if t.name.startswith("shardcache-readahead")]


def test_waits_over_the_share_warn_once(caplog):
    stats = ReadStats()
    options = ReadAheadOptions(warn_share=0.1)
    stats.waited(True, 1.0, now=1.0)
    for k in range(1, 12):
        stats.waited(False, 0.5, now=1.0 + k)  # half of every second waiting
        stats.consumed(0.4)  # the training step computed most of the rest
        stats.check(options, "ShardDataset('s3://b/c')")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "readahead" in warnings[0].getMessage()
    assert "SHARDCACHE_CACHE_SIZE" in warnings[0].getMessage()
    figures = stats.as_dict()
    assert figures["wait_share"] == pytest.approx(5.5 / 11)
    assert figures["first_wait_s"] == 1.0 and figures["longest_wait_s"] == 0.5


def test_waits_of_a_pass_with_no_consumer_do_not_warn(caplog):
    """No model: the time between batches is the reader's own, the share means nothing."""
    stats = ReadStats()
    stats.waited(True, 1.0, now=1.0)
    for k in range(1, 30):
        stats.waited(False, 0.5, now=1.0 + k)  # the rest of each second: gather and collate
        stats.consumed(1e-5)
        stats.check(ReadAheadOptions(warn_share=0.1), "x")
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    assert not stats.warned  # judged again once a consumer computes
    for k in range(30, 42):
        stats.waited(False, 0.5, now=1.0 + k)
        stats.consumed(0.4)
        stats.check(ReadAheadOptions(warn_share=0.1), "x")
    assert stats.warned


def test_short_waits_do_not_warn(caplog):
    stats = ReadStats()
    stats.waited(True, 1.0, now=1.0)
    for k in range(1, 30):
        stats.waited(False, 0.001, now=1.0 + k)
        stats.check(ReadAheadOptions(), "x")
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_the_next_batch_is_read_ahead_even_when_it_needs_more_shards_than_the_depth():
    batches = [[0], [1, 2, 3, 4], [5]]
    store = FakeStore()
    ra, _ = make(batches, store, ReadAheadOptions(shards=2, threads=2))
    ra.ready(0)
    assert set(ra.pinned) == {0, 1, 2, 3, 4}  # batch 1 whole; batch 2 waits for room
    ra.close()
