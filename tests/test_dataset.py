from __future__ import annotations

import collections

import pytest
import torch
from torch.utils.data import DataLoader

from shardcache import ShardDataset, open_cache


@pytest.fixture()
def cache_dir(corpus, build_cache, tokenizer_dir):
    folder, _ = corpus("jsonl", n_files=3, docs=60)
    return build_cache(folder, tokenizer_dir, max_length=64, truncation="split", buckets="8,16,32")


def _stream(ds, num_workers):
    loader = DataLoader(ds, batch_size=None, num_workers=num_workers)
    return [{k: v.clone() for k, v in b.items()} for b in loader]


def test_batches_are_padded_within_budget_and_cover_every_sequence(cache_dir):
    cache = open_cache(cache_dir)
    ds = ShardDataset(cache_dir, max_tokens=256, seed=3)
    batches = _stream(ds, 0)
    seen = collections.Counter()
    for b in batches:
        ids, mask, labels = b["input_ids"], b["attention_mask"], b["labels"]
        assert ids.dtype == torch.int64 and ids.shape == mask.shape == labels.shape
        assert ids.shape[0] * ids.shape[1] <= 256
        assert torch.equal(labels[mask == 0], torch.full_like(labels[mask == 0], -100))
        assert torch.equal(labels[mask == 1], ids[mask == 1])
        assert torch.all(ids[mask == 0] == cache.pad_id)
        buckets = cache.buckets()[b["sample_ids"].numpy()]
        assert len(set(buckets.tolist())) == 1
        for row, sid in enumerate(b["sample_ids"].tolist()):
            n = int(mask[row].sum())
            assert ids[row, :n].tolist() == cache.read(sid).tolist()
            seen[sid] += 1
    assert sorted(seen) == list(range(cache.num_sequences)) and set(seen.values()) == {1}


@pytest.mark.parametrize("num_workers", [1, 2])
def test_stream_independent_of_num_workers(cache_dir, num_workers):
    ds = ShardDataset(cache_dir, max_tokens=128, seed=0)
    base = [b["sample_ids"].tolist() for b in _stream(ds, 0)]
    other = [b["sample_ids"].tolist() for b in _stream(ds, num_workers)]
    assert base == other


def test_ranks_partition_batches_with_equal_counts(cache_dir):
    world = 3
    streams = [
        [
            b["sample_ids"].tolist()
            for b in _stream(ShardDataset(cache_dir, max_tokens=128, rank=r, world_size=world), 0)
        ]
        for r in range(world)
    ]
    assert len({len(s) for s in streams}) == 1
    flat = [sid for s in streams for b in s for sid in b]
    assert len(flat) == len(set(flat))
    ds = ShardDataset(cache_dir, max_tokens=128, world_size=world, rank=0)
    assert ds.batches_per_rank() == len(streams[0])


def test_set_epoch_reshuffles(cache_dir):
    ds = ShardDataset(cache_dir, max_tokens=128, seed=0)
    first = [b["sample_ids"].tolist() for b in _stream(ds, 0)]
    ds.set_epoch(1)
    second = [b["sample_ids"].tolist() for b in _stream(ds, 0)]
    assert first != second
    assert sorted(x for b in first for x in b) == sorted(x for b in second for x in b)


def test_pad_to_multiple_of(cache_dir):
    ds = ShardDataset(cache_dir, max_tokens=512, pad_to_multiple_of=8)
    assert all(b["input_ids"].shape[1] % 8 == 0 for b in _stream(ds, 0))
