"""Pack-mode reading of preference caches: a pair's two sequences whole in one packed row."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import assert_resumable
from shardcache import ConfigError, ShardDataset, open_cache

SEQ_LEN = 64


def pack(path: str, max_tokens: int = 4 * SEQ_LEN, **options) -> ShardDataset:
    options.setdefault("attention", "varlen")
    return ShardDataset(path, max_tokens, mode="pack", seq_len=SEQ_LEN, **options)


def check_packed(batch, cache, max_tokens: int) -> list[int]:
    """Every segment is a whole stored sequence; a pair's two are adjacent, chosen first, in one
    row; padding is one segment at a row's end, in no pair. Returns the pairs, in order."""
    ids, labels, positions = batch["input_ids"], batch["labels"], batch["position_ids"]
    width = ids.shape[1]
    assert width == SEQ_LEN and ids.numel() <= max_tokens
    meta = batch["meta"]
    cu = meta["cu_seqlens"].tolist()
    sample, offsets = meta["sample_ids"].tolist(), meta["sample_offsets"].tolist()
    pairs, side = meta["pair_ids"].tolist(), meta["side"].tolist()
    assert len(cu) - 1 == len(sample) == len(pairs) == len(side) == len(offsets)
    assert cu[0] == 0 and cu[-1] == ids.numel()
    flat_ids, flat_labels = ids.reshape(-1), labels.reshape(-1)
    flat_pos = positions.reshape(-1)
    lengths = np.asarray(cache.lengths)
    seen, k = [], 0
    while k < len(sample):
        a, e = cu[k], cu[k + 1]
        assert a // width == (e - 1) // width  # a segment never crosses a row
        assert flat_pos[a:e].tolist() == list(range(e - a))
        if sample[k] < 0:  # padding: the rest of its row, no loss, no pair
            assert (pairs[k], side[k], offsets[k]) == (-1, -1, -1)
            assert e % width == 0 and (flat_labels[a:e] == -100).all()
            k += 1
            continue
        # chosen at k, rejected at k + 1: one pair, one row, whole sequences
        assert side[k : k + 2] == [0, 1] and pairs[k] == pairs[k + 1]
        assert sample[k : k + 2] == [2 * pairs[k], 2 * pairs[k] + 1]
        assert cu[k] // width == (cu[k + 2] - 1) // width
        for j in (k, k + 1):
            a, e = cu[j], cu[j + 1]
            assert offsets[j] == 0 and e - a == int(lengths[sample[j]])
            assert flat_ids[a:e].tolist() == cache.read(sample[j]).tolist()
            mask = cache.read_masks(np.array([sample[j]]))[0]
            want = np.where(mask, flat_ids[a:e].numpy(), -100)
            want[0] = -100
            assert flat_labels[a:e].tolist() == want.tolist()
        seen.append(pairs[k])
        k += 2
    assert int(meta["num_tokens"]) == sum(int(lengths[2 * p] + lengths[2 * p + 1]) for p in seen)
    return seen


@pytest.mark.parametrize("streams", [0, 1, 3])
def test_every_pair_once_whole_in_one_row(pairs_cache, streams):
    cache = open_cache(pairs_cache)
    seen: list[int] = []
    for batch in pack(pairs_cache, seed=1, streams=streams, shuffle_block=64):
        seen += check_packed(batch, cache, 4 * SEQ_LEN)
    assert len(seen) == len(set(seen))
    assert len(seen) >= 0.9 * cache.num_sequences // 2  # (streams even out: a few may drop)
    if streams == 0:
        assert sorted(seen) == list(range(cache.num_sequences // 2))


def test_rows_hold_several_pairs(pairs_cache):
    batch = next(iter(pack(pairs_cache, seed=0, streams=0)))
    pairs = batch["meta"]["pair_ids"]
    assert len(set(pairs[pairs >= 0].tolist())) > batch["input_ids"].shape[0]


@pytest.mark.parametrize("streams", [0, 4])
def test_ranks_equal_batches_no_pair_on_two_ranks(pairs_cache, streams):
    cache = open_cache(pairs_cache)
    per_rank, counts = [], []
    for rank in range(4):
        ds = pack(pairs_cache, 2 * SEQ_LEN, seed=2, rank=rank, world_size=4, streams=streams,
                  shuffle_block=64)  # fmt: skip
        batches = list(ds)
        counts.append(len(batches))
        assert len(batches) == ds.batches_per_rank() == len(ds)
        per_rank.append([p for b in batches for p in check_packed(b, cache, 2 * SEQ_LEN)])
    assert len(set(counts)) == 1 and counts[0] > 2
    assert len(set().union(*map(set, per_rank))) == sum(len(r) for r in per_rank)


@pytest.mark.parametrize("streams", [0, 2])
def test_resume_is_exact(pairs_cache, streams):
    def make():
        return pack(pairs_cache, 2 * SEQ_LEN, seed=5, rank=1, world_size=2, streams=streams)

    full = assert_resumable(make, lambda ds: ds, key=lambda b: b["meta"]["sample_ids"].tolist())
    assert len(full) > 3


def test_dataloader_workers_read_the_same_batches(pairs_cache):
    from torch.utils.data import DataLoader

    ds = pack(pairs_cache, seed=3, streams=2)
    alone = [b["input_ids"].tolist() for b in ds]
    loader = DataLoader(ds, batch_size=None, num_workers=2)
    assert [b["input_ids"].tolist() for b in loader] == alone


@pytest.mark.parametrize("attention", ["mask", "varlen", "none"])
def test_attention_keys_follow_the_segments(pairs_cache, attention):
    batch = next(iter(pack(pairs_cache, seed=4, streams=0, attention=attention)))
    cu = batch["meta"]["cu_seqlens"]
    if attention == "varlen":
        assert batch["cu_seq_lens_q"].tolist() == cu.tolist()
        assert batch["max_length_q"] == int(batch["meta"]["max_seqlen"])
    elif attention == "mask":
        visible = batch["attention_mask"][:, 0] == 0
        flat = np.arange(batch["input_ids"].numel())
        segment = np.searchsorted(cu.numpy(), flat, side="right") - 1
        rows, width = batch["input_ids"].shape
        seg = segment.reshape(rows, width)
        want = (seg[:, :, None] == seg[:, None, :]) & np.tri(width, dtype=bool)[None]
        assert np.array_equal(visible.numpy(), want)


def test_tail_report_counts_both_sides(pairs_cache):
    lengths = np.asarray(open_cache(pairs_cache).lengths)
    batches = list(pack(pairs_cache, seed=0, streams=0, world_size=1, rank=0))
    assert sum(int(b["meta"]["num_tokens"]) for b in batches) == int(lengths.sum())
    report = pack(pairs_cache, seed=0, streams=0, world_size=5, rank=0).tail_report()
    assert report["dropped_segments"] % 2 == 0
    dropped = batches[len(batches) - report["dropped_batches"] :]
    assert report["dropped_segments"] == sum(int((b["meta"]["side"] >= 0).sum()) for b in dropped)


def test_a_pair_longer_than_a_row_says_how_long(pairs_cache):
    lengths = np.asarray(open_cache(pairs_cache).lengths, dtype=np.int64)
    longest = int((lengths[0::2] + lengths[1::2]).max())
    match = f"seq_len: {longest - 1} cannot hold.*at least {longest}"
    with pytest.raises(ConfigError, match=match):
        ShardDataset(pairs_cache, 4 * longest, mode="pack", seq_len=longest - 1, attention="mask")


def test_concat_packing_is_refused(pairs_cache):
    with pytest.raises(ConfigError, match="packing='best_fit'"):
        pack(pairs_cache, packing="concat")


@pytest.mark.parametrize("extra", [{}, {"mode": "pack", "seq_len": SEQ_LEN, "attention": "mask"}])
def test_pairs_say_they_read_on_the_numpy_path(pairs_cache, extra):
    """Pairs are collated by numpy, so ``shardcache.loader`` gives them workers by default."""
    from shardcache import loader

    ds = ShardDataset(pairs_cache, 4 * SEQ_LEN, **extra)
    assert not ds.reads_compiled
    assert loader(pairs_cache, 4 * SEQ_LEN, **extra).dataloader.num_workers > 0
