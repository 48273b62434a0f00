"""Cache.gather (vectorised reads) equals reading sequence by sequence, for memory-mapped and
zstd shards, whole sequences and pieces, shuffled and consecutive segments."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import make_texts, write_records
from shardcache import open_cache
from shardcache.builder.run import build_cache
from shardcache.config import build_options_from_mapping
from shardcache.store import cache as cache_module
from shardcache.store import shards as shards_module


@pytest.fixture(scope="module")
def caches(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("gather")
    folder = root / "in"
    folder.mkdir()
    write_records(str(folder / "a.jsonl"), [{"text": t} for t in make_texts(80, seed=4)], "jsonl")
    out = {}
    for compression in ("none", "zstd"):
        path = str(root / compression)
        values = {
            "input": str(folder),
            "tokenizer": tokenizer_dir,
            "output": path,
            "workers": 1,
            "shard_size": 4096,
            "buckets": "16,64",
            "compression": compression,
        }
        build_cache(build_options_from_mapping(values))
        out[compression] = path
    return out


segments = st.lists(
    st.tuples(st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 10**6), st.booleans()),
    min_size=1,
    max_size=40,
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(segments, st.sampled_from(["none", "zstd"]), st.booleans(), st.booleans())
def test_gather_equals_reading_sequence_by_sequence(caches, segs, compression, run, by_slices):
    cache = open_cache(caches[compression])
    # both copy strategies (memory-mapped shards and decoded zstd record batches): a slice per
    # segment, or index arrays
    shards_module.LONG_SEGMENT_TOKENS = 0 if by_slices else 10**9
    seqs = [s.ids for s in cache.iter_sequences()]
    n = len(seqs)
    first = segs[0][0] % n
    # run: consecutive sample ids (an unshuffled read); else arbitrary ids
    ids = np.array([(first + k) % n if run else a % n for k, (a, _, _, _) in enumerate(segs)])
    starts, lengths = [], []
    for i, (_, b, c, whole) in zip(ids, segs):
        size = len(seqs[i])
        start = 0 if whole else b % size
        starts.append(start)
        lengths.append(size - start if whole else 1 + c % (size - start))
    got = cache.gather(ids, np.array(starts), np.array(lengths))
    want = np.concatenate([seqs[i][s : s + m] for i, s, m in zip(ids, starts, lengths)])
    assert got.tokens.dtype == cache.dtype
    assert np.array_equal(got.tokens, want)
    assert np.array_equal(got.lengths, lengths)
    whole = cache.gather(ids)
    assert np.array_equal(whole.tokens, np.concatenate([seqs[i] for i in ids]))
    # laid out in padded rows, cast on the way (a pad batch's input_ids)
    width = max(lengths) + 3
    layout = (np.arange(len(ids)) * width, len(ids) * width)
    rows = cache.gather(ids, np.array(starts), np.array(lengths), dtype=np.int32,
                        layout=layout, fill=-1).tokens.reshape(len(ids), width)  # fmt: skip
    assert rows.dtype == np.int32
    for row, i, s, m in zip(rows, ids, starts, lengths):
        assert np.array_equal(row[:m], seqs[i][s : s + m]) and np.all(row[m:] == -1)


@pytest.fixture(autouse=True)
def _restore_threshold():
    saved = shards_module.LONG_SEGMENT_TOKENS
    yield
    shards_module.LONG_SEGMENT_TOKENS = saved


@pytest.mark.parametrize("threshold", [0, 10**9])
def test_gather_refuses_ids_and_segments_out_of_range(caches, threshold):
    shards_module.LONG_SEGMENT_TOKENS = threshold
    cache = open_cache(caches["none"])
    with pytest.raises(IndexError, match="out of range"):
        cache.gather(np.array([cache.num_sequences]))
    size = int(cache.lengths[0])
    with pytest.raises(IndexError, match="past the end"):
        cache.gather(np.array([0]), np.array([size - 1]), np.array([2]))


def _one_file_cache(factory, tokenizer_dir, name, docs, seed, **options) -> str:
    """A cache built from one jsonl file of ``docs`` texts, with ``options``."""
    root = factory.mktemp(name)
    folder = root / "in"
    folder.mkdir()
    texts = make_texts(docs, seed=seed)
    write_records(str(folder / "a.jsonl"), [{"text": t} for t in texts], "jsonl")
    values = {"input": str(folder), "tokenizer": tokenizer_dir, "output": str(root / "c"),
              "workers": 1, **options}  # fmt: skip
    build_cache(build_options_from_mapping(values))
    return str(root / "c")


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory, tokenizer_dir):
    return _one_file_cache(tmp_path_factory, tokenizer_dir, "gather-many", 80, 5,
                           shard_size=4096, buckets="6,8,10,12,14,16,20,24,32,64")  # fmt: skip


@pytest.mark.parametrize("open_shards", [1, 2, 3])
def test_gathers_over_more_shards_than_the_lru_holds(many_shards, open_shards):
    """Opening a shard may evict another shard of the same batch from the LRU: its tokens are
    still copied (a batch of shuffled reads touches more shards than the LRU holds)."""
    shards_module.LONG_SEGMENT_TOKENS = 0  # slice copies of memory-mapped shards
    reference = open_cache(many_shards)
    seqs = [s.ids for s in reference.iter_sequences()]
    cache = cache_module.Cache(many_shards, open_shards=open_shards)
    starts = cache.shard_starts
    assert len(cache.shards) > 4
    rng = np.random.default_rng(open_shards)
    firsts = [int(starts[k]) for k in range(len(cache.shards))]
    batches = [[firsts[1]], [firsts[2]], [firsts[1], firsts[3]], firsts]
    batches += [rng.choice(len(seqs), 12).tolist() for _ in range(20)]
    for ids in batches:
        got = cache.gather(np.array(ids))
        assert np.array_equal(got.tokens, np.concatenate([seqs[i] for i in ids]))


@pytest.fixture(scope="module")
def short_rows(tmp_path_factory, tokenizer_dir):
    """A cache of a few large shards of many short rows (documents split to 4 tokens)."""
    return _one_file_cache(tmp_path_factory, tokenizer_dir, "gather-short", 1500, 6,
                           max_length=4, truncation="split", buckets="4")  # fmt: skip


@pytest.mark.parametrize("kernels", [False, True])
def test_an_open_shard_keeps_no_arrays_per_row(short_rows, kernels):
    """The row starts of an open shard live in the cache's one table (4 bytes a row); a
    reader keeps hundreds of shards open, so none keeps its own starts and lengths (16 bytes
    a row: 8 MB for a 64 MiB shard of 32-token rows)."""
    import gc
    import tracemalloc

    from shardcache import ShardDataset
    from shardcache.read.collate import layout as collate

    rows = open_cache(short_rows).num_sequences
    assert rows > 5000
    ds = ShardDataset(short_rows, max_tokens=64, shuffle=False)
    ds.kernels = kernels
    ds.plan()  # the plan and the cache's table are O(rows) by design: made before measuring
    ds._selection._cache._starts_table()
    collate._ramp(1, np.dtype(np.int64))  # a process-wide 64k ramp the numpy path keeps
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        plan = ds.plan()
        for index in range(len(plan)):  # every batch, outside a pass: its shards stay open
            ds.collate_batch(plan, index)
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert ds._selection._cache._shards._open  # the shards are still open
    assert kept < 4 * rows, f"{kept} bytes kept for {rows} rows"
