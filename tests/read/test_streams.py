"""Canonical streams: the plan each rank computes only its part of (read/plan/streams.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardcache.read.plan.epoch_plan import PlanOptions, plan_epoch, split_epoch
from shardcache.read.plan.streams import (
    ShardIndex,
    StreamLayout,
    StreamPlan,
    count_batches,
    order_mixing,
    own_streams,
    plan_block,
    seek_batch,
    split_batches,
    splittable,
)

OPTIONS = {
    "pad": PlanOptions(max_tokens=256, window_size=64),
    "best_fit": PlanOptions(max_tokens=256, mode="pack", seq_len=64, window_size=64),
    "concat": PlanOptions(
        max_tokens=256, mode="pack", seq_len=64, packing="concat", window_size=64
    ),
}


def synthetic(num_shards: int = 40, rows: int = 50, seed: int = 0) -> ShardIndex:
    """Bucket-homogeneous shards of random lengths, as a build writes them."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 2 * rows, num_shards)
    buckets = np.sort(rng.integers(0, 3, num_shards))
    edges = np.array([1, 16, 40, 64])
    lengths = np.concatenate(
        [rng.integers(edges[b], edges[b + 1], n) for b, n in zip(buckets, sizes)]
    ).astype(np.int32)
    starts = np.zeros(num_shards + 1, dtype=np.int64)
    np.cumsum(sizes, out=starts[1:])
    tokens = np.add.reduceat(lengths.astype(np.int64), starts[:-1])
    return ShardIndex(starts, tokens, buckets, lengths)


def stream_plan(index, options, streams, block, seed=0, epoch=0):
    layout = StreamLayout(index, streams, block, seed, epoch, options.shuffle)
    return StreamPlan(layout, options, count_batches(layout, options))


def covered(plan, lengths) -> np.ndarray:
    """Tokens of each sample id the plan's batches take (whole sequences or segments)."""
    taken = np.zeros(len(lengths), dtype=np.int64)
    for j in range(len(plan)):
        ids, _, seg = plan.segments(j)
        np.add.at(taken, ids, lengths[ids] if seg is None else seg)
    return taken


@pytest.mark.parametrize("mode", list(OPTIONS))
@pytest.mark.parametrize("shuffle", [True, False])
def test_one_stream_of_one_block_is_the_global_plan(mode, shuffle):
    index = synthetic()
    options = PlanOptions(**{**OPTIONS[mode].to_json(), "shuffle": shuffle})
    ours = stream_plan(index, options, streams=1, block=10**9, seed=3, epoch=2)
    theirs = plan_epoch(
        index.lengths, np.repeat(index.buckets, np.diff(index.starts)), options, 3, 2
    )
    assert len(ours) == len(theirs)
    for j in range(len(theirs)):
        for a, b in zip(ours.packed_segments(j), theirs.packed_segments(j)):
            assert (a is None and b is None) or np.array_equal(a, b)


@settings(max_examples=40, deadline=None)
@given(
    mode=st.sampled_from(list(OPTIONS)),
    tail=st.sampled_from(["drop", "wrap"]),
    streams=st.integers(1, 12),
    block=st.integers(1, 400),
    seed=st.integers(0, 3),
    shards=st.integers(1, 30),
)
def test_every_sequence_is_planned_once_within_budget(mode, tail, streams, block, seed, shards):
    index = synthetic(shards, 20, seed)
    options = PlanOptions(**{**OPTIONS[mode].to_json(), "tail": tail})
    plan = stream_plan(index, options, streams, block, seed)
    lengths = index.lengths.astype(np.int64)
    # every batch of every stream once (``tail`` evens ranks out later, in split_epoch)
    assert np.array_equal(covered(plan, lengths), lengths)
    assert len(plan) == int(plan.stream_batches.sum())
    # shorter streams cut batches in two to be as long as the longest, where they can
    counts = plan.counts()
    planned = np.array([int(counts[s][0].sum()) for s in range(streams)])
    cuttable = np.array([int(counts[s][1].sum()) for s in range(streams)])
    expected = np.minimum(planned + cuttable, planned.max())
    assert plan.stream_batches.tolist() == expected.tolist()
    assert plan.split_total == int((expected - planned).sum())
    for j in range(len(plan)):
        ids, _, _ = plan.segments(j)
        rows = len(plan.row_bounds(j)) - 1
        if options.mode == "pad":
            assert rows * int(index.lengths[ids].max()) <= options.max_tokens
        else:
            assert rows <= options.max_tokens // options.seq_len


class _RoundsOnly:
    """A stream plan seen up to its last whole round (what a rank reads from its own streams)."""

    def __init__(self, plan: StreamPlan) -> None:
        self.plan, self.layout, self.full = plan, plan.layout, plan.full

    def __len__(self) -> int:
        return self.full

    def batch(self, index: int) -> np.ndarray:
        return self.plan.batch(index)


def test_a_rank_reads_only_its_streams_shards_in_the_full_rounds():
    index = synthetic(64, 40)
    options = OPTIONS["pad"]
    streams, world = 8, 4
    plan = stream_plan(index, options, streams, block=300, seed=1)
    starts = index.starts
    assert plan.full > 0
    if len(plan) > plan.full:  # the longer streams' last batches: dealt to every rank
        plan = _RoundsOnly(plan)
    for start in (0, 5):  # a resumed cursor moves every rank to other streams, still local
        split = split_epoch(len(plan), world, start)
        for rank in range(world):
            mine = {(start + rank + s) % streams for s in range(0, streams, world)}
            allowed = set(np.concatenate([plan.layout.shards_of_stream(s) for s in mine]).tolist())
            for j in split.for_rank(rank).tolist():  # every batch: no tail outside the rounds
                ids = plan.batch(j)
                shards = set((np.searchsorted(starts, ids, side="right") - 1).tolist())
                assert shards <= allowed, (rank, j)


def test_streams_share_the_shards_by_tokens():
    index = synthetic(200, 40)
    layout = StreamLayout(index, 8, 1000, 0, 0, True)
    tokens = [
        int(np.sum(index.lengths[layout.block_ids(s, b)[0]], dtype=np.int64))
        for s in range(8)
        for b in range(int(layout.blocks[s]))
    ]
    per_stream = np.add.reduceat(tokens, np.r_[0, np.cumsum(layout.blocks)[:-1]])
    longest = int(index.lengths.max())
    assert per_stream.max() - per_stream.min() <= 2 * longest  # cut at row boundaries
    # every shard is read by one stream, or two where a boundary falls inside it
    owners = np.concatenate([layout.shards_of_stream(s) for s in range(8)])
    assert set(owners.tolist()) == set(range(200))
    assert len(owners) <= 200 + 7


def test_counts_computed_by_each_rank_for_its_own_streams_give_the_same_plan():
    index = synthetic(50, 40)
    options = OPTIONS["best_fit"]
    layout = StreamLayout(index, 6, 200, 2, 1, True)
    counts: dict[int, np.ndarray] = {}
    for rank in range(4):
        counts.update(count_batches(layout, options, own_streams(6, rank, 4)))
    shared = StreamPlan(layout, options, counts)
    alone = StreamPlan(layout, options, count_batches(layout, options))
    assert len(shared) == len(alone)
    for j in range(len(alone)):
        assert np.array_equal(shared.batch(j), alone.batch(j))


def test_the_order_changes_with_the_epoch_and_holds_for_a_seed():
    index = synthetic(40, 40)
    options = OPTIONS["pad"]
    first = stream_plan(index, options, 4, 200, seed=0, epoch=0)
    again = stream_plan(index, options, 4, 200, seed=0, epoch=0)
    other = stream_plan(index, options, 4, 200, seed=0, epoch=1)
    assert [first.batch(j).tolist() for j in range(len(first))] == [
        again.batch(j).tolist() for j in range(len(again))
    ]
    assert [first.batch(j).tolist() for j in range(len(first))] != [
        other.batch(j).tolist() for j in range(len(other))
    ]


def test_a_mixture_index_plans_its_chosen_rows_with_repeats():
    base = synthetic(10, 30)
    # every document of shard 0 twice, of the others once: rows list sample ids by shard
    n0 = int(base.starts[1])
    rows = np.concatenate([np.repeat(np.arange(n0), 2), np.arange(n0, int(base.starts[-1]))])
    starts = base.starts.copy()
    starts[1:] += n0
    tokens = base.tokens.copy()
    tokens[0] *= 2
    index = ShardIndex(starts, tokens, base.buckets, base.lengths, rows=rows)
    plan = stream_plan(index, OPTIONS["pad"], 3, 50)
    lengths = base.lengths.astype(np.int64)
    taken = covered(plan, lengths)
    expected = base.lengths.astype(np.int64).copy()
    expected[:n0] *= 2
    assert np.array_equal(taken, expected)


@pytest.mark.parametrize("streams,block", [(1, 10**9), (5, 37), (3, 200)])
def test_concat_counts_by_tokens_equal_the_planned_batches(streams, block):
    index = synthetic(30, 40, seed=4)
    options = OPTIONS["concat"]
    layout = StreamLayout(index, streams, block, 1, 0, True)
    counted = count_batches(layout, options)
    for s in range(streams):
        plans = [plan_block(layout, options, s, b) for b in range(int(layout.blocks[s]))]
        assert counted[s][0].tolist() == [len(p) for p in plans]
        assert counted[s][1].tolist() == [splittable(p) for p in plans]
        for b in range(int(layout.blocks[s])):
            ids, _ = layout.block_ids(s, b)
            assert layout.block_tokens(s, b) == int(index.lengths[ids].astype(np.int64).sum())


def test_the_default_block_mixes_an_epoch_within_its_documented_bound():
    # docs/guide/scale.md: at the default shuffle_block, 8 streams over 32 groups of shards
    # (about the input files) in 20 time slices: TV mean <= 0.1 and |Spearman| <= 0.05 (a
    # global shuffle gives ~0.005; the cache's own order 0.92 and 1)
    rng = np.random.default_rng(0)
    n, rows = 2_000_000, 1000
    lengths = np.clip(rng.lognormal(5.0, 0.8, n), 16, 2048).astype(np.int32)
    starts = np.arange(0, n + 1, rows, dtype=np.int64)
    buckets = np.zeros(n // rows, dtype=np.int64)  # (one bucket: the mixing is the shards')
    tokens = np.add.reduceat(lengths.astype(np.int64), starts[:-1])
    index = ShardIndex(starts, tokens, buckets, lengths)
    options = PlanOptions(max_tokens=65536, mode="pack", seq_len=2048, packing="concat")
    plan = stream_plan(index, options, streams=8, block=options.shuffle_block)
    got = np.concatenate([plan.batch(j) for j in range(len(plan))])
    mixing = order_mixing(got, starts)
    assert mixing["tv"] <= 0.1 and abs(mixing["spearman"]) <= 0.05, mixing
    assert order_mixing(np.arange(n), starts)["tv"] > 0.9  # the measure sees an unmixed order


@pytest.mark.parametrize("mode", list(OPTIONS))
def test_a_split_batch_keeps_its_segments_within_the_budget(mode):
    index = synthetic(20, 40, seed=2)
    options = OPTIONS[mode]
    layout = StreamLayout(index, 1, 10**9, 0, 0, True)
    plan = plan_block(layout, options, 0, 0)
    n = splittable(plan)
    assert n > 0
    cut = split_batches(plan, n)
    assert len(cut) == len(plan) + n
    assert np.array_equal(cut.sample_ids, plan.sample_ids)  # same segments, same order
    lengths = index.lengths.astype(np.int64)
    for j in range(len(cut)):
        ids = cut.batch(j)
        rows = len(cut.row_bounds(j)) - 1
        assert rows >= 1
        if options.mode == "pad":
            assert rows * int(lengths[ids].max()) <= options.max_tokens
        else:
            assert rows <= options.max_tokens // options.seq_len
    with pytest.raises(ValueError):
        split_batches(plan, n + 1)


@pytest.mark.parametrize("mode", list(OPTIONS))
@pytest.mark.parametrize("streams,block", [(3, 40), (4, 10**9), (7, 25)])
def test_seeking_one_stream_gives_the_plans_batches(mode, streams, block):
    # planning the asked stream alone, with the longest stream's length, cuts as the plan does
    options = OPTIONS[mode]
    plan = stream_plan(synthetic(seed=3), options, streams, block, seed=5, epoch=2)
    longest = int(plan.stream_batches.max())
    assert plan.split_total > 0 or mode == "concat"  # (the cuts are exercised)
    for s in range(streams):
        for k in range(int(plan.stream_batches[s])):
            want, at = plan.stream_batch(s, k)
            got, place = seek_batch(plan.layout, options, s, k, longest)
            assert np.array_equal(got.batch(place), want.batch(at))
            assert np.array_equal(got.row_bounds(place), want.row_bounds(at))
    with pytest.raises(IndexError):
        seek_batch(plan.layout, options, 0, int(plan.stream_batches[0]), longest)
