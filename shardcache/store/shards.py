"""Shard files: Arrow IPC files of token sequences, their writer and their reader.

Shards are Arrow IPC *files* (random access, memory-mappable) with the schema
``tokens: list<uint16|uint32>, record: int64, piece: int32`` (chat caches add ``mask``); one
shard holds sequences of one bucket from one partition (one input file or a range of one), in
input order, cut into record batches of about :data:`~shardcache.store.layout.RECORD_BATCH_BYTES`
token bytes. Where shard and record batch boundaries fall is a function of the sequence lengths
only (cumulative token bytes), never of how the build happened to batch its work, so the bytes
are reproducible.

Sample ids are global row numbers: shards in manifest order, rows in shard order. Every file
is written as ``*.tmp``, fsynced and renamed; its sha256 is recorded in the manifest. No pickle
anywhere: JSON, Arrow IPC and ``.npy`` (``allow_pickle=False``).
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from shardcache.errors import CorruptShardError
from shardcache.store.files import sha256_file
from shardcache.store.layout import RECORD_BATCH_BYTES, shard_path


def shard_schema(dtype: np.dtype, with_mask: bool = False) -> pa.Schema:
    """``tokens``, ``record``, ``piece``; chat caches add ``mask`` (list<bool>, one bit per
    token on disk: 1 = the token has a loss)."""
    value_type = pa.uint16() if dtype == np.uint16 else pa.uint32()
    fields = [
        pa.field("tokens", pa.list_(value_type), nullable=False),
        pa.field("record", pa.int64(), nullable=False),
        pa.field("piece", pa.int32(), nullable=False),
    ]
    if with_mask:
        fields.append(pa.field("mask", pa.list_(pa.bool_()), nullable=False))
    return pa.schema(fields)


@dataclass
class ShardInfo:
    """One shard's manifest entry."""

    name: str
    bucket: int
    partition: str
    source: str
    rows: int
    tokens: int
    bytes: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


class BucketWriter:
    """Writes the sequences of one (partition, bucket) into rotating shard files.

    Sequences are buffered until :data:`RECORD_BATCH_BYTES` of tokens have accumulated, then
    written as one record batch; a shard is closed after the record batch that takes it to
    ``shard_size_bytes``. The split points depend only on the sequence lengths.
    """

    def __init__(
        self,
        cache_dir: str,
        partition: str,
        source: str,
        bucket: int,
        dtype: np.dtype,
        shard_size_bytes: int,
        compression: str,
        with_mask: bool = False,
    ):
        self.cache_dir = cache_dir
        self.with_mask = with_mask
        self.partition = partition
        self.source = source
        self.bucket = bucket
        self.dtype = np.dtype(dtype)
        self.shard_size_bytes = shard_size_bytes
        self.batch_bytes = min(RECORD_BATCH_BYTES, shard_size_bytes)
        self.compression = None if compression == "none" else compression
        self.schema = shard_schema(self.dtype, with_mask)
        self.shards: list[ShardInfo] = []
        self.lengths: list[np.ndarray] = []  # per closed shard
        self._pending: list[tuple[np.ndarray, ...]] = []
        self._pending_bytes = 0
        self._writer: pa.ipc.RecordBatchFileWriter | None = None
        self._sink: pa.NativeFile | None = None
        self._shard_rows = 0
        self._shard_tokens = 0
        self._shard_token_bytes = 0
        self._shard_lengths: list[np.ndarray] = []

    def _shard_name(self) -> str:
        return f"{self.partition}-b{self.bucket:02d}-{len(self.shards):05d}.arrow"

    def add(
        self,
        tokens: np.ndarray,
        lengths: np.ndarray,
        records: np.ndarray,
        pieces: np.ndarray,
        mask: np.ndarray | None = None,
    ) -> None:
        """Append sequences (flat ``tokens`` cut by ``lengths``) in order; ``mask`` (flat,
        like ``tokens``) is required exactly when the writer was made ``with_mask``."""
        if (mask is None) == self.with_mask:
            raise ValueError(
                f"BucketWriter: mask given={mask is not None}, with_mask={self.with_mask}"
            )
        if mask is None:
            mask = np.zeros(0, dtype=bool)
        itemsize = self.dtype.itemsize
        while len(lengths):
            room = self.batch_bytes - self._pending_bytes
            cum = np.cumsum(lengths) * itemsize
            # take sequences up to and including the first that fills the record batch
            cut = int(np.searchsorted(cum, room, side="left")) + 1
            cut = min(cut, len(lengths))
            n_tok = int(lengths[:cut].sum())
            self._pending.append(
                (tokens[:n_tok], lengths[:cut], records[:cut], pieces[:cut], mask[:n_tok])
            )
            self._pending_bytes += n_tok * itemsize
            tokens, lengths, mask = tokens[n_tok:], lengths[cut:], mask[n_tok:]
            records, pieces = records[cut:], pieces[cut:]
            if self._pending_bytes >= self.batch_bytes:
                self._write_batch()

    def _write_batch(self) -> None:
        if not self._pending:
            return
        tokens = np.concatenate([p[0] for p in self._pending]).astype(self.dtype, copy=False)
        lengths = np.concatenate([p[1] for p in self._pending])
        records = np.concatenate([p[2] for p in self._pending])
        pieces = np.concatenate([p[3] for p in self._pending])
        mask = np.concatenate([p[4] for p in self._pending]) if self.with_mask else None
        self._pending, self._pending_bytes = [], 0
        offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
        columns = [
            pa.ListArray.from_arrays(offsets, pa.array(tokens)),
            pa.array(records, pa.int64()),
            pa.array(pieces.astype(np.int32)),
        ]
        if mask is not None:
            columns.append(pa.ListArray.from_arrays(offsets, pa.array(mask, pa.bool_())))
        batch = pa.record_batch(columns, schema=self.schema)
        path = shard_path(self.cache_dir, self._shard_name() + ".tmp")
        try:
            if self._writer is None:
                self._sink = pa.OSFile(path, "wb")
                options = pa.ipc.IpcWriteOptions(compression=self.compression)
                self._writer = pa.ipc.new_file(self._sink, self.schema, options=options)
            self._writer.write_batch(batch)
        except OSError as err:  # Arrow's write errors do not name the file: a person needs it
            if err.filename is None:
                err.filename = path
            raise
        self._shard_rows += len(lengths)
        self._shard_tokens += len(tokens)
        self._shard_token_bytes += len(tokens) * self.dtype.itemsize
        self._shard_lengths.append(lengths)
        if self._shard_token_bytes >= self.shard_size_bytes:
            self._close_shard()

    def _close_shard(self) -> None:
        if self._writer is None:
            return
        assert self._sink is not None
        self._writer.close()
        self._sink.close()
        name = self._shard_name()
        final = shard_path(self.cache_dir, name)
        tmp = final + ".tmp"
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
        self.shards.append(
            ShardInfo(
                name=name,
                bucket=self.bucket,
                partition=self.partition,
                source=self.source,
                rows=self._shard_rows,
                tokens=self._shard_tokens,
                bytes=os.path.getsize(final),
                sha256=sha256_file(final),
            )
        )
        self.lengths.append(np.concatenate(self._shard_lengths).astype(np.uint32))
        self._writer, self._sink = None, None
        self._shard_rows = self._shard_tokens = self._shard_token_bytes = 0
        self._shard_lengths = []

    def close(self) -> None:
        """Flush what is buffered and close the open shard."""
        self._write_batch()
        self._close_shard()


#: Shards whose sha256 this process has already checked: (path, size, mtime_ns, sha256).
_VERIFIED: set[tuple[str, int, int, str]] = set()


def check_shard_file(path: str, info: dict[str, Any], checksum: bool | None = None) -> None:
    """Raise :class:`CorruptShardError` unless ``path`` has the manifest's size and sha256.

    ``checksum=None`` reads the environment: ``SHARDCACHE_SHARD_CHECKSUMS=0`` skips the sha256
    (size and structure are still checked) for readers of very large caches that were checked
    with ``shardcache verify`` and cannot afford reading every shard twice.

    The size is one ``stat``. The sha256 is a sequential read of the file (~0.5 s/GiB with
    hardware SHA; the pages are then in the OS cache for the reads that follow), done at most
    once per process per file version, so a flipped byte anywhere is caught before a sample
    is returned, at the price of reading each opened shard once more.
    """
    try:
        st = os.stat(path)
    except OSError as err:
        raise CorruptShardError(
            f"{path}: shard listed in the manifest is missing or unreadable ({err}); the cache "
            "is incomplete: rebuild it or restore the file"
        ) from err
    expected_bytes = info.get("bytes")
    if expected_bytes is not None and st.st_size != int(expected_bytes):
        raise CorruptShardError(
            f"{path}: not a readable shard: {st.st_size} bytes but the manifest says "
            f"{expected_bytes} (truncated or replaced); run `shardcache verify` and rebuild"
        )
    expected = info.get("sha256")
    if checksum is None:
        checksum = os.environ.get("SHARDCACHE_SHARD_CHECKSUMS", "1") not in ("0", "false", "no")
    if not checksum or not expected:
        return
    key = (os.path.abspath(path), st.st_size, st.st_mtime_ns, str(expected))
    if key in _VERIFIED:
        return
    actual = sha256_file(path)
    if actual != expected:
        raise CorruptShardError(
            f"{path}: checksum mismatch: sha256 {actual[:16]}... but the manifest says "
            f"{str(expected)[:16]}...; the shard is corrupt (flipped bytes or a partial "
            "write): run `shardcache verify CACHE` to list every damaged file, then rebuild"
        )
    _VERIFIED.add(key)


class ShardReader:
    """Random access to the sequences of one shard (memory-mapped when uncompressed).

    On open it checks the file against the manifest entry: size, sha256 (once per process,
    see :func:`check_shard_file`; ``checksum=False`` skips it), then cheap structural
    invariants (row count, token count, value type, offsets monotone), and raises
    :class:`CorruptShardError` naming the file instead of returning garbage.
    """

    def __init__(
        self, path: str, info: dict[str, Any], dtype: np.dtype, checksum: bool | None = None
    ):
        self.path = path
        self.rows = int(info["rows"])
        check_shard_file(path, info, checksum)
        try:
            source = pa.memory_map(path, "r")
            reader = pa.ipc.open_file(source)
            batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
        except (OSError, pa.ArrowInvalid, pa.ArrowException) as err:
            raise CorruptShardError(
                f"{path}: not a readable shard ({err}); run `shardcache verify` and rebuild"
            ) from err
        self._values: list[np.ndarray] = []
        self._offsets: list[np.ndarray] = []
        self._records: list[np.ndarray] = []
        self._pieces: list[np.ndarray] = []
        self._masks: list[tuple[np.ndarray, int]] = []  # (bitmap bytes, bit offset) per batch
        self.has_mask = False
        starts = [0]
        expected_type = pa.uint16() if np.dtype(dtype) == np.uint16 else pa.uint32()
        tokens = 0
        for batch in batches:
            column = batch.column(0)
            if column.type.value_type != expected_type:
                raise CorruptShardError(
                    f"{path}: token type {column.type.value_type} but the manifest says "
                    f"{np.dtype(dtype).name}; the shard does not belong to this cache"
                )
            offsets = column.offsets.to_numpy()
            values = column.values.to_numpy(zero_copy_only=False)
            if len(offsets) and (
                offsets[0] != 0 or offsets[-1] != len(values) or np.any(np.diff(offsets) < 0)
            ):
                raise CorruptShardError(f"{path}: token offsets are inconsistent; rebuild")
            self._values.append(values)
            self._offsets.append(offsets)
            self._records.append(batch.column(1).to_numpy())
            self._pieces.append(batch.column(2).to_numpy())
            if batch.num_columns > 3:
                self.has_mask = True
                self._masks.append(_mask_bits(path, batch.column(3), offsets))
            starts.append(starts[-1] + batch.num_rows)
            tokens += len(values)
        self._starts = np.asarray(starts, dtype=np.int64)
        self._starts_list: list[int] | None = None
        if starts[-1] != self.rows or tokens != int(info["tokens"]):
            raise CorruptShardError(
                f"{path}: holds {starts[-1]} rows / {tokens} tokens but the manifest says "
                f"{self.rows} / {info['tokens']}; the shard is damaged or stale, rebuild"
            )

    def _locate(self, row: int) -> tuple[int, int]:
        if not 0 <= row < self.rows:
            raise IndexError(f"{self.path}: row {row} out of range 0..{self.rows - 1}")
        b = int(np.searchsorted(self._starts, row, side="right")) - 1
        return b, row - int(self._starts[b])

    def tokens(self, row: int) -> np.ndarray:
        """The ids of one row (a read-only view into the mapped file when uncompressed)."""
        b, r = self._locate(row)
        offsets = self._offsets[b]
        return self._values[b][offsets[r] : offsets[r + 1]]

    def tokens_many(self, rows: list[int]) -> list[np.ndarray]:
        """The ids of several rows (views, like :meth:`tokens`). Locates rows with ``bisect``
        on a Python list: ~0.2 us a row against ~2 us for a scalar ``np.searchsorted``."""
        values, offsets = self._values, self._offsets
        return [values[b][offsets[b][r] : offsets[b][r + 1]] for b, r in self._locate_many(rows)]

    def _locate_many(self, rows: list[int]) -> list[tuple[int, int]]:
        """(record batch, row in batch) of each row, located with ``bisect``."""
        if self._starts_list is None:
            self._starts_list = self._starts.tolist()
        starts = self._starts_list
        out = []
        for row in rows:
            if not 0 <= row < self.rows:
                raise IndexError(f"{self.path}: row {row} out of range 0..{self.rows - 1}")
            b = bisect.bisect_right(starts, row) - 1
            out.append((b, row - starts[b]))
        return out

    def masks_many(self, rows: list[int]) -> list[np.ndarray]:
        """The loss masks (bool per token) of several rows; all True when the shard has none
        (plain text: every token has a loss)."""
        offsets = self._offsets
        out = []
        for b, r in self._locate_many(rows):
            lo, hi = int(offsets[b][r]), int(offsets[b][r + 1])
            if not self.has_mask:
                out.append(np.ones(hi - lo, dtype=bool))
                continue
            bits, shift = self._masks[b]
            first, last = (shift + lo) // 8, (shift + hi + 7) // 8
            unpacked = np.unpackbits(bits[first:last], bitorder="little")
            start = (shift + lo) - first * 8
            out.append(unpacked[start : start + hi - lo].astype(bool))
        return out

    def provenance(self, row: int) -> tuple[int, int]:
        """``(record index in the source file, piece index)`` of one row."""
        b, r = self._locate(row)
        return int(self._records[b][r]), int(self._pieces[b][r])

    def iter_rows(self) -> Iterator[tuple[np.ndarray, int, int]]:
        """Every row in order as ``(ids, record, piece)``."""
        for values, offsets, records, pieces in zip(
            self._values, self._offsets, self._records, self._pieces
        ):
            for r in range(len(records)):
                yield values[offsets[r] : offsets[r + 1]], int(records[r]), int(pieces[r])


def _mask_bits(path: str, column: pa.ListArray, offsets: np.ndarray) -> tuple[np.ndarray, int]:
    """The packed validity-free bitmap of a list<bool> column's values and its bit offset."""
    values = column.values
    if values.null_count or not np.array_equal(column.offsets.to_numpy(), offsets):
        raise CorruptShardError(f"{path}: the loss mask does not line up with the tokens; rebuild")
    data = values.buffers()[1]
    bits = np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(0, np.uint8)
    return bits, values.offset
