"""A mixture source's shard-major passes: windows by shard, and the epoch a rank reads by shard."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from shardcache.read.selection.passes import (
    EpochShards,
    SourceEpoch,
    SourceUnits,
    rotating_epoch,
    stream_window,
)


def _units(n: int = 500, shards: int = 12, seed: int = 0, side: bool = False) -> SourceUnits:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 60, n).astype(np.int32)
    cuts = np.sort(rng.choice(np.arange(1, n), shards - 1, replace=False))
    starts = np.r_[0, cuts, n].astype(np.int64)
    starts[3] = starts[2]  # (an empty shard)
    rows = np.sort(rng.choice(n, n * 3 // 4, replace=False)) if side else None
    return SourceUnits.of(lengths, None, starts, rows)


def _by_shard(taken: SourceEpoch) -> list[np.ndarray]:
    return [taken.shard_ids(g) for g in range(len(taken.units.shard_sizes))]


def _check_shards(taken: SourceEpoch) -> None:
    """Per shard, the counts, tokens and ids agree with the epoch's documents."""
    units = taken.units
    docs = np.sort(taken.documents())
    by_shard = _by_shard(taken)
    assert np.array_equal(np.sort(np.concatenate(by_shard)), docs)
    local_starts = units.shard_starts if units.side is None else None
    for g, ids in enumerate(by_shard):
        assert np.array_equal(ids, np.sort(ids))
        if local_starts is not None:
            assert ((ids >= local_starts[g]) & (ids < local_starts[g + 1])).all()
    counts = np.array([len(i) for i in by_shard])
    assert np.array_equal(taken.shard_counts(), counts)
    tokens = np.array([int(np.asarray(units.planned)[i].sum()) for i in by_shard])
    assert np.array_equal(taken.shard_tokens(), tokens)


@pytest.mark.parametrize("side", [False, True])
def test_a_rotating_window_by_shard_is_the_epoch_s_documents(side):
    units = _units(side=side)
    total = units.total
    for target in (total // 3, total + total // 2, 3 * total, 2 * total + 7):
        for epoch in range(4):
            taken = rotating_epoch(units, target, 1, 9, epoch)
            _check_shards(taken)
            docs = taken.documents()
            # every document at most once more than the whole uses; tokens within one document
            assert np.bincount(docs).max() <= target // total + 1
            if side:
                assert np.isin(docs, units.side).all()
            got = int(np.asarray(units.counted)[docs].sum())
            assert abs(got - target) <= int(np.asarray(units.counted).max())


def test_a_window_is_whole_shards_and_at_most_two_pieces():
    units = _units(2000, 40, seed=2)
    sizes = units.shard_sizes
    total = units.total
    for epoch in range(6):
        taken = rotating_epoch(units, total // 5, 3, 4, epoch)
        counts = taken.shard_counts()
        partial = (counts > 0) & (counts < sizes)
        assert partial.sum() <= 2, (epoch, counts, sizes)


def test_schedule_windows_read_each_pass_once_in_shard_major_order():
    units = _units(400, 10, seed=5)
    total = units.total
    cuts = np.linspace(0, 3 * total, 23).astype(np.int64)
    taken = [stream_window(units, int(a), int(b), 7, 11) for a, b in itertools.pairwise(cuts)]
    for t in taken:
        _check_shards(t)
    stream = np.concatenate([t.documents() for t in taken])
    # the windows tile the stream: three passes, each every document once
    assert len(stream) == 3 * units.size
    for c in range(3):
        assert np.array_equal(np.sort(stream[c * units.size : (c + 1) * units.size]),
                              np.arange(units.size))  # fmt: skip
    # each pass reads a shard's documents together (shard-major), in another order each pass
    shard = np.searchsorted(units.shard_starts, stream, side="right") - 1
    runs = int((np.diff(shard) != 0).sum()) + 1
    assert runs <= 3 * int((units.shard_sizes > 0).sum())
    firsts = [stream[c * units.size : c * units.size + 20].tolist() for c in range(3)]
    assert firsts[0] != firsts[1] != firsts[2]


def test_a_window_spanning_many_passes_counts_them_whole():
    units = _units(300, 8, seed=6)
    total = units.total
    taken = stream_window(units, total // 2, 5 * total + total // 3, 0, 1)
    _check_shards(taken)
    assert np.bincount(taken.documents(), minlength=units.size).max() <= 6


def test_epoch_shards_give_each_shard_s_rows_in_id_order_with_their_repetitions():
    first, second = _units(300, 6, seed=7), _units(200, 5, seed=8)
    epochs = [rotating_epoch(first, 2 * first.total + 100, 0, 1, 2),
              rotating_epoch(second, second.total // 2, 0, 2, 2)]  # fmt: skip
    offsets = np.array([0, 300, 500], dtype=np.int64)
    asked = []

    def buckets(source, shard, local):
        asked.append((source, shard))
        return np.full(len(local), 10 * source + shard, dtype=np.int32)

    index = EpochShards(epochs, offsets, buckets, keep=2)
    assert index.num_shards == 11 and not asked  # counts and tokens without any shard's rows
    every = []
    for x in range(index.num_shards):
        n = int(index.starts[x + 1] - index.starts[x])
        ids, lengths, got_buckets, repeats = index.shard_rows(x, 0, n)
        assert np.array_equal(ids, np.sort(ids))
        assert int(lengths.sum()) == int(index.tokens[x])
        if repeats is not None:  # copies are adjacent: the k-th is repetition k
            for i in np.unique(ids):
                assert repeats[ids == i].tolist() == list(range(int((ids == i).sum())))
        source = 0 if x < 6 else 1
        assert (got_buckets == 10 * source + (x - 6 * source)).all()
        half = index.shard_rows(x, n // 2, n)[0]
        assert np.array_equal(half, ids[n // 2 :])
        every.append(ids)
    want = np.concatenate([e.documents() + o for e, o in zip(epochs, offsets)])
    assert np.array_equal(np.sort(np.concatenate(every)), np.sort(want))
