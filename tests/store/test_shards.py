from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pytest

from shardcache import CorruptShardError, open_cache
from shardcache.store.shards import BucketWriter, DecodedBatches, ShardReader


def _write(tmp_path, seqs, shard_size=1 << 20, compression="none"):
    os.makedirs(tmp_path / "shards", exist_ok=True)
    writer = BucketWriter(
        str(tmp_path), "p00000", "src.jsonl", 0, np.dtype(np.uint16), shard_size, compression
    )
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    tokens = np.array([t for s in seqs for t in s], dtype=np.uint16)
    writer.add(tokens, lengths, np.arange(len(seqs)) * 10, np.zeros(len(seqs), dtype=np.int32))
    writer.close()
    return writer


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_round_trip_rows_and_provenance(tmp_path, compression):
    seqs = [[1, 2, 3], [4], list(range(100, 160)), [7, 8]]
    writer = _write(tmp_path, seqs, compression=compression)
    [info] = writer.shards
    reader = ShardReader(str(tmp_path / "shards" / info.name), info.to_json(), np.dtype(np.uint16))
    assert [reader.tokens(i).tolist() for i in range(4)] == seqs
    assert [reader.provenance(i) for i in range(4)] == [(0, 0), (10, 0), (20, 0), (30, 0)]
    assert info.rows == 4 and info.tokens == sum(map(len, seqs))
    assert not [n for n in os.listdir(tmp_path / "shards") if n.endswith(".tmp")]


def test_split_points_depend_only_on_lengths(tmp_path):
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 500, size=int(n)).tolist() for n in rng.integers(1, 400, size=300)]
    a = _write(tmp_path / "a", seqs, shard_size=8192)
    # the same sequences added in different chunks give the same bytes
    os.makedirs(tmp_path / "b" / "shards")
    writer = BucketWriter(
        str(tmp_path / "b"), "p00000", "src.jsonl", 0, np.dtype(np.uint16), 8192, "none"
    )
    for lo, hi in ((0, 7), (7, 150), (150, 300)):
        chunk = seqs[lo:hi]
        lengths = np.array([len(s) for s in chunk])
        writer.add(
            np.array([t for s in chunk for t in s], dtype=np.uint16),
            lengths,
            np.arange(lo, hi) * 10,
            np.zeros(len(chunk), dtype=np.int32),
        )
    writer.close()
    assert [s.sha256 for s in a.shards] == [s.sha256 for s in writer.shards]
    assert len(a.shards) > 3


def test_reader_refuses_a_shard_that_disagrees_with_the_manifest(tmp_path):
    writer = _write(tmp_path, [[1, 2], [3]])
    info = writer.shards[0].to_json()
    path = str(tmp_path / "shards" / info["name"])
    with pytest.raises(CorruptShardError, match="manifest says 5 / 3"):
        ShardReader(path, {**info, "rows": 5}, np.dtype(np.uint16))
    with pytest.raises(CorruptShardError, match="token type"):
        ShardReader(path, info, np.dtype(np.uint32))
    with open(path, "r+b") as f:
        f.truncate(40)
    with pytest.raises(CorruptShardError, match="not a readable shard"):
        ShardReader(path, info, np.dtype(np.uint16))


def test_missing_shard_and_bad_version_are_named(corpus, build_cache, tokenizer_dir):
    folder, _ = corpus("jsonl", n_files=1, docs=5)
    out = build_cache(folder, tokenizer_dir)
    cache = open_cache(out)
    name = cache.shards[0]["name"]
    os.remove(os.path.join(out, "shards", name))
    with pytest.raises(CorruptShardError, match=name):
        list(cache.iter_sequences())
    with open(os.path.join(out, "manifest.json")) as f:
        manifest = json.load(f)
    manifest["format_version"] = 999
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    with pytest.raises(CorruptShardError, match="format_version 999"):
        open_cache(out)


def _vm_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_reading_zstd_shards_keeps_memory_within_the_decode_budget(tmp_path, monkeypatch):
    # 8 zstd shards holding 64 MiB of tokens once decoded; the old reader decompressed every
    # opened shard whole and kept it (+64 MiB); a reader decodes record batches on demand
    # into an LRU of SHARDCACHE_DECODE_BUDGET bytes per process
    monkeypatch.setenv("SHARDCACHE_DECODE_BUDGET", "8MiB")
    length, rows = 512, 65536
    os.makedirs(tmp_path / "shards")
    writer = BucketWriter(
        str(tmp_path), "p00000", "src.jsonl", 0, np.dtype(np.uint16), 8 << 20, "zstd"
    )
    tokens = (np.arange(rows * length) % 5003).astype(np.uint16)
    writer.add(
        tokens,
        np.full(rows, length),
        np.arange(rows),
        np.zeros(rows, dtype=np.int32),
    )
    writer.close()
    del tokens
    assert len(writer.shards) == 8
    rss_before = _vm_rss_bytes()
    decoded = DecodedBatches()  # one LRU for the readers, as a cache's
    readers = [
        ShardReader(str(tmp_path / "shards" / s.name), s.to_json(), np.dtype(np.uint16),
                    decoded=decoded)
        for s in writer.shards
    ]  # fmt: skip
    first = 0
    for reader in readers:  # every row of every shard, all readers kept open (as the LRU does)
        for lo in range(0, reader.rows, 1024):
            got = reader.tokens_many(list(range(lo, min(lo + 1024, reader.rows))))
            want = (np.arange(len(got) * length) + (first + lo) * length) % 5003
            assert np.array_equal(np.concatenate(got), want)
            del got
        first += reader.rows
    growth = _vm_rss_bytes() - rss_before
    assert growth < 32 << 20, f"RSS grew {growth / 2**20:.1f} MiB reading 64 MiB of tokens"


@pytest.mark.parametrize("arrow_type", [pa.uint16(), pa.uint32(), pa.int32(), pa.int64()])
def test_arrow_numpy_is_a_zero_copy_view_equal_to_to_numpy(arrow_type):
    from shardcache.store.shards import arrow_numpy

    whole = pa.array(list(range(50)), type=arrow_type)
    for array in (whole, whole.slice(7, 20), whole.slice(49), whole.slice(3, 0)):
        got = arrow_numpy(array)
        assert got.dtype == array.to_numpy().dtype and got.tolist() == array.to_pylist()
    lists = pa.array([[1, 2], [3], [4, 5, 6]], type=pa.list_(arrow_type)).slice(1)
    assert arrow_numpy(lists.offsets).tolist() == lists.offsets.to_pylist()
    with_nulls = pa.array([1, None, 3], type=arrow_type)  # not a plain view: to_numpy's answer
    assert np.isnan(arrow_numpy(with_nulls)[1])


def test_mask_bit_starts_locate_every_rows_loss_mask_in_the_file(tmp_path):
    """A compiled reader reads a chat row's loss mask straight from the mapped file: the bits
    from mask_bit_starts()[row] (least significant first) are the row's mask, in every
    record batch, at bit offsets that are not byte-aligned."""
    rng = np.random.default_rng(4)
    seqs = [rng.integers(0, 500, size=int(n)) for n in rng.integers(1, 40, size=60)]
    masks = [rng.random(len(s)) < 0.6 for s in seqs]
    os.makedirs(tmp_path / "shards")
    writer = BucketWriter(
        str(tmp_path), "p00000", "src.jsonl", 0, np.dtype(np.uint16), 1 << 20, "none", True
    )
    writer.batch_bytes = 200  # several record batches in the shard
    writer.add(
        np.concatenate(seqs).astype(np.uint16),
        np.array([len(s) for s in seqs]),
        np.arange(len(seqs)),
        np.zeros(len(seqs), dtype=np.int32),
        np.concatenate(masks),
    )
    writer.close()
    [info] = writer.shards
    path = str(tmp_path / "shards" / info.name)
    reader = ShardReader(path, info.to_json(), np.dtype(np.uint16), with_mask=True)
    assert reader._reader.num_record_batches > 3
    starts = reader.mask_bit_starts()
    assert starts is not None and len(starts) == len(seqs)
    bits = np.unpackbits(np.fromfile(path, dtype=np.uint8), bitorder="little").astype(bool)
    for row, mask in enumerate(masks):
        assert bits[starts[row] : starts[row] + len(mask)].tolist() == mask.tolist()
    assert reader.masks_many(list(range(len(seqs))))[7].tolist() == masks[7].tolist()
    plain = _write(tmp_path / "plain", [[1, 2], [3]])
    [info] = plain.shards
    path = str(tmp_path / "plain" / "shards" / info.name)
    assert ShardReader(path, info.to_json(), np.dtype(np.uint16)).mask_bit_starts() is None


def test_a_loss_mask_out_of_line_with_its_tokens_is_refused(tmp_path):
    from shardcache.store.shards import shard_schema

    schema = shard_schema(np.dtype(np.uint16), with_mask=True)
    batch = pa.record_batch(
        [
            pa.array([[1, 2], [3]], type=pa.list_(pa.uint16())),
            pa.array([0, 1], type=pa.int64()),
            pa.array([0, 0], type=pa.int32()),
            pa.array([[True], [False, True]], type=pa.list_(pa.bool_())),  # rows of 1 and 2
        ],
        schema=schema,
    )
    path = str(tmp_path / "p00000-b00-00000.arrow")
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, schema) as out:
        out.write_batch(batch)
    info = {"name": os.path.basename(path), "rows": 2, "tokens": 3}
    reader = ShardReader(path, info, np.dtype(np.uint16), checksum=False, with_mask=True)
    with pytest.raises(CorruptShardError, match="loss mask of record batch 0 does not line up"):
        reader.mask_bit_starts()


# --- resource limits are not corruption ---------------------------------------------------


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory, tokenizer_dir) -> str:
    """A cache of a few hundred 4 KiB shards."""
    from conftest import make_texts, write_records
    from shardcache.builder.run import build_cache
    from shardcache.config import build_options_from_mapping

    folder = tmp_path_factory.mktemp("many-shards")
    texts = make_texts(12000, seed=3, max_words=200)
    path = write_records(str(folder / "a.jsonl"), [{"text": t} for t in texts], "jsonl")
    out = str(folder / "cache")
    build_cache(build_options_from_mapping({"input": path, "tokenizer": tokenizer_dir,
                                            "output": out, "workers": 1, "shard_size": 4096,
                                            "buckets": "1024"}))  # fmt: skip
    return out


def test_a_cache_of_more_shards_than_the_file_limit_reads_whole(many_shards):
    """Under RLIMIT_NOFILE 64 a fresh process reads every sequence and a whole epoch of a
    cache of more shards than that (compiled and numpy paths)."""
    import subprocess
    import sys

    with open(os.path.join(many_shards, "manifest.json"), encoding="utf-8") as f:
        manifest = json.load(f)
    assert len(manifest["shards"]) > 128
    script = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))\n"
        "from shardcache import ShardDataset, open_cache\n"
        f"path = {many_shards!r}\n"
        "with open_cache(path) as cache:\n"
        "    tokens = sum(len(cache.read(i)) for i in range(cache.num_sequences))\n"
        "seen = []\n"
        "for kernels in (True, False):\n"
        "    ds = ShardDataset(path, max_tokens=4096, shuffle=False)\n"
        "    ds.kernels = kernels\n"
        "    seen.append(sum(int(b['meta']['num_tokens']) for b in ds))\n"
        "    ds.close()\n"
        "print(tokens, *seen)\n"
    )
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": repo}, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    total = manifest["totals"]["tokens"]
    assert [int(v) for v in result.stdout.split()] == [total, total, total]


@pytest.mark.parametrize("code", ["EMFILE", "ENFILE", "ENOMEM"])
def test_a_resource_limit_is_named_not_reported_as_corruption(many_shards, monkeypatch, code):
    import errno

    import shardcache.store.shards as shards_module

    def fail(*args, **kwargs):
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))

    with open_cache(many_shards) as cache:
        monkeypatch.setattr(shards_module.mmap, "mmap", fail)  # the shard's map
        with pytest.raises(Exception) as info:
            cache.read(0)
    assert not isinstance(info.value, CorruptShardError)
    message = str(info.value)
    assert "not damaged" in message and "rebuild" not in message
    assert {"EMFILE": "RLIMIT_NOFILE", "ENFILE": "file-max", "ENOMEM": "max_map_count"}[
        code
    ] in message
