from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardcache import ConfigError, PlanOptions, plan_epoch
from shardcache.read.plan.epoch_plan import split_epoch, worker_batches


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 300), min_size=1, max_size=400),
    st.integers(300, 5000),
    st.integers(1, 64),
    st.integers(1, 8),
    st.booleans(),
    st.integers(0, 3),
)
def test_budget_and_exact_coverage(lengths, max_tokens, window, multiple, shuffle, seed):
    lengths = np.asarray(lengths)
    buckets = np.searchsorted([16, 64, 128], lengths)
    options = PlanOptions(
        max_tokens=max(max_tokens, 300 + multiple),
        shuffle=shuffle,
        pad_to_multiple_of=multiple,
        window_size=window,
    )
    plan = plan_epoch(lengths, buckets, options, seed=seed)
    assert sorted(plan.sample_ids.tolist()) == list(range(len(lengths)))  # each once
    for i in range(len(plan)):
        ids = plan.batch(i)
        assert len(ids) >= 1
        width = -(-int(lengths[ids].max()) // multiple) * multiple
        assert len(ids) * width <= options.max_tokens
        assert len(set(buckets[ids].tolist())) == 1  # one bucket per batch


def test_deterministic_and_reshuffled_per_epoch():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 500, size=3000)
    buckets = np.searchsorted([128, 256], lengths)
    options = PlanOptions(max_tokens=2048, window_size=256)
    a = plan_epoch(lengths, buckets, options, seed=1, epoch=0)
    b = plan_epoch(lengths, buckets, options, seed=1, epoch=0)
    c = plan_epoch(lengths, buckets, options, seed=1, epoch=1)
    assert np.array_equal(a.sample_ids, b.sample_ids)
    assert np.array_equal(a.batch_offsets, b.batch_offsets)
    assert not np.array_equal(a.sample_ids, c.sample_ids)


def test_unshuffled_plan_follows_sample_order_within_windows():
    lengths = np.array([5, 3, 8, 1])
    plan = plan_epoch(lengths, np.zeros(4, dtype=int), PlanOptions(max_tokens=8, shuffle=False))
    assert [plan.batch(i).tolist() for i in range(len(plan))] == [[2], [0], [1, 3]]


def test_sequence_longer_than_budget_is_a_config_error():
    with pytest.raises(ConfigError, match="max_tokens: 100 is smaller than the longest"):
        plan_epoch(np.array([50, 101]), np.zeros(2, dtype=int), PlanOptions(max_tokens=100))


def test_empty_cache_plans_no_batches():
    plan = plan_epoch(np.zeros(0, dtype=int), np.zeros(0, dtype=int), PlanOptions(max_tokens=8))
    assert len(plan) == 0


@pytest.mark.parametrize(
    "field,value", [("max_tokens", 0), ("pad_to_multiple_of", 0), ("window_size", -1)]
)
def test_options_validated(field, value):
    kwargs = {"max_tokens": 10, field: value}
    with pytest.raises(ConfigError, match=field):
        PlanOptions(**kwargs)


# ---- pack modes ------------------------------------------------------------------------------

lengths_st = st.lists(st.integers(1, 300), min_size=1, max_size=300)


def _segments(plan):
    for i in range(len(plan)):
        ids, starts, taken = plan.segments(i)
        yield i, ids, starts, taken


@settings(max_examples=60, deadline=None)
@given(lengths_st, st.integers(300, 3000), st.integers(1, 64), st.booleans(), st.integers(0, 3),
       st.sampled_from(["best_fit", "concat"]))  # fmt: skip
def test_pack_rows_fit_and_cover_exactly(lengths, max_tokens, window, shuffle, seed, packing):
    lengths = np.asarray(lengths)
    seq_len = 300 if packing == "best_fit" else int(np.random.default_rng(seed).integers(1, 301))
    options = PlanOptions(max_tokens=max(max_tokens, seq_len), shuffle=shuffle,
                          window_size=window, mode="pack", seq_len=seq_len,
                          packing=packing)  # fmt: skip
    plan = plan_epoch(lengths, np.zeros(len(lengths), dtype=int), options, seed=seed)
    covered = {}
    for i, ids, starts, taken in _segments(plan):
        rows = plan.row_bounds(i)
        # the reader's one-call lookup agrees with segments() + row_bounds()
        got = plan.packed_segments(i)
        assert np.array_equal(got[0], ids) and np.array_equal(got[1], starts)
        assert (got[2] is None) == (taken is None) and np.array_equal(got[3], rows)
        assert taken is None or np.array_equal(got[2], taken)
        assert 1 <= len(rows) - 1 <= options.rows_per_batch  # rows x seq_len <= max_tokens
        seg = lengths[ids] if taken is None else taken
        for a, b in itertools.pairwise(rows.tolist()):
            assert b > a and int(seg[a:b].sum()) <= seq_len  # a row holds <= seq_len
        for sid, start, n in zip(ids.tolist(), starts.tolist(), seg.tolist()):
            covered.setdefault(sid, []).append((start, n))
    # every token of every sequence exactly once (best_fit: whole sequences, once)
    assert sorted(covered) == list(range(len(lengths)))
    for sid, pieces in covered.items():
        pieces.sort()
        assert pieces[0][0] == 0 and sum(n for _, n in pieces) == lengths[sid]
        assert all(a[0] + a[1] == b[0] for a, b in itertools.pairwise(pieces))
        if packing == "best_fit":
            assert len(pieces) == 1
    if len(plan) > 1:  # only the last batch may be short
        assert all(len(plan.row_bounds(i)) - 1 == options.rows_per_batch
                   for i in range(len(plan) - 1))  # fmt: skip


def test_best_fit_is_tight_and_concat_pads_only_the_last_row():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 512, size=5000)
    zeros = np.zeros(len(lengths), dtype=int)
    fit = plan_epoch(lengths, zeros, PlanOptions(8192, mode="pack", seq_len=1024), seed=1)
    rows = sum(len(fit.row_bounds(i)) - 1 for i in range(len(fit)))
    assert lengths.sum() / (rows * 1024) > 0.99
    cat = plan_epoch(lengths, zeros, PlanOptions(8192, mode="pack", seq_len=1024,
                                                 packing="concat"), seed=1)  # fmt: skip
    rows = sum(len(cat.row_bounds(i)) - 1 for i in range(len(cat)))
    assert rows == -(-int(lengths.sum()) // 1024)


def test_best_fit_refuses_a_sequence_longer_than_seq_len():
    with pytest.raises(ConfigError, match="packing='concat'"):
        plan_epoch(np.array([5, 20]), np.zeros(2, dtype=int),
                   PlanOptions(64, mode="pack", seq_len=10))  # fmt: skip


@pytest.mark.parametrize("kwargs,match", [
    ({"mode": "nope"}, "mode: got 'nope', expected one of pad, pack"),
    ({"mode": "pack"}, "seq_len: mode='pack' needs seq_len"),
    ({"seq_len": 8}, "seq_len: got 8 with mode='pad'"),
    ({"mode": "pack", "seq_len": 20}, "seq_len: 20 exceeds max_tokens=10"),
    ({"mode": "pack", "seq_len": 8, "packing": "first_fit"}, "packing: .* best_fit, concat"),
    ({"tail": "pad"}, "tail: got 'pad', expected one of drop, wrap"),
    ({"mode": "pack", "seq_len": 8, "pad_to_multiple_of": 4}, "pad_to_multiple_of"),
])  # fmt: skip
def test_pack_options_validated(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        PlanOptions(max_tokens=10, **kwargs)


def test_options_json_round_trip():
    options = PlanOptions(64, mode="pack", seq_len=32, packing="concat", tail="wrap")
    assert PlanOptions.from_json(options.to_json()) == options
    with pytest.raises(ConfigError, match="unknown field"):
        PlanOptions.from_json({**options.to_json(), "batch": 3})


# ---- split over ranks and workers ------------------------------------------------------------


def _dataloader_order(workers: list[np.ndarray]) -> list[int]:
    """The order in which a DataLoader collects from iterable workers: round-robin over the
    workers still running (a worker that is exhausted is skipped from then on)."""
    queues, out = [list(w) for w in workers], []
    active = list(range(len(queues)))
    while active:
        for w in list(active):
            if queues[w]:
                out.append(queues[w].pop(0))
            else:
                active.remove(w)
    return out


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 60), st.integers(1, 8), st.integers(0, 4), st.integers(0, 70),
       st.sampled_from(["drop", "wrap"]))  # fmt: skip
def test_split_equal_counts_exact_coverage_and_worker_independence(n, world, workers, start, tail):
    split = split_epoch(n, world, start=start, tail=tail)
    per_rank = [split.for_rank(r) for r in range(world)]
    assert {len(b) for b in per_rank} == {split.batches_per_rank}
    delivered = np.concatenate(per_rank)
    remaining = list(range(start, n))
    expected = sorted([b for b in remaining if b not in set(split.dropped.tolist())]
                      + split.repeated.tolist())  # fmt: skip
    assert sorted(delivered.tolist()) == expected
    if tail == "drop":
        assert len(split.repeated) == 0 and len(split.dropped) == len(remaining) % world
        assert len(set(delivered.tolist())) == len(delivered)
    else:
        assert len(split.dropped) == 0 and len(split.repeated) < world
    for rank_batches in per_rank:  # the stream of a rank does not depend on num_workers
        if workers:
            parts = [worker_batches(rank_batches, w, workers) for w in range(workers)]
            assert _dataloader_order(parts) == rank_batches.tolist()
    # "every rank took k batches" is the global cursor start + k * world
    for k in range(split.batches_per_rank + 1):
        head = sorted(int(b) for r in per_rank for b in r[:k])
        if tail == "drop":
            assert head == list(range(start, start + k * world))


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 80), st.integers(1, 8), st.integers(1, 8), st.integers(0, 10))
def test_elastic_resume_continues_with_the_batches_not_consumed(n, world, new_world, k):
    first = split_epoch(n, world)
    k = min(k, first.batches_per_rank)
    head = [int(b) for r in range(world) for b in first.for_rank(r)[:k]]
    rest = split_epoch(n, new_world, start=k * world)
    tail = [int(b) for r in range(new_world) for b in rest.for_rank(r)]
    assert sorted(head + tail) == [b for b in range(n) if b not in set(rest.dropped.tolist())]
    assert len(rest.dropped) < new_world


def test_split_validates():
    with pytest.raises(ConfigError, match="world_size"):
        split_epoch(3, 0)
    with pytest.raises(ConfigError, match="rank"):
        split_epoch(3, 2).for_rank(2)
    with pytest.raises(ConfigError, match="tail"):
        split_epoch(3, 2, tail="pad")


def _reference_concat(lengths: np.ndarray, seq_len: int, order: np.ndarray) -> tuple:
    """The concat plan's segments the obvious way: all cuts (document ends, row ends) merged
    by a sort, each segment's document found by a search."""
    doc_len = lengths[order].astype(np.int64)
    doc_end = np.cumsum(doc_len)
    total = int(doc_end[-1])
    num_rows = -(-total // seq_len)
    cuts = np.unique(np.concatenate([doc_end[:-1], np.arange(1, num_rows) * seq_len]))
    begin = np.r_[0, cuts].astype(np.int64)
    end = np.r_[cuts, total].astype(np.int64)
    doc = np.searchsorted(doc_end, begin, side="right")
    rows = np.searchsorted(begin // seq_len, np.arange(num_rows + 1), side="left")
    return order[doc], begin - (doc_end[doc] - doc_len[doc]), end - begin, rows


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=80), st.integers(1, 40),
       st.booleans(), st.booleans(), st.integers(0, 5))  # fmt: skip
def test_concat_segments_equal_the_sorted_merge_of_all_cuts(units, seq_len, on_rows, shuffle,
                                                            seed):  # fmt: skip
    """The concat planner places every cut arithmetically; it must equal merging the document
    ends and row ends by a sort, including documents that end exactly on a row's end (a cut
    of both kinds, counted once)."""
    rng = np.random.default_rng(seed)
    lengths = np.asarray(units) * (seq_len if on_rows else rng.integers(1, 30))
    options = PlanOptions(max_tokens=seq_len * 2, shuffle=shuffle, mode="pack", seq_len=seq_len,
                          packing="concat")  # fmt: skip
    plan = plan_epoch(lengths, np.zeros(len(lengths), dtype=int), options, seed=seed)
    order = np.unique(plan.sample_ids, return_index=True)
    first_seen = plan.sample_ids[np.sort(order[1])]  # the documents in packing order
    sample_ids, starts, taken, rows = _reference_concat(lengths, seq_len, first_seen)
    assert np.array_equal(plan.sample_ids, sample_ids)
    assert np.array_equal(plan.seg_starts, starts) and np.array_equal(plan.seg_lengths, taken)
    assert np.array_equal(plan.row_offsets, rows)
