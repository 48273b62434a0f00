"""Splits of a preference cache: membership by pair (both sides share the record's key), in
pad and pack mode, shuffled and as evaluation passes."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import assert_resumable, eval_pass
from shardcache import ShardDataset, Split, StateError, open_cache
from shardcache.read.selection.splits import SPLIT_NAMES, split_ids

SPLIT = Split(validation=0.2, test=0.1)
PACK = {"mode": "pack", "seq_len": 64, "attention": "varlen"}


def pairs_of(batch) -> list[int]:
    """The pairs of a batch (pad or pack), each chosen then rejected, adjacent."""
    meta = batch["meta"]
    pairs, side, ids = (meta[k].tolist() for k in ("pair_ids", "side", "sample_ids"))
    out = []
    for k, s in enumerate(side):
        if s == 0:
            assert side[k + 1] == 1 and pairs[k + 1] == pairs[k]
            assert ids[k : k + 2] == [2 * pairs[k], 2 * pairs[k] + 1]
            out.append(pairs[k])
    return out


def split_pairs(path: str, name: str) -> list[int]:
    with open_cache(path) as cache:
        rows = split_ids(cache, SPLIT, name)
    assert np.array_equal(rows[1::2], rows[0::2] + 1)  # both sides of every pair, together
    return (rows[0::2] // 2).tolist()


def test_both_sides_of_a_pair_are_on_one_side(pairs_cache):
    with open_cache(pairs_cache) as cache:
        labels = SPLIT.labels(cache.document_keys())
    assert (labels[0::2] == labels[1::2]).all()
    counts = np.bincount(labels[0::2], minlength=3)
    assert counts.min() > 0 and counts.sum() == cache.num_sequences // 2
    parts = sorted(p for name in SPLIT_NAMES for p in split_pairs(pairs_cache, name))
    assert parts == list(range(cache.num_sequences // 2))


@pytest.mark.parametrize("extra", [{}, PACK])
def test_a_split_reads_exactly_its_pairs(pairs_cache, extra):
    want = split_pairs(pairs_cache, "validation")
    ds = ShardDataset(pairs_cache, 256, seed=3, split="validation", splits=SPLIT, streams=0,
                      **extra)  # fmt: skip
    got = [p for b in ds for p in pairs_of(b)]
    assert sorted(got) == want and len(got) == len(set(got))
    train = ShardDataset(pairs_cache, 256, seed=3, split="train", splits=SPLIT, streams=0, **extra)
    seen = [p for b in train for p in pairs_of(b)]
    assert sorted(seen) == split_pairs(pairs_cache, "train")
    assert not set(seen) & set(want)


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("extra", [{"streams": 0}, {"streams": 4}, {**PACK, "streams": 2}])
def test_an_eval_pass_covers_its_pairs_once_with_equal_batches_per_rank(
    pairs_cache, world, workers, extra
):
    want = split_pairs(pairs_cache, "validation")

    def make(rank):
        return ShardDataset(pairs_cache, 128, split="validation", splits=SPLIT, eval=True,
                            rank=rank, world_size=world, **extra)  # fmt: skip

    got = eval_pass(make, world, workers, pairs_of)
    assert sorted(got) == want  # every pair of the split exactly once


@pytest.mark.parametrize("extra", [{"streams": 2}, {**PACK, "streams": 0}])
def test_a_split_resumes_exactly(pairs_cache, extra):
    def make():
        return ShardDataset(pairs_cache, 128, seed=5, split="train", splits=SPLIT, **extra)

    full = assert_resumable(
        make, lambda ds: ds, key=lambda b: b["meta"]["sample_ids"].tolist(), steps=[0, 1, 4, 9]
    )
    assert len(full) > 9
    other = ShardDataset(pairs_cache, 128, seed=5, split="test", splits=SPLIT, **extra)
    with pytest.raises(StateError, match="split"):
        other.load_state_dict(make().state_dict())
