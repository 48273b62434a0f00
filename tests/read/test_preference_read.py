"""Pad-mode reading of preference caches: a pair's two rows adjacent in one batch, never split."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import assert_resumable
from shardcache import ConfigError, ShardDataset, open_cache


def _pairs_of(batch) -> list[int]:
    return batch["meta"]["pair_ids"][0::2].tolist()


def _check_batch(batch, cache, max_tokens: int) -> None:
    """Rows 2k, 2k + 1 of a batch are pair u's chosen then rejected side, read exactly."""
    meta = batch["meta"]
    ids, pairs, side = (meta[k].numpy() for k in ("sample_ids", "pair_ids", "side"))
    assert len(ids) % 2 == 0 and batch["input_ids"].numel() <= max_tokens
    assert (side == np.tile([0, 1], len(ids) // 2)).all()
    assert (pairs[0::2] == pairs[1::2]).all() and (ids == 2 * pairs + side).all()
    lengths = np.asarray(cache.lengths)
    for row, sample in enumerate(ids.tolist()):
        n = int(lengths[sample])
        assert batch["input_ids"][row, :n].tolist() == cache.read(sample).tolist()
        assert not batch["attention_mask"][row, n:].any()


@pytest.mark.parametrize("streams", [0, 1, 3])
def test_every_pair_once_both_rows_adjacent_within_budget(pairs_cache, streams):
    cache = open_cache(pairs_cache)
    ds = ShardDataset(pairs_cache, 96, seed=1, streams=streams, shuffle_block=64)
    seen: list[int] = []
    for batch in ds:
        _check_batch(batch, cache, 96)
        seen += _pairs_of(batch)
    assert len(seen) == len(set(seen))
    assert len(seen) >= 0.9 * cache.num_sequences // 2  # (streams even out: a few may drop)
    if streams == 0:
        assert sorted(seen) == list(range(cache.num_sequences // 2))


@pytest.mark.parametrize("streams", [0, 4])
def test_ranks_equal_batches_no_pair_on_two_ranks(pairs_cache, streams):
    cache = open_cache(pairs_cache)
    per_rank, counts = [], []
    for rank in range(4):
        ds = ShardDataset(
            pairs_cache, 64, seed=2, rank=rank, world_size=4, streams=streams, shuffle_block=64
        )
        batches = list(ds)
        counts.append(len(batches))
        assert len(batches) == ds.batches_per_rank() == len(ds)
        for batch in batches:
            _check_batch(batch, cache, 64)
        per_rank.append({p for b in batches for p in _pairs_of(b)})
    assert len(set(counts)) == 1 and counts[0] > 2
    total = sum(len(r) for r in per_rank)
    assert len(set().union(*per_rank)) == total


@pytest.mark.parametrize("streams", [0, 2])
def test_resume_is_exact(pairs_cache, streams):
    def make():
        return ShardDataset(pairs_cache, 128, seed=5, rank=1, world_size=2, streams=streams)

    full = assert_resumable(make, lambda ds: ds, key=lambda b: b["meta"]["sample_ids"].tolist())
    assert len(full) > 3


def test_budget_too_small_for_a_pair_says_how_much(pairs_cache):
    longest = int(np.asarray(open_cache(pairs_cache).lengths).max())
    with pytest.raises(ConfigError, match=f"at least {2 * longest}"):
        ShardDataset(pairs_cache, 2 * longest - 1, seed=0, streams=0)


def test_dataloader_workers_read_the_same_pairs(pairs_cache):
    from torch.utils.data import DataLoader

    ds = ShardDataset(pairs_cache, 96, seed=3, streams=2)
    alone = sorted(tuple(b["meta"]["sample_ids"].tolist()) for b in ds)
    loader = DataLoader(ds, batch_size=None, num_workers=2)
    workers = sorted(tuple(b["meta"]["sample_ids"].tolist()) for b in loader)
    assert workers == alone


def test_tail_report_counts_both_sides(pairs_cache):
    lengths = np.asarray(open_cache(pairs_cache).lengths)
    ds = ShardDataset(pairs_cache, 96, seed=0, streams=0, world_size=1, rank=0)
    batches = list(ds)
    assert sum(int(b["meta"]["num_tokens"]) for b in batches) == int(lengths.sum())
    report = ShardDataset(pairs_cache, 96, seed=0, streams=0, world_size=7, rank=0).tail_report()
    dropped = report["dropped_segments"]
    assert dropped % 2 == 0 and report["dropped_tokens"] <= int(lengths.sum())
