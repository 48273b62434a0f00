"""The per-token column seam: a column registered in ``TOKEN_COLUMNS`` alone is written, read,
merged, verified by its own check and laid out in batches, with no other library change."""

from __future__ import annotations

import os

import numpy as np
import pytest

from shardcache.read.collate.layout import IGNORE_INDEX, pack_batch, pad_batch
from shardcache.store.columns import TOKEN_COLUMNS, TokenColumn, built_columns, stored_columns
from shardcache.store.shards import BucketWriter, ShardReader, merge_shards, shard_schema

#: A hypothetical next column: the source a token came from (not carried in the mask).
SOURCE_TAG = TokenColumn(
    name="source_tag",
    dtype=np.dtype(np.int32),
    fill=-1,
    trained=0,
    manifest_fact="source_tags",
    build_option="source_tag_field",
    build_flag="--source-tag-field",
    batch_key="source_tags",
    label="source tags",
    singular="source tag",
    tag="s",
    in_mask=False,
    check=lambda values, mask: None if (values >= 0).all() else "a negative source tag",
)


@pytest.fixture
def tagged(monkeypatch):
    monkeypatch.setitem(TOKEN_COLUMNS, "source_tag", SOURCE_TAG)
    return SOURCE_TAG


def _rows(seed: int, n: int) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(0, 500, size=int(k)).astype(np.uint16) for k in rng.integers(2, 30, n)]
    weights = [np.where(rng.random(len(s)) < 0.6, 0.5, 0).astype(np.float32) for s in seqs]
    tags = [np.full(len(s), k % 3, dtype=np.int32) for k, s in enumerate(seqs)]
    return seqs, weights, tags


def _write(folder, name: str, seed: int, n: int = 40) -> tuple[BucketWriter, tuple]:
    os.makedirs(folder / "shards", exist_ok=True)
    writer = BucketWriter(str(folder), name, "src.jsonl", 0, np.dtype(np.uint16), 1 << 20,
                          "none", True, columns=("weights", "source_tag"))  # fmt: skip
    writer.batch_bytes = 200  # several record batches
    seqs, weights, tags = _rows(seed, n)
    writer.add(np.concatenate(seqs), np.array([len(s) for s in seqs]), np.arange(n),
               np.zeros(n, np.int32), np.concatenate(weights),  # weights travel as the mask
               {"source_tag": np.concatenate(tags)})  # fmt: skip
    writer.close()
    return writer, (seqs, weights, tags)


def _gather(reader: ShardReader, n: int, lengths: list[int]) -> dict[str, np.ndarray]:
    total = sum(lengths)
    out = {"weights": np.empty(total, np.float32), "source_tag": np.empty(total, np.int32)}
    offsets = np.concatenate([[0], np.cumsum(lengths)])[:-1]
    mask = np.empty(total, bool)
    full = np.array(lengths, np.int64)
    reader.gather_into(np.arange(n), np.zeros(n, np.int64), full, offsets,
                       np.empty(total, np.uint16), mask, full, out)  # fmt: skip
    out["mask"] = mask
    return out


def test_a_registered_column_round_trips_and_merges(tmp_path, tagged):
    assert built_columns(type("Chat", (), {"weight_field": "w", "source_tag_field": "t"})()) == (
        "weights",
        "source_tag",
    )
    assert stored_columns({"tokenizer": {"source_tags": "src"}}) == ("source_tag",)
    assert shard_schema(np.dtype(np.uint16), True, ("weights", "source_tag")).names[-2:] == [
        "weights",
        "source_tag",
    ]
    writers = [_write(tmp_path, f"p{k:05d}", seed=k) for k in range(2)]
    members = [w.shards[0] for w, _ in writers]
    merged = merge_shards(str(tmp_path), members, "p00009-b00-00000.arrow", "zstd", 1 << 20)
    reader = ShardReader(str(tmp_path / "shards" / merged.name), merged.to_json(),
                         np.dtype(np.uint16), with_mask=True,
                         columns=("weights", "source_tag"))  # fmt: skip
    seqs = [s for _, (ss, _, _) in writers for s in ss]
    got = _gather(reader, len(seqs), [len(s) for s in seqs])
    want_w = np.concatenate([w for _, (_, ws, _) in writers for w in ws])
    want_t = np.concatenate([t for _, (_, _, ts) in writers for t in ts])
    np.testing.assert_array_equal(got["weights"], want_w)
    np.testing.assert_array_equal(got["mask"], want_w > 0)
    np.testing.assert_array_equal(got["source_tag"], want_t)


def test_a_shard_without_the_column_reads_its_default(tmp_path, tagged):
    os.makedirs(tmp_path / "shards")
    writer = BucketWriter(str(tmp_path), "p00000", "src.jsonl", 0, np.dtype(np.uint16), 1 << 20,
                          "none", True)  # fmt: skip
    mask = np.array([False, True, True, False])
    writer.add(np.arange(4, dtype=np.uint16), np.array([4]), np.zeros(1), np.zeros(1, np.int32),
               mask)  # fmt: skip
    writer.close()
    info = writer.shards[0]
    reader = ShardReader(str(tmp_path / "shards" / info.name), info.to_json(), np.dtype(np.uint16))
    got = _gather(reader, 1, [4])
    np.testing.assert_array_equal(got["source_tag"], np.where(mask, 0, -1))
    np.testing.assert_array_equal(got["weights"], mask.astype(np.float32))


def test_layouts_lay_every_column_out_with_its_fill(tagged):
    tokens = np.arange(1, 8, dtype=np.uint16)
    lengths = np.array([3, 4])
    mask = np.array([0, 1, 1, 0, 1, 1, 1], bool)
    extras = {
        "weights": np.where(mask, 0.5, 0).astype(np.float32),
        "source_tag": np.array([1, 1, 1, 2, 2, 2, 2], np.int32),
    }
    padded = pad_batch(tokens, lengths, np.array([0, 1]), 0, 5, mask, extras=extras)
    assert padded["source_tags"].dtype == np.int32
    assert padded["loss_weights"].dtype == np.float32
    off = padded["labels"] == IGNORE_INDEX
    assert (padded["source_tags"][off] == -1).all() and (padded["loss_weights"][off] == 0).all()
    assert padded["source_tags"][~off].tolist() == [1, 1, 2, 2, 2]
    packed = pack_batch(tokens, lengths, np.array([0, 1]), np.zeros(2, np.int64),
                        np.array([0, 2]), 8, 0, mask, extras=extras)  # fmt: skip
    off = packed["labels"] == IGNORE_INDEX
    assert packed["source_tags"].shape == packed["labels"].shape == (1, 8)
    assert (packed["source_tags"][off] == -1).all()
    assert packed["source_tags"][~off].tolist() == [1, 1, 2, 2, 2]
