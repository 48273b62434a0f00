"""Where the token buffers of an Arrow IPC shard file lie, read from its flatbuffer metadata.

What this module owns
---------------------
:func:`mapped_layout` reads an uncompressed shard's footer and record batch headers straight
from the mapped file bytes (``struct`` over the flatbuffers of Arrow's ``File.fbs``,
``Message.fbs`` and ``Schema.fbs``): per record batch its row count, token count and the file
offsets of the ``tokens`` column's offsets and values buffers, plus the raw bytes of the
file's schema message. With them a reader views every row of the shard in the memory map
without ``pa.ipc.open_file`` and ``get_batch`` (~110 us + ~150 us per shard measured; this
reads the same in ~20 us), which is most of what opening a shard cost a reader process.

Trust: this parser only locates buffers. The shard reader accepts its result only when the
schema message is byte-identical to one that pyarrow's own reader already checked in this
process (so the column types are known), no record batch is compressed and no column has
nulls; it still checks the offsets against the token counts, the rows against the length
index and the file against its sha256. Anything unexpected returns ``None`` and the reader
takes pyarrow's path, which names the problem.

:func:`field` is the one flatbuffer table accessor (``shards._batch_layout`` uses it too).

Recorded layouts: the shard writer stores each uncompressed shard's layout in its manifest
entry (:func:`layout_record`: five integers per record batch, and the sha256 of the file it
describes). A reader whose file matched that sha256 (the very bytes the writer described,
schema included) takes the layout from there (:func:`recorded_layout`) instead of parsing
the file and having pyarrow check the schema once per process (~1.3 ms, the first open's
cost); offsets, rows and ids are checked as for a parsed layout, and an entry that does not
fit the file or names another sha256 is ignored.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

_MAGIC = b"ARROW1"
_CONTINUATION = 0xFFFFFFFF
_RECORD_BATCH = 3  # MessageHeader union: Schema = 1, DictionaryBatch = 2, RecordBatch = 3
#: Buffers of the leading ``tokens: list<...>`` column in a record batch (depth-first):
#: list validity, list offsets, values validity, values data.
_TOKEN_OFFSETS, _TOKEN_VALUES = 1, 3


def field(meta: memoryview | bytes, table: int, index: int) -> int:
    """The offset of field ``index`` of the flatbuffer table at ``table`` relative to the
    table (0 when the field is absent: its default applies)."""
    vtable = table - struct.unpack_from("<i", meta, table)[0]
    size = struct.unpack_from("<H", meta, vtable)[0]
    if 4 + 2 * index >= size:
        return 0
    return struct.unpack_from("<H", meta, vtable + 4 + 2 * index)[0]


def _target(meta: memoryview, table: int, index: int) -> int:
    """Where the table or vector that field ``index`` refers to starts (-1 when absent)."""
    at = field(meta, table, index)
    if not at:
        return -1
    at += table
    return at + struct.unpack_from("<I", meta, at)[0]


@dataclass(frozen=True)
class BatchLayout:
    """One record batch: ``rows``, ``tokens`` (values), and the absolute file offsets (bytes)
    of the token column's int32 offsets (``rows + 1`` of them) and of its values."""

    rows: int
    tokens: int
    offsets_at: int
    values_at: int
    values_bytes: int


@dataclass(frozen=True)
class MappedLayout:
    """A shard file's record batches and its schema message as bytes."""

    schema: bytes
    batches: tuple[BatchLayout, ...]


def mapped_layout(data: memoryview) -> MappedLayout | None:
    """The layout of the uncompressed Arrow IPC file ``data`` (its whole bytes), or None when
    it is anything else: not an IPC file, compressed batches, nulls, dictionaries, metadata
    this parser does not expect (the reader then opens it with pyarrow)."""
    try:
        return _parse(data)
    except (struct.error, IndexError, ValueError):
        return None


def _parse(data: memoryview) -> MappedLayout | None:
    size = len(data)
    if size < 24 or bytes(data[:6]) != _MAGIC or bytes(data[size - 6 :]) != _MAGIC:
        return None
    footer_len = struct.unpack_from("<i", data, size - 10)[0]
    footer = size - 10 - footer_len
    if footer_len <= 0 or footer < 8:
        return None
    meta = data[footer : size - 10]
    root = struct.unpack_from("<I", meta, 0)[0]
    dictionaries = _target(meta, root, 2)
    if dictionaries >= 0 and struct.unpack_from("<I", meta, dictionaries)[0]:
        return None
    blocks = _target(meta, root, 3)
    if blocks < 0:
        return None
    count = struct.unpack_from("<I", meta, blocks)[0]
    batches = []
    for i in range(count):
        offset, meta_len, body_len = struct.unpack_from("<qi4xq", meta, blocks + 4 + 24 * i)
        batch = _record_batch(data, offset, meta_len, body_len)
        if batch is None:
            return None
        batches.append(batch)
    schema = schema_message(data)
    if schema is None:
        return None
    return MappedLayout(schema, tuple(batches))


def schema_message(data: memoryview) -> bytes | None:
    """The flatbuffer bytes of the schema message of the IPC file ``data`` (None when there
    is none where the file format puts it)."""
    try:
        span = _message(data, 8)
    except struct.error:
        return None
    return None if span is None else bytes(data[span[0] : span[1]])


def _message(data: memoryview, offset: int) -> tuple[int, int] | None:
    """``(start, end)`` of the flatbuffer of the message at ``offset`` (after its prefix)."""
    first = struct.unpack_from("<I", data, offset)[0]
    if first != _CONTINUATION:
        return None
    length = struct.unpack_from("<i", data, offset + 4)[0]
    start = offset + 8
    if length <= 0 or start + length > len(data):
        return None
    return start, start + length


def _record_batch(
    data: memoryview, offset: int, meta_len: int, body_len: int
) -> BatchLayout | None:
    span = _message(data, offset)
    body = offset + meta_len
    if span is None or body + body_len > len(data) or span[1] > body:
        return None
    meta = data[span[0] : span[1]]
    root = struct.unpack_from("<I", meta, 0)[0]
    kind = field(meta, root, 1)
    if not kind or meta[root + kind] != _RECORD_BATCH:
        return None
    header = _target(meta, root, 2)
    if header < 0 or field(meta, header, 3):  # BodyCompression present: compressed
        return None
    at = field(meta, header, 0)
    rows = struct.unpack_from("<q", meta, header + at)[0] if at else 0
    nodes = _target(meta, header, 1)
    buffers = _target(meta, header, 2)
    if nodes < 0 or buffers < 0:
        return None
    num_nodes = struct.unpack_from("<I", meta, nodes)[0]
    num_buffers = struct.unpack_from("<I", meta, buffers)[0]
    if num_nodes < 2 or num_buffers <= _TOKEN_VALUES:
        return None
    for n in range(num_nodes):  # (length, null_count) per field node: no nulls anywhere
        if struct.unpack_from("<q", meta, nodes + 4 + 16 * n + 8)[0]:
            return None
    list_rows = struct.unpack_from("<q", meta, nodes + 4)[0]
    tokens = struct.unpack_from("<q", meta, nodes + 4 + 16)[0]
    off_at, off_len = struct.unpack_from("<qq", meta, buffers + 4 + 16 * _TOKEN_OFFSETS)
    val_at, val_len = struct.unpack_from("<qq", meta, buffers + 4 + 16 * _TOKEN_VALUES)
    if list_rows != rows or rows < 0 or tokens < 0:
        return None
    if off_len < 4 * (rows + 1) or off_at + off_len > body_len or val_at + val_len > body_len:
        return None
    return BatchLayout(rows, tokens, body + off_at, body + val_at, val_len)


#: hex digits of a file's sha256 kept in its layout record
BINDING_DIGITS = 16


def layout_record(layout: MappedLayout, sha256: str) -> dict[str, Any]:
    """``layout`` as a manifest entry stores it: the start of the sha256 of the file it
    describes (:data:`BINDING_DIGITS` hex digits: it binds the record to one version of the
    file, the entry's full sha256 checks the file) and per record batch ``[rows, tokens,
    offsets_at, values_at, values_bytes]``."""
    batches = [
        [b.rows, b.tokens, b.offsets_at, b.values_at, b.values_bytes] for b in layout.batches
    ]
    return {"sha256": sha256[:BINDING_DIGITS], "batches": batches}


def recorded_layout(record: object, sha256: str, size: int) -> MappedLayout | None:
    """The layout a manifest entry recorded (:func:`layout_record`) for the file of sha256
    ``sha256`` and ``size`` bytes, or None when there is none, it describes another file
    version or it does not fit the file (the caller parses the file instead). Its schema is
    empty: the file's sha256 vouches for the writer's schema."""
    if not isinstance(record, dict) or record.get("sha256") != sha256[:BINDING_DIGITS]:
        return None
    entries = record.get("batches")
    if not isinstance(entries, list) or not entries:
        return None
    batches = []
    for entry in entries:
        if not isinstance(entry, list) or len(entry) != 5:
            return None
        rows, tokens, offsets_at, values_at, values_bytes = (int(v) for v in entry)
        if (
            min(rows, tokens, offsets_at, values_at, values_bytes) < 0
            or offsets_at + 4 * (rows + 1) > size
            or values_at + values_bytes > size
        ):
            return None
        batches.append(BatchLayout(rows, tokens, offsets_at, values_at, values_bytes))
    return MappedLayout(b"", tuple(batches))
