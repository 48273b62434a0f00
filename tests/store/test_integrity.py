"""Integrity checked once (shardcache.store.integrity) and files verified like shards: the
length index against the manifest, shards whose schema or ids do not fit the manifest."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pytest
from torch.utils.data import DataLoader

from shardcache import CorruptShardError, ShardDataset, open_cache, verify_cache
from shardcache.store import files
from shardcache.store import shards as shards_module


@pytest.fixture()
def cache_dir(corpus, build_cache, tokenizer_dir):
    folder, _ = corpus("jsonl", n_files=2, docs=40)
    return build_cache(folder, tokenizer_dir, shard_size=4096, buckets="16,64")


@pytest.fixture()
def hashed(tmp_path, monkeypatch):
    """Every whole-file sha256 (``sha256_file``) in this process and its forked DataLoader
    workers, as a list of file names (appended to a log file, so workers count too)."""
    log = tmp_path / "hashed.log"
    log.write_text("")
    drain = files.HashingReader.drain

    def counting(self):
        with open(log, "a") as f:
            f.write(os.path.basename(getattr(self._raw, "name", "?")) + "\n")
        return drain(self)

    monkeypatch.setattr(files.HashingReader, "drain", counting)
    return lambda: log.read_text().split()


def _epoch(ds: ShardDataset, epoch: int, num_workers: int) -> int:
    ds.set_epoch(epoch)
    loader = DataLoader(ds, batch_size=None, num_workers=num_workers)
    return sum(int(b["attention_mask"].sum()) for b in loader)


def test_each_file_is_hashed_once_over_workers_epochs_and_processes(cache_dir, hashed):
    manifest = open_cache(cache_dir).manifest
    names = sorted([s["name"] for s in manifest["shards"]] + ["lengths.npy"])
    ds = ShardDataset(cache_dir, max_tokens=512, seed=1)
    total = _epoch(ds, 0, num_workers=2)
    assert total == manifest["totals"]["tokens"]
    # two workers opened every shard; each file was hashed exactly once
    assert sorted(hashed()) == names
    _epoch(ds, 1, num_workers=2)  # fresh worker processes (persistent_workers=False)
    _epoch(ds, 2, num_workers=0)
    ShardDataset(cache_dir, max_tokens=512, seed=1)  # another reader: index not re-hashed
    assert sorted(hashed()) == names


def test_verify_records_what_it_hashed(cache_dir, hashed):
    assert verify_cache(cache_dir).ok
    after_verify = len(hashed())
    ds = ShardDataset(cache_dir, max_tokens=512)
    _epoch(ds, 0, num_workers=2)
    assert len(hashed()) == after_verify  # the reader trusted verify's records


def test_a_changed_file_is_hashed_again_and_refused(cache_dir, hashed):
    cache = open_cache(cache_dir)
    list(cache.iter_sequences())
    info = max(cache.shards, key=lambda s: s["bytes"])
    path = os.path.join(cache_dir, "shards", info["name"])
    with open(path, "r+b") as f:  # flip a byte inside the token values, same size
        f.seek(info["bytes"] // 2)
        byte = f.read(1)
        f.seek(info["bytes"] // 2)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(CorruptShardError, match="checksum mismatch"):
        list(open_cache(cache_dir).iter_sequences())


def test_a_downloaded_shard_is_hashed_once_on_download(cache_dir, hashed):
    remote = open_cache("file://" + os.path.abspath(cache_dir))
    local = open_cache(cache_dir)
    assert [s.ids.tolist() for s in remote.iter_sequences()] == [
        s.ids.tolist() for s in local.iter_sequences()
    ]
    # the local cache's files were hashed by its reader; the downloads never were again
    assert sorted(hashed()) == sorted([s["name"] for s in local.shards] + ["lengths.npy"])


def _rewrite_lengths(cache_dir: str, change) -> None:
    path = os.path.join(cache_dir, "index", "lengths.npy")
    lengths = np.load(path)
    np.save(path, change(lengths.copy()))


def test_tampered_length_index_is_refused(cache_dir):
    # same size, other values: all lengths 1 (pad mode would build huge batches)
    _rewrite_lengths(cache_dir, lambda a: np.ones_like(a))
    with pytest.raises(CorruptShardError, match=r"lengths\.npy: checksum mismatch"):
        ShardDataset(cache_dir, max_tokens=4096)
    with pytest.raises(CorruptShardError, match="length index"):
        open_cache(cache_dir)


@pytest.mark.parametrize("threshold", [0, 10**9])  # slice copies / index arrays
def test_index_disagreeing_with_the_shards_is_caught_on_read_without_checksums(
    cache_dir, monkeypatch, threshold
):
    monkeypatch.setattr(shards_module, "LONG_SEGMENT_TOKENS", threshold)
    monkeypatch.setenv("SHARDCACHE_SHARD_CHECKSUMS", "0")
    _rewrite_lengths(cache_dir, lambda a: np.r_[a[:-1], a[-1] - 1].astype(a.dtype))
    ds = ShardDataset(
        cache_dir, max_tokens=4096, mode="pack", seq_len=128, packing="concat", attention="none"
    )
    with pytest.raises(CorruptShardError, match="the length index says"):
        list(ds)


def _replace_shard(cache_dir: str, index: int, table: pa.Table) -> None:
    """Write ``table`` over shard ``index`` and make the manifest's size/sha256 match, so only
    the content check can catch it."""
    manifest_path = os.path.join(cache_dir, "manifest.json")
    with open(manifest_path) as f:
        manifest = json.load(f)
    info = manifest["shards"][index]
    path = os.path.join(cache_dir, "shards", info["name"])
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    info["bytes"] = os.path.getsize(path)
    info["sha256"] = files.sha256_file(path)
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)


def test_a_shard_with_wrong_column_types_is_a_corrupt_shard(cache_dir):
    info = open_cache(cache_dir).shards[0]
    rows = int(info["rows"])
    table = pa.table(
        {
            "tokens": pa.array(np.arange(rows), pa.int64()),  # not a list column
            "record": pa.array(np.arange(rows), pa.int64()),
            "piece": pa.array(np.zeros(rows), pa.int32()),
        }
    )
    _replace_shard(cache_dir, 0, table)
    with pytest.raises(CorruptShardError, match="does not belong to this cache"):
        list(open_cache(cache_dir).iter_sequences())


def test_token_ids_above_the_vocabulary_are_a_corrupt_shard(cache_dir):
    cache = open_cache(cache_dir)
    info = cache.shards[0]
    path = os.path.join(cache_dir, "shards", info["name"])
    table = pa.ipc.open_file(pa.memory_map(path)).read_all()
    tokens = table.column("tokens").combine_chunks()
    big = pa.array(np.full(len(tokens.values), 65_000, dtype=np.uint16))
    table = table.set_column(0, "tokens", pa.ListArray.from_arrays(tokens.offsets, big))
    _replace_shard(cache_dir, 0, table)
    from shardcache.read.collate.collator import pad_rows

    ds = ShardDataset(cache_dir, max_tokens=4096)  # the numpy path: the reader's own check
    with pytest.raises(CorruptShardError, match="token id 65000"):
        pad_rows(ds._samples, ds.options, np.arange(int(info["rows"])), 0)


def test_looking_for_a_record_makes_no_folders(tmp_path, monkeypatch):
    # a reader looks a record up for every shard it opens: one stat, no mkdir (a folder is
    # made only when a record is written)
    from shardcache.store import integrity

    monkeypatch.setenv(files.CACHE_DIR_ENV, str(tmp_path / "user"))
    monkeypatch.setattr(integrity, "_SEEN", set())
    shard = tmp_path / "shard.arrow"
    shard.write_bytes(b"tokens")
    digest = "ab" * 32
    verified = tmp_path / "user" / integrity.VERIFIED_DIR
    assert not integrity.is_verified(str(shard), digest)
    assert not verified.exists() or not any(verified.iterdir())
    integrity.record_verified(str(shard), digest)
    monkeypatch.setattr(integrity, "_SEEN", set())  # as a fresh process sees it
    assert integrity.is_verified(str(shard), digest)
    shard.write_bytes(b"changed")
    assert not integrity.is_verified(str(shard), digest)
