"""Shard files: Arrow IPC files of token sequences, their writer and their reader.

Schema ``tokens: list<uint16|uint32>, record: int64, piece: int32`` (chat caches add
``mask: list<bool>``, then the per-token columns of ``store/columns.py`` the cache stores, each
a list beside the tokens): sequences of one bucket in input order, cut into record batches of about
``RECORD_BATCH_BYTES`` token bytes, so split points depend only on the lengths. Uncompressed
batches are read zero-copy from the memory map, compressed ones into a byte-bounded LRU.
"""

from __future__ import annotations

import dataclasses
import itertools
import mmap
import os
import struct
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from shardcache.config import parse_size
from shardcache.errors import CorruptShardError
from shardcache.store.columns import TOKEN_COLUMNS
from shardcache.store.files import HashingWriter, resource_limit_error, sha256_bytes
from shardcache.store.integrity import check_file
from shardcache.store.layout import RECORD_BATCH_BYTES, shard_path


def shard_schema(
    dtype: np.dtype, with_mask: bool = False, columns: Sequence[str] = ()
) -> pa.Schema:
    """The Arrow schema of a shard: ``tokens`` (uint16/uint32), ``record``, ``piece``, ``mask``.

    ``columns`` (names of ``TOKEN_COLUMNS``, in its order) follow ``mask``, one list each.
    """
    value_type = pa.uint16() if dtype == np.uint16 else pa.uint32()
    fields = [
        pa.field("tokens", pa.list_(value_type), nullable=False),
        pa.field("record", pa.int64(), nullable=False),
        pa.field("piece", pa.int32(), nullable=False),
    ]
    if with_mask:
        fields.append(pa.field("mask", pa.list_(pa.bool_()), nullable=False))
    for name in columns:
        fields.append(pa.field(name, pa.list_(TOKEN_COLUMNS[name].arrow_type), nullable=False))
    return pa.schema(fields)


_NUMPY_OF_ARROW = {
    pa.int8(): np.int8, pa.int16(): np.int16, pa.int32(): np.int32, pa.int64(): np.int64,
    pa.uint8(): np.uint8, pa.uint16(): np.uint16, pa.uint32(): np.uint32,
    pa.uint64(): np.uint64, pa.float32(): np.float32,
}  # fmt: skip


_ARROW_OF_NUMPY = {np.dtype(v): k for k, v in _NUMPY_OF_ARROW.items()}


def numpy_arrow(array: np.ndarray) -> pa.Array:
    """A zero-copy Arrow array over 1-d numpy integers or float32 (bools: bit-packed, a copy).

    Avoids the pandas import that ``pa.array`` makes.
    """
    array = np.ascontiguousarray(array)
    if array.dtype == np.bool_:
        bits = np.packbits(array, bitorder="little")
        return pa.Array.from_buffers(pa.bool_(), len(array), [None, pa.py_buffer(bits)])
    arrow_type = _ARROW_OF_NUMPY[array.dtype]
    return pa.Array.from_buffers(arrow_type, len(array), [None, pa.py_buffer(array)])


def arrow_numpy(array: pa.Array) -> np.ndarray:
    """A numpy view of an Arrow array, without the pandas import ``to_numpy`` makes.

    Read-only and zero-copy for a primitive integer array without nulls; others via ``to_numpy``.
    """
    dtype = _NUMPY_OF_ARROW.get(array.type)
    data = array.buffers()[1] if dtype is not None and not array.null_count else None
    if data is None:
        return array.to_numpy(zero_copy_only=False)
    itemsize = np.dtype(dtype).itemsize
    view = np.frombuffer(data, dtype=dtype, count=len(array), offset=array.offset * itemsize)
    return view


@dataclass
class ShardInfo:
    """One shard's manifest entry.

    A partition's shard has ``partition`` and ``source`` (its input file), or ``sources`` instead
    of ``source`` when it holds rows of several files: ``{"partition", "source", "rows"}`` runs in
    row order. A merged shard has ``sources`` alone. ``layout`` is ignored, never written.
    """

    name: str
    bucket: int
    partition: str | None
    source: str | None
    rows: int
    tokens: int
    bytes: int
    sha256: str
    layout: dict[str, Any] | None = None
    sources: list[dict[str, Any]] | None = None

    def to_json(self) -> dict[str, Any]:
        """The manifest entry: the fields that are not None."""
        return {k: v for k, v in self.__dict__.items() if v is not None}

    def runs(self) -> list[dict[str, Any]]:
        """Where the rows came from: ``sources``, or one run of the shard's own partition."""
        if self.sources is not None:
            return self.sources
        return [{"partition": self.partition, "source": self.source, "rows": self.rows}]


class BucketWriter:
    """Writes the sequences of one (partition, bucket) into rotating shard files (tmp+fsync+rename).

    A record batch every ``RECORD_BATCH_BYTES`` of tokens; a new shard after the batch that
    reaches ``shard_size_bytes``, except with ``name`` (one shard, for ``merge_shards``).
    ``source`` may change between ``add`` calls: a shard with rows of several files records runs.
    With ``row_multiple`` (preference pairs: 2) every record batch holds a multiple of that many
    rows, given ``add`` calls that do. ``columns`` (names of ``TOKEN_COLUMNS``, with ``with_mask``)
    are stored after the mask, their values given to ``add``; an ``in_mask`` column not given there
    takes the ``mask`` given, whose bool (``!= 0``) is then the stored mask.
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
        name: str | None = None,
        row_multiple: int = 1,
        columns: Sequence[str] = (),
    ):
        if columns and not with_mask:
            raise ValueError(f"BucketWriter: the columns {list(columns)} need with_mask")
        self.cache_dir = cache_dir
        self.columns = tuple(columns)
        self.row_multiple = row_multiple  # record batches (so shards) cut only at such rows
        self.with_mask = with_mask
        self.name = name  # one shard of this name, never rotated (merge_shards)
        self.partition = partition
        self.source = source
        self.bucket = bucket
        self.dtype = np.dtype(dtype)
        self.shard_size_bytes = shard_size_bytes
        self.batch_bytes = min(RECORD_BATCH_BYTES, shard_size_bytes)
        self.compression = None if compression == "none" else compression
        self.schema = shard_schema(self.dtype, with_mask, self.columns)
        self.shards: list[ShardInfo] = []
        self.lengths: list[np.ndarray] = []  # per closed shard
        self._pending: list[tuple[np.ndarray, ...]] = []
        self._pending_bytes = 0
        self._writer: pa.ipc.RecordBatchFileWriter | None = None
        self._sink: HashingWriter | None = None
        self._shard_rows = 0
        self._shard_tokens = 0
        self._shard_token_bytes = 0
        self._shard_lengths: list[np.ndarray] = []
        self._pending_runs: list[list[Any]] = []  # [source, rows] of the pending rows
        self._shard_runs: list[list[Any]] = []  # [source, rows] of the open shard's rows

    def _shard_name(self) -> str:
        """The name of the shard being written."""
        if self.name is not None:
            return self.name
        return f"{self.partition}-b{self.bucket:02d}-{len(self.shards):05d}.arrow"

    def add(
        self,
        tokens: np.ndarray,
        lengths: np.ndarray,
        records: np.ndarray,
        pieces: np.ndarray,
        mask: np.ndarray | None = None,
        columns: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        """Append sequences: flat ``tokens`` (and ``mask``), per-row lengths, records and pieces.

        ``mask`` must be given exactly when the writer is ``with_mask`` (else ``ValueError``);
        ``columns`` holds the flat values of the writer's columns (an ``in_mask`` column left
        out takes ``mask``). A shard write's ``OSError`` names the file.
        """
        if (mask is None) == self.with_mask:
            raise ValueError(
                f"BucketWriter: mask given={mask is not None}, with_mask={self.with_mask}"
            )
        if mask is None:
            mask = np.zeros(0, dtype=bool)
        values = self._column_values(mask, columns or {})
        itemsize = self.dtype.itemsize
        while len(lengths):
            room = self.batch_bytes - self._pending_bytes
            cum = np.cumsum(lengths) * itemsize
            # take sequences up to and including the first that fills the record batch
            cut = int(np.searchsorted(cum, room, side="left")) + 1
            cut = min(cut + (-cut % self.row_multiple), len(lengths))
            n_tok = int(lengths[:cut].sum())
            self._pending.append(
                (tokens[:n_tok], lengths[:cut], records[:cut], pieces[:cut], mask[:n_tok],
                 *(v[:n_tok] for v in values))
            )  # fmt: skip
            _add_run(self._pending_runs, self.source, cut)
            self._pending_bytes += n_tok * itemsize
            tokens, lengths, mask = tokens[n_tok:], lengths[cut:], mask[n_tok:]
            values = [v[n_tok:] for v in values]
            records, pieces = records[cut:], pieces[cut:]
            if self._pending_bytes >= self.batch_bytes:
                self._write_batch()

    def _column_values(self, mask: np.ndarray, given: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """The flat values of each of the writer's columns, in order (``ValueError``: missing)."""
        out = []
        for name in self.columns:
            if name in given:
                out.append(given[name])
            elif TOKEN_COLUMNS[name].in_mask:
                out.append(mask)
            else:
                raise ValueError(f"BucketWriter: no values given for the column {name!r}")
        return out

    def _write_batch(self) -> None:
        """Write the pending sequences as one record batch, closing the shard when it is full."""
        if not self._pending:
            return
        tokens = np.concatenate([p[0] for p in self._pending]).astype(self.dtype, copy=False)
        lengths = np.concatenate([p[1] for p in self._pending])
        records = np.concatenate([p[2] for p in self._pending])
        pieces = np.concatenate([p[3] for p in self._pending])
        mask = np.concatenate([p[4] for p in self._pending]) if self.with_mask else None
        count = len(self.columns)
        values = [np.concatenate([p[5 + k] for p in self._pending]) for k in range(count)]
        self._pending, self._pending_bytes = [], 0
        for source, rows in self._pending_runs:
            _add_run(self._shard_runs, source, rows)
        self._pending_runs = []
        offsets = numpy_arrow(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
        columns = [
            pa.ListArray.from_arrays(offsets, numpy_arrow(tokens)),
            numpy_arrow(records.astype(np.int64, copy=False)),
            numpy_arrow(pieces.astype(np.int32)),
        ]
        if mask is not None:
            columns.append(pa.ListArray.from_arrays(offsets, numpy_arrow(mask.astype(bool))))
        for name, column in zip(self.columns, values):
            stored = column.astype(TOKEN_COLUMNS[name].dtype, copy=False)
            columns.append(pa.ListArray.from_arrays(offsets, numpy_arrow(stored)))
        batch = pa.record_batch(columns, schema=self.schema)
        path = shard_path(self.cache_dir, self._shard_name()) + ".tmp"
        try:
            if self._writer is None:
                self._sink = HashingWriter(path)
                options = pa.ipc.IpcWriteOptions(compression=self.compression)
                self._writer = pa.ipc.new_file(
                    pa.PythonFile(self._sink, mode="w"), self.schema, options=options
                )
            self._writer.write_batch(batch)
        except OSError as err:  # Arrow's write errors do not name the file: a person needs it
            if err.filename is None:
                err.filename = path
            raise
        self._shard_rows += len(lengths)
        self._shard_tokens += len(tokens)
        self._shard_token_bytes += len(tokens) * self.dtype.itemsize
        self._shard_lengths.append(lengths)
        if self._shard_token_bytes >= self.shard_size_bytes and self.name is None:
            self._close_shard()

    def _close_shard(self) -> None:
        """Finish the open shard and record its entry and lengths."""
        if self._writer is None:
            return
        assert self._sink is not None
        self._writer.close()
        name = self._shard_name()
        size, sha256 = _finish_shard(self.cache_dir, name, self._sink)
        runs, self._shard_runs = self._shard_runs, []
        self.shards.append(
            ShardInfo(
                name=name,
                bucket=self.bucket,
                partition=self.partition,
                source=runs[0][0] if len(runs) == 1 else None,
                rows=self._shard_rows,
                tokens=self._shard_tokens,
                bytes=size,
                sha256=sha256,
                sources=None
                if len(runs) == 1
                else [
                    {"partition": self.partition, "source": source, "rows": rows}
                    for source, rows in runs
                ],
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


def _add_run(runs: list[list[Any]], source: str, rows: int) -> None:
    """Count ``rows`` more rows of ``source`` at the end of ``runs``."""
    if runs and runs[-1][0] == source:
        runs[-1][1] += rows
    else:
        runs.append([source, rows])


def _finish_shard(cache_dir: str, name: str, sink: HashingWriter) -> tuple[int, str]:
    """Fsync ``<name>.tmp``, rename it to ``name``; return its size and sha256 (hashed on write)."""
    final = shard_path(cache_dir, name)
    sink.close()  # flushes and fsyncs
    os.replace(final + ".tmp", final)
    return sink.bytes_written, sink.sha256.hexdigest()


def merge_shards(
    cache_dir: str, members: list[ShardInfo], name: str, compression: str, shard_size_bytes: int
) -> ShardInfo:
    """Join shards of one bucket, in row order, into the new shard ``name``; return its entry.

    Record batches are cut as one writer would have cut them. Each member is read whole and checked
    against its sha256 before parsing (a damaged one is refused, not hidden under a new digest);
    one member is held at a time, members are left in place, and several merges may run in threads.
    """
    if len({m.bucket for m in members}) != 1:
        raise ValueError(f"merge_shards: members of several buckets: {[m.name for m in members]}")
    writer: BucketWriter | None = None
    for member in members:
        source = shard_path(cache_dir, member.name)
        # read whole and closed at once (a member is smaller than a shard): a merge of
        # thousands of small shards never holds more than one of them open, and what is
        # merged is exactly what was hashed; Arrow's pool reuses its pages from member to member
        with pa.OSFile(source) as f:
            data = f.read_buffer()
        if sha256_bytes(data) != member.sha256:
            raise CorruptShardError(
                f"{source}: its sha256 is not the one its partition recorded, so it "
                "was not merged; delete that partition's files under parts/ and "
                "rerun the build to rebuild it"
            )
        reader = pa.ipc.open_file(pa.BufferReader(data))
        schema = reader.schema
        field = schema.field("tokens").type.value_type
        with_mask = "mask" in schema.names
        stored = [n for n in schema.names if n in TOKEN_COLUMNS]
        if writer is None:
            writer = BucketWriter(cache_dir, "merged", "", member.bucket, np.dtype(str(field)),
                                  shard_size_bytes, compression, with_mask, name,
                                  columns=stored)  # fmt: skip
        if not schema.equals(writer.schema):
            raise CorruptShardError(
                f"{source}: its schema {schema} is not a shard's of this cache "
                f"({writer.schema}); rebuild the cache"
            )
        for b in range(reader.num_record_batches):
            batch = reader.get_batch(b)
            tokens = batch.column(0)
            offsets = arrow_numpy(tokens.offsets)
            values = arrow_numpy(tokens.values)[offsets[0] : offsets[-1]]
            mask = None
            if with_mask:
                bits = batch.column(3).values.to_numpy(zero_copy_only=False)
                mask = bits[offsets[0] : offsets[-1]]
            columns = {
                n: arrow_numpy(batch.column(n).values)[offsets[0] : offsets[-1]] for n in stored
            }
            writer.add(values, np.diff(offsets), arrow_numpy(batch.column(1)),
                       arrow_numpy(batch.column(2)), mask, columns)  # fmt: skip
    if writer is None:
        raise ValueError("merge_shards: no members")
    writer.close()
    [merged] = writer.shards
    expected = (sum(m.rows for m in members), sum(m.tokens for m in members))
    if (merged.rows, merged.tokens) != expected:
        raise CorruptShardError(f"{name}: the merged rows or tokens differ from its members'")
    return dataclasses.replace(
        merged, partition=None, source=None, sources=[run for m in members for run in m.runs()]
    )


# ------------------------------------------------------------------------------- reading

#: Bytes of decoded (decompressed) record batches one open cache keeps
#: (``SHARDCACHE_DECODE_BUDGET``, e.g. ``256MiB``). Uncompressed shards are decoded zero-copy
#: from their memory maps and cost no budget.
DECODE_BUDGET_ENV = "SHARDCACHE_DECODE_BUDGET"
DEFAULT_DECODE_BUDGET_BYTES = 64 << 20


def decode_budget_bytes() -> int:
    """Bytes of decoded record batches a cache keeps: ``$SHARDCACHE_DECODE_BUDGET``, else 64 MiB."""
    value = os.environ.get(DECODE_BUDGET_ENV)
    return parse_size(value, DECODE_BUDGET_ENV) if value else DEFAULT_DECODE_BUDGET_BYTES


def check_shard_file(path: str, info: dict[str, Any], checksum: bool | None = None) -> bool:
    """Check a shard's size and sha256 against its entry; True when the sha256 was confirmed."""
    return check_file(path, info, "shard", checksum)


#: Mean segment length (tokens) from which ``ShardReader.gather_into`` copies slice by
#: slice rather than through index arrays (a slice has a fixed cost, an index a cost a token).
LONG_SEGMENT_TOKENS = 128


def flat_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The concatenation of ``arange(s, s + n)`` for every ``(s, n)`` as int64, without a loop."""
    lengths = np.asarray(lengths, dtype=np.int64)
    ends = np.cumsum(lengths)
    total = int(ends[-1]) if len(ends) else 0
    shift = np.asarray(starts, dtype=np.int64) - (ends - lengths)
    return np.repeat(shift, lengths) + np.arange(total, dtype=np.int64)


@dataclass
class _Batch:
    """One decoded record batch: token values, int32 offsets, provenance, packed loss mask.

    ``columns``: the stored per-token columns' values by name (``TOKEN_COLUMNS``), per token value.

    For uncompressed shards these are views of the mapped file: no heap per row.
    """

    values: np.ndarray
    offsets: np.ndarray
    records: np.ndarray
    pieces: np.ndarray
    mask_bits: np.ndarray | None
    mask_shift: int
    nbytes: int
    columns: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

    def mask_at(self, positions: np.ndarray) -> np.ndarray:
        """The loss-mask bits at token positions (all True without a stored mask)."""
        if self.mask_bits is None:
            return np.ones(len(positions), dtype=bool)
        bit = positions + self.mask_shift
        return ((self.mask_bits[bit >> 3] >> (bit & 7).astype(np.uint8)) & 1).astype(bool)

    def column_at(self, name: str, positions: np.ndarray) -> np.ndarray:
        """A per-token column's values at token positions: stored, else its ``default``."""
        stored = self.columns.get(name)
        if stored is None:
            return TOKEN_COLUMNS[name].default(self.mask_at(positions))
        return stored[positions]


@dataclass
class FlatRows:
    """An uncompressed shard's tokens as one array.

    Attributes:
        tokens: the mapped file viewed as the token type.
        starts: int64, each row's start in ``tokens``.
        lengths: int64, each row's length.
    """

    tokens: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray


class DecodedBatches:
    """An LRU of decoded record batches of compressed shards, bounded in bytes.

    Shared by one cache's readers; the batch just decoded is always kept. Not thread-safe: one
    thread reads a cache at a time. ``budget_bytes`` None reads the environment at each insertion.
    """

    def __init__(self, budget_bytes: int | None = None) -> None:
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[tuple[int, int], _Batch] = OrderedDict()
        self._owners = itertools.count()
        self.nbytes = 0

    def new_owner(self) -> int:
        """A key for one reader's batches, unique within this LRU."""
        return next(self._owners)

    def get(self, key: tuple[int, int]) -> _Batch | None:
        """The batch kept under ``(owner, batch index)``, now most recently used, or None."""
        batch = self._entries.get(key)
        if batch is not None:
            self._entries.move_to_end(key)
        return batch

    def put(self, key: tuple[int, int], batch: _Batch) -> None:
        """Keep a batch under ``(owner, batch index)``, evicting least recently used over budget."""
        budget = decode_budget_bytes() if self.budget_bytes is None else self.budget_bytes
        old = self._entries.pop(key, None)
        if old is not None:
            self.nbytes -= old.nbytes
        self._entries[key] = batch
        self.nbytes += batch.nbytes
        while self.nbytes > budget and len(self._entries) > 1:
            _, evicted = self._entries.popitem(last=False)
            self.nbytes -= evicted.nbytes

    def drop(self, owner: int) -> None:
        """Forget one owner's batches."""
        for key in [k for k in self._entries if k[0] == owner]:
            self.nbytes -= self._entries.pop(key).nbytes


def _field(meta: memoryview, table: int, index: int) -> int:
    """The offset of field ``index`` of the flatbuffer table at ``table`` (0: absent)."""
    vtable = table - struct.unpack_from("<i", meta, table)[0]
    size = struct.unpack_from("<H", meta, vtable)[0]
    if 4 + 2 * index >= size:
        return 0
    return struct.unpack_from("<H", meta, vtable + 4 + 2 * index)[0]


def _batch_counts(buffer: pa.Buffer) -> tuple[list[int], list[int], bool]:
    """Rows and token values per record batch of an IPC file, and whether it is compressed.

    Read from the message headers alone, as pyarrow exposes neither without decoding; checked
    again on decode. ``Message.header`` (field 2) is a ``RecordBatch``: ``length`` (0) rows,
    ``nodes`` (1) depth-first (node 1: the tokens' values), ``compression`` (3).
    """
    rows: list[int] = []
    tokens: list[int] = []
    compressed = False
    source = pa.BufferReader(buffer)
    source.seek(8)  # b"ARROW1\0\0": the file format is the stream format plus a footer
    for message in pa.ipc.MessageReader.open_stream(source):
        if message.type != "record batch":
            continue
        meta = memoryview(message.metadata)
        root = struct.unpack_from("<I", meta, 0)[0]
        at = root + _field(meta, root, 2)
        header = at + struct.unpack_from("<I", meta, at)[0]
        length = _field(meta, header, 0)
        rows.append(struct.unpack_from("<q", meta, header + length)[0] if length else 0)
        at = header + _field(meta, header, 1)
        nodes = at + struct.unpack_from("<I", meta, at)[0]
        if struct.unpack_from("<I", meta, nodes)[0] < 2:
            raise ValueError("a record batch without a tokens list column")
        tokens.append(struct.unpack_from("<q", meta, nodes + 4 + 16)[0])
        compressed = compressed or bool(_field(meta, header, 3))
    return rows, tokens, compressed


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    """``np.concatenate(parts)`` (int64), without a copy when there is one part."""
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


class ShardReader:
    """Random access to the sequences of one shard, through pyarrow's view of its mapped file.

    Opening checks size, sha256, schema and counts against ``info``, decoding nothing; a record
    batch is decoded on first read and checked then (offsets, counts, ids ``<= max_token_id``).
    ``with_mask`` (``columns``) None accepts what the shard has. Views handed out keep the pages
    mapped after ``close``.
    """

    def __init__(
        self,
        path: str,
        info: dict[str, Any],
        dtype: np.dtype,
        checksum: bool | None = None,
        *,
        max_token_id: int | None = None,
        with_mask: bool | None = None,
        decoded: DecodedBatches | None = None,
        columns: Sequence[str] | None = None,
    ):
        self.path = path
        self.rows = int(info["rows"])
        self.dtype = np.dtype(dtype)
        self.max_token_id = max_token_id
        self._decoded = DecodedBatches() if decoded is None else decoded
        self._id = self._decoded.new_owner()
        check_shard_file(path, info, checksum)
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            finally:
                os.close(fd)
            self._whole: pa.Buffer | None = pa.py_buffer(mapped)
            self._reader: pa.ipc.RecordBatchFileReader | None = pa.ipc.open_file(
                pa.BufferReader(self._whole)
            )
            schema = self._reader.schema
            rows, tokens, self.compressed = _batch_counts(self._whole)
        except (OSError, ValueError, IndexError, struct.error, pa.ArrowException) as err:
            limit = resource_limit_error(err, path) if isinstance(err, OSError) else None
            if limit is not None:
                raise limit from err
            raise CorruptShardError(
                f"{path}: not a readable shard ({err}); run `shardcache verify` and rebuild"
            ) from err
        self.has_mask = "mask" in schema.names
        #: the per-token columns the shard stores (``TOKEN_COLUMNS`` names), by schema position
        self.columns = {n: i for i, n in enumerate(schema.names) if n in TOKEN_COLUMNS}
        self._check_schema(schema, with_mask, columns)
        if len(rows) != self._reader.num_record_batches:
            raise CorruptShardError(
                f"{path}: {len(rows)} record batches in the stream but "
                f"{self._reader.num_record_batches} in the footer; rebuild"
            )
        self._batch_rows = rows
        self._batch_tokens = tokens
        self._starts = np.array([0, *itertools.accumulate(rows)], dtype=np.int64)
        total_rows, total_tokens = sum(rows), sum(tokens)
        if total_rows != self.rows or total_tokens != int(info["tokens"]):
            raise CorruptShardError(
                f"{path}: holds {total_rows} rows / {total_tokens} tokens but the "
                f"manifest says {self.rows} / {info['tokens']}; the shard is damaged or stale, "
                "rebuild"
            )
        self._resident: list[_Batch | None] = [None] * len(rows)
        self._ids_checked = [False] * len(rows)

    def _check_schema(
        self, schema: pa.Schema, with_mask: bool | None, columns: Sequence[str] | None
    ) -> None:
        """Raise ``CorruptShardError`` unless the schema is this cache's (token type first)."""
        expected = shard_schema(
            self.dtype,
            self.has_mask if with_mask is None else with_mask,
            tuple(self.columns) if columns is None else columns,
        )
        names = schema.names
        if names[:1] == ["tokens"] and pa.types.is_list(schema.field(0).type):
            value_type = schema.field(0).type.value_type
            if value_type != expected.field(0).type.value_type:
                raise CorruptShardError(
                    f"{self.path}: token type {value_type} but the manifest says "
                    f"{self.dtype.name}; the shard does not belong to this cache"
                )
        found = [f"{f.name}: {f.type}" for f in schema]
        wanted = [f"{f.name}: {f.type}" for f in expected]
        if found != wanted:
            raise CorruptShardError(
                f"{self.path}: columns [{', '.join(found)}] but a shard of this cache has "
                f"[{', '.join(wanted)}]; the shard does not belong to this cache, rebuild it"
            )

    def close(self) -> None:
        """Release the file's mapping and the decoded record batches (idempotent)."""
        self._decoded.drop(self._id)
        self._resident = [None] * len(self._resident)
        self._reader = None
        self._whole = None

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _file(self) -> tuple[pa.ipc.RecordBatchFileReader, pa.Buffer]:
        """The open IPC reader and mapped buffer; ``ValueError`` once closed."""
        if self._reader is None or self._whole is None:
            raise ValueError(f"{self.path}: the shard reader is closed")
        return self._reader, self._whole

    # ---- decoding --------------------------------------------------------------------------

    def _batch(self, b: int, check_ids: bool = True) -> _Batch:
        """Record batch ``b``, decoded and id-checked once (compressed: via the shared LRU)."""
        if self.compressed:
            key = (self._id, b)
            batch = self._decoded.get(key)
            if batch is None:
                batch = self._decode(b)
                self._check_ids(b, batch.values)
                self._decoded.put(key, batch)
            return batch
        batch = self._resident[b]
        if batch is None:
            batch = self._resident[b] = self._decode(b)
        if check_ids and not self._ids_checked[b]:
            self._check_ids(b, batch.values)
            self._ids_checked[b] = True
        return batch

    def _decode(self, b: int) -> _Batch:
        """Decode record batch ``b`` and check its offsets and counts against the header."""
        path = self.path
        reader, _ = self._file()
        try:
            batch = reader.get_batch(b)
            column = batch.column(0)
            offsets = arrow_numpy(column.offsets)
            values = arrow_numpy(column.values)
        except (OSError, pa.ArrowException) as err:
            raise CorruptShardError(
                f"{path}: record batch {b} cannot be decoded ({err}); run `shardcache verify` "
                "and rebuild"
            ) from err
        if len(offsets) and (
            offsets[0] != 0 or offsets[-1] != len(values) or np.any(np.diff(offsets) < 0)
        ):
            raise CorruptShardError(f"{path}: token offsets are inconsistent; rebuild")
        if batch.num_rows != self._batch_rows[b] or len(values) != self._batch_tokens[b]:
            raise CorruptShardError(
                f"{path}: record batch {b} holds {batch.num_rows} rows / {len(values)} tokens "
                f"but its header says {self._batch_rows[b]} / {self._batch_tokens[b]}; rebuild"
            )
        bits, shift = _mask_bits(path, b, batch.column(3), offsets) if self.has_mask else (None, 0)
        columns = {n: _column_values(path, b, n, batch.column(i), offsets)
                   for n, i in self.columns.items()}  # fmt: skip
        return _Batch(
            values=values,
            offsets=offsets,
            records=arrow_numpy(batch.column(1)),
            pieces=arrow_numpy(batch.column(2)),
            mask_bits=bits,
            mask_shift=shift,
            nbytes=batch.nbytes if self.compressed else 0,
            columns=columns,
        )

    def check_ids(self) -> None:
        """Check every id against ``max_token_id``; ``CorruptShardError`` names the record batch."""
        for b in range(len(self._resident)):
            self._batch(b)

    def flat_rows(self) -> FlatRows | None:
        """An uncompressed shard as one token array over its mapped file; None when compressed.

        Ids are not checked: the caller checks those it reads. Raises ``CorruptShardError`` when a
        record batch's buffers lie outside the file or are misaligned.
        """
        if self.compressed:
            return None
        _, whole = self._file()
        itemsize = self.dtype.itemsize
        tokens = np.frombuffer(whole, dtype=np.uint8)
        starts, lengths = [], []
        for b in range(len(self._resident)):
            batch = self._batch(b, check_ids=False)
            base = batch.values.__array_interface__["data"][0] - whole.address
            if base % itemsize or not 0 <= base <= whole.size:
                raise CorruptShardError(
                    f"{self.path}: record batch {b} token values are misaligned; rebuild"
                )
            offsets = batch.offsets.astype(np.int64)
            starts.append(base // itemsize + offsets[:-1])
            lengths.append(offsets[1:] - offsets[:-1])
        usable = (len(tokens) // itemsize) * itemsize
        return FlatRows(
            tokens=tokens[:usable].view(self.dtype),
            starts=_joined(starts),
            lengths=_joined(lengths),
        )

    def mask_bit_starts(self) -> np.ndarray | None:
        """Per row, the bit position ``p`` of its loss mask in the mapped file.

        Bit ``p & 7`` (least significant first) of byte ``p >> 3``. None when compressed or without
        masks; ``CorruptShardError`` when a mask does not line up with its tokens.
        """
        if self.compressed or not self.has_mask:
            return None
        _, whole = self._file()
        parts = []
        for b in range(len(self._resident)):
            batch = self._batch(b, check_ids=False)
            bits = batch.mask_bits
            at = -1 if bits is None else bits.__array_interface__["data"][0] - whole.address
            short = bits is not None and (batch.mask_shift + len(batch.values) + 7) >> 3 > len(bits)
            if bits is None or short or at < 0 or at + len(bits) > whole.size:
                raise CorruptShardError(
                    f"{self.path}: the loss mask of record batch {b} does not line up with "
                    "its tokens; rebuild"
                )
            parts.append(8 * at + batch.mask_shift + batch.offsets[:-1].astype(np.int64))
        return _joined(parts)

    def _check_ids(self, b: int, values: np.ndarray) -> None:
        """Check that record batch ``b``'s ids are at most the tokenizer's largest, when known."""
        if self.max_token_id is not None and len(values):
            top = int(values.max())
            if top > self.max_token_id:
                raise CorruptShardError(
                    f"{self.path}: record batch {b} holds token id {top} but the tokenizer's "
                    f"largest id is {self.max_token_id} (manifest tokenizer.max_token_id); the "
                    "shard does not belong to this cache or is damaged: run `shardcache "
                    "verify` and rebuild"
                )

    # ---- access ----------------------------------------------------------------------------

    def _locate(self, row: int) -> tuple[int, int]:
        """The (record batch, row in it) of a row of the shard; ``IndexError`` when out of range."""
        if not 0 <= row < self.rows:
            raise IndexError(f"{self.path}: row {row} out of range 0..{self.rows - 1}")
        b = int(np.searchsorted(self._starts, row, side="right")) - 1
        return b, row - int(self._starts[b])

    def gather_into(
        self,
        rows: np.ndarray,
        starts: np.ndarray,
        lengths: np.ndarray,
        out_offsets: np.ndarray,
        tokens_out: np.ndarray,
        mask_out: np.ndarray | None,
        full_lengths: np.ndarray,
        columns_out: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        """Copy ``lengths[k]`` tokens from ``starts[k]`` of ``rows[k]`` to ``out_offsets[k]``.

        The loss mask goes to ``mask_out`` when given, each per-token column to its array of
        ``columns_out`` (one the shard lacks: its default); indices are computed once per record
        batch.
        The caller checked the segments against the length index's ``full_lengths``; here the stored
        rows are checked against it (``CorruptShardError`` when they differ).
        """
        which = np.searchsorted(self._starts, rows, side="right") - 1
        if len(self._starts) == 2:  # one record batch: no grouping
            groups = [(0, np.arange(len(rows)))]
        else:
            order = np.argsort(which, kind="stable")
            cut = np.flatnonzero(np.diff(which[order])) + 1
            groups = [(int(which[g[0]]), g) for g in np.split(order, cut)]
        for b, sel in groups:
            batch = self._batch(b)
            r = rows[sel] - self._starts[b]
            lo = batch.offsets[r].astype(np.int64)
            stored = batch.offsets[r + 1] - lo
            take = lengths[sel]
            if not np.array_equal(stored, full_lengths[sel]):
                k = int(np.flatnonzero(stored != full_lengths[sel])[0])
                raise CorruptShardError(
                    f"{self.path}: row {int(rows[sel][k])} holds {int(stored[k])} tokens but "
                    f"the length index says {int(full_lengths[sel][k])}; the index and the "
                    "shards disagree: run `shardcache verify` and rebuild"
                )
            first = starts[sel]
            slices = mask_out is None and not columns_out
            if slices and int(take.sum()) >= LONG_SEGMENT_TOKENS * len(take):
                values = batch.values
                pairs = zip((lo + first).tolist(), out_offsets[sel].tolist(), take.tolist())
                for source, target, count in pairs:
                    tokens_out[target : target + count] = values[source : source + count]
                continue
            src = flat_ranges(lo + first, take)
            dst = flat_ranges(out_offsets[sel], take)
            tokens_out[dst] = batch.values[src]
            if mask_out is not None:
                mask_out[dst] = batch.mask_at(src)
            for name, out in (columns_out or {}).items():
                out[dst] = batch.column_at(name, src)

    def tokens(self, row: int) -> np.ndarray:
        """The ids of one row, a read-only view; ``IndexError`` when out of range."""
        b, r = self._locate(row)
        batch = self._batch(b)
        return batch.values[batch.offsets[r] : batch.offsets[r + 1]]

    def tokens_many(self, rows: list[int]) -> list[np.ndarray]:
        """The ids of several rows, as read-only views."""
        return [self.tokens(row) for row in rows]

    def masks_many(self, rows: list[int]) -> list[np.ndarray]:
        """The loss masks (bool per token) of several rows; all True without stored masks."""
        out = []
        for row in rows:
            b, r = self._locate(row)
            batch = self._batch(b)
            lo, hi = int(batch.offsets[r]), int(batch.offsets[r + 1])
            out.append(batch.mask_at(np.arange(lo, hi, dtype=np.int64)))
        return out

    def provenance(self, row: int) -> tuple[int, int]:
        """Where one row came from: ``(record index in the source file, piece index)``."""
        b, r = self._locate(row)
        batch = self._batch(b)
        return int(batch.records[r]), int(batch.pieces[r])

    def provenance_all(self) -> tuple[np.ndarray, np.ndarray]:
        """Every row's ``(record index, piece index)``, as two int64 arrays."""
        batches = [self._batch(b, check_ids=False) for b in range(len(self._batch_rows))]
        records = _joined([np.asarray(batch.records, dtype=np.int64) for batch in batches])
        pieces = _joined([np.asarray(batch.pieces, dtype=np.int64) for batch in batches])
        return records, pieces

    def records(self) -> np.ndarray:
        """Every row's record index in its source file (int64), one record batch at a time."""
        parts = [self._batch(b, check_ids=False).records for b in range(len(self._batch_rows))]
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)

    def iter_rows(self) -> Iterator[tuple[np.ndarray, int, int]]:
        """Yield every row as ``(ids, record, piece)``, one record batch decoded at a time."""
        for b in range(len(self._batch_rows)):
            batch = self._batch(b)
            values, offsets = batch.values, batch.offsets
            for r in range(len(batch.records)):
                yield (
                    values[offsets[r] : offsets[r + 1]],
                    int(batch.records[r]),
                    int(batch.pieces[r]),
                )


def _mask_bits(
    path: str, b: int, column: pa.ListArray, offsets: np.ndarray
) -> tuple[np.ndarray, int]:
    """The packed bitmap of a list<bool> column's values and its bit offset (offsets checked)."""
    values = column.values
    if values.null_count or not np.array_equal(arrow_numpy(column.offsets), offsets):
        raise CorruptShardError(
            f"{path}: the loss mask of record batch {b} does not line up with its tokens; rebuild"
        )
    data = values.buffers()[1]
    bits = np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(0, np.uint8)
    return bits, values.offset


def _column_values(
    path: str, b: int, name: str, column: pa.ListArray, offsets: np.ndarray
) -> np.ndarray:
    """The values of a per-token column, checked to line up with the tokens."""
    values = column.values
    if values.null_count or not np.array_equal(arrow_numpy(column.offsets), offsets):
        raise CorruptShardError(
            f"{path}: the {TOKEN_COLUMNS[name].label} of record batch {b} do not line up with "
            "its tokens; rebuild"
        )
    return arrow_numpy(values)
