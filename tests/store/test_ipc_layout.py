"""The Arrow IPC layout read from the flatbuffers (shardcache.store.ipc_layout) against
pyarrow's own reader, and the shard reader's use of it: the same rows from both paths, anything
unexpected handed to pyarrow, and damage still detected."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pytest

from shardcache import CorruptShardError
from shardcache.store import shards
from shardcache.store.ipc_layout import mapped_layout, recorded_layout
from shardcache.store.shards import BucketWriter, ShardReader


def _shard(tmp_path, seqs, dtype=np.uint16, compression="none", shard_size=1 << 20):
    os.makedirs(tmp_path / "shards", exist_ok=True)
    writer = BucketWriter(
        str(tmp_path), "p00000", "src.jsonl", 0, np.dtype(dtype), shard_size, compression
    )
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    tokens = np.array([t for s in seqs for t in s], dtype=dtype)
    writer.add(tokens, lengths, np.arange(len(seqs)), np.zeros(len(seqs), dtype=np.int32))
    writer.close()
    return [(str(tmp_path / "shards" / info.name), info.to_json()) for info in writer.shards]


def _sequences(n=400, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 60000, size=int(k)).tolist() for k in rng.integers(1, 300, size=n)]


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_layout_matches_pyarrow(tmp_path, dtype):
    from shardcache.store.layout import RECORD_BATCH_BYTES

    seqs = _sequences(n=600) * max(1, (2 * RECORD_BATCH_BYTES) // (600 * 150 * 2))
    [(path, _)] = _shard(tmp_path, seqs, dtype, shard_size=1 << 30)
    source = pa.memory_map(path)
    data = source.read_buffer()
    source.seek(0)
    layout = mapped_layout(memoryview(data))
    reader = pa.ipc.open_file(source)
    assert layout is not None and len(layout.batches) == reader.num_record_batches > 1
    for batch, located in zip(
        (reader.get_batch(b) for b in range(len(layout.batches))), layout.batches
    ):
        column = batch.column(0)
        assert located.rows == batch.num_rows
        assert located.tokens == len(column.values)
        assert located.values_at == column.values.buffers()[1].address - data.address
        assert located.offsets_at == column.buffers()[1].address - data.address
    assert layout.schema == bytes(layout.schema)  # bytes of the schema message


def test_compressed_and_foreign_files_are_left_to_pyarrow(tmp_path):
    [(zstd, _)] = _shard(tmp_path / "z", _sequences(50), compression="zstd")
    assert mapped_layout(memoryview(pa.memory_map(zstd).read_buffer())) is None
    [(plain, _)] = _shard(tmp_path / "p", _sequences(50))
    whole = pa.memory_map(plain).read_buffer().to_pybytes()
    for damaged in (whole[:-1], whole[: len(whole) // 2], b"ARROW1" + b"\0" * 40, b"", whole[7:]):
        assert mapped_layout(memoryview(damaged)) is None
    nullable = tmp_path / "nulls.arrow"
    table = pa.table({"tokens": pa.array([[1, 2], None, [3]], pa.list_(pa.uint16()))})
    with pa.ipc.new_file(str(nullable), table.schema) as w:
        w.write_table(table)
    assert mapped_layout(memoryview(pa.memory_map(str(nullable)).read_buffer())) is None


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_located_reader_gives_the_decoded_rows(tmp_path, dtype, monkeypatch):
    seqs = _sequences(300, seed=3)
    found = _shard(tmp_path, seqs, dtype, shard_size=16 << 10)
    assert len(found) > 2
    monkeypatch.setattr(shards, "_CHECKED_SCHEMAS", {})
    readers = [ShardReader(p, info, np.dtype(dtype), max_token_id=65535) for p, info in found]
    # the first was opened by pyarrow (its schema then known), the others located
    assert readers[0]._layout is None and readers[0]._open_file is not None
    assert all(r._layout is not None and r._open_file is None for r in readers[1:])
    monkeypatch.setattr(shards, "_CHECKED_SCHEMAS", {})
    for (path, info), located in zip(found, readers):
        decoded = ShardReader(path, info, np.dtype(dtype), max_token_id=65535)
        decoded._layout = None
        a, b = located.flat_rows(), decoded.flat_rows()
        assert np.array_equal(a.starts, b.starts) and np.array_equal(a.lengths, b.lengths)
        assert np.array_equal(a.tokens, b.tokens)
        assert [located.tokens(i).tolist() for i in range(located.rows)] == [
            decoded.tokens(i).tolist() for i in range(decoded.rows)
        ]
        assert [located.provenance(i) for i in range(3)] == [
            decoded.provenance(i) for i in range(3)
        ]


def test_located_reader_still_checks_ids_and_offsets(tmp_path, monkeypatch):
    seqs = _sequences(120, seed=5)
    found = _shard(tmp_path, seqs, np.uint16, shard_size=16 << 10)
    monkeypatch.setenv("SHARDCACHE_SHARD_CHECKSUMS", "0")  # the damage below keeps the size
    ShardReader(*found[0], np.dtype(np.uint16))  # its schema is now known
    path, info = found[1]
    reader = ShardReader(path, info, np.dtype(np.uint16), max_token_id=100)
    assert reader._layout is not None
    with pytest.raises(CorruptShardError, match="holds token id"):
        reader.flat_rows()
    layout = reader._layout
    with open(path, "r+b") as f:  # the last offset no longer matches the token count
        f.seek(layout.batches[0].offsets_at + 4 * layout.batches[0].rows)
        f.write(np.int32(1).tobytes())
    with pytest.raises(CorruptShardError, match="offsets are inconsistent"):
        ShardReader(path, info, np.dtype(np.uint16)).flat_rows()


def _parses(monkeypatch) -> list[str]:
    """The files the shard reader parses with mapped_layout from now on."""
    parsed: list[str] = []
    parse = shards.mapped_layout

    def counting(data):
        parsed.append("file")
        return parse(data)

    monkeypatch.setattr(shards, "mapped_layout", counting)
    return parsed


def test_the_writer_records_each_shard_layout(tmp_path):
    found = _shard(tmp_path / "p", _sequences(300, seed=7), np.uint32, shard_size=16 << 10)
    assert len(found) > 2
    for path, info in found:
        assert info["layout"]["sha256"] == info["sha256"][:16]
        recorded = recorded_layout(info["layout"], info["sha256"], os.path.getsize(path))
        parsed = mapped_layout(memoryview(pa.memory_map(path).read_buffer()))
        assert recorded is not None and parsed is not None
        assert recorded.batches == parsed.batches
    [(_, zstd)] = _shard(tmp_path / "z", _sequences(50), compression="zstd")
    assert "layout" not in zstd  # compressed: nothing to locate


def test_a_confirmed_file_is_located_from_its_recorded_layout(tmp_path, monkeypatch):
    found = _shard(tmp_path, _sequences(300, seed=8), np.uint16, shard_size=16 << 10)
    monkeypatch.setattr(shards, "_CHECKED_SCHEMAS", {})  # as in a fresh process
    parsed = _parses(monkeypatch)
    for path, info in found:
        reader = ShardReader(path, info, np.dtype(np.uint16), max_token_id=65535, with_mask=False)
        assert reader._layout is not None and reader._open_file is None
        decoded = ShardReader(path, info, np.dtype(np.uint16), max_token_id=65535)
        decoded._layout = None
        a, b = reader.flat_rows(), decoded.flat_rows()
        assert np.array_equal(a.starts, b.starts) and np.array_equal(a.lengths, b.lengths)
    assert parsed.count("file") == len(found)  # only the readers that were not told the mask
    # without checksums nothing vouches for the record: the file is parsed (or pyarrow reads it)
    monkeypatch.setenv("SHARDCACHE_SHARD_CHECKSUMS", "0")
    parsed.clear()
    path, info = found[0]
    ShardReader(path, info, np.dtype(np.uint16), with_mask=False)
    assert parsed == ["file"]


def test_a_record_that_does_not_describe_the_file_is_ignored(tmp_path, monkeypatch):
    [(path, info), *_] = _shard(tmp_path, _sequences(200, seed=9), np.uint16, shard_size=16 << 10)
    size = os.path.getsize(path)
    record = info["layout"]
    assert recorded_layout(record, info["sha256"], size) is not None
    assert recorded_layout(record, "0" * 64, size) is None  # another version of the file
    assert recorded_layout(record, info["sha256"], record["batches"][0][3]) is None  # too short
    assert (
        recorded_layout({"sha256": info["sha256"], "batches": [[1, 2]]}, info["sha256"], size)
        is None
    )
    assert recorded_layout(None, info["sha256"], size) is None  # written before it was recorded
    expected = ShardReader(path, info, np.dtype(np.uint16)).flat_rows()
    parsed = _parses(monkeypatch)
    for bad in ({**record, "sha256": "0" * 64}, None):
        entry = {**info, "layout": bad}
        reader = ShardReader(path, entry, np.dtype(np.uint16), with_mask=False)
        assert np.array_equal(reader.flat_rows().starts, expected.starts)
    assert parsed == ["file", "file"]
