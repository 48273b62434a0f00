"""Inputs: list them deterministically, stream their records with provenance.

Owns two things:

* :func:`list_inputs` turns files, folders and globs into a sorted list of
  :class:`InputFile` with a *relative path* (relative to the common parent folder of all
  inputs), so a corpus moved as a whole keeps the same provenance and cache key.
* :func:`split_input` cuts a large input into :class:`InputSlice` s for parallel builds:
  an uncompressed jsonl file into byte ranges that start and end at line boundaries, a
  parquet file into runs of row groups. Compressed jsonl.zst / json.gz files cannot be
  entered in the middle, so they stay one slice each (split such corpora into several files).
  The split pass reads a jsonl file once with ``bytes.count``/``find`` (~GB/s) and hashes it
  on the way, so each slice knows the file-global number of its first line and the file's
  sha256 is still the hash of its whole bytes.
* :func:`iter_text_batches` streams one file (or one slice) as batches of
  ``(texts, record_indices)``. Nothing holds more than one batch of records: a batch is
  flushed at ``batch_docs`` documents or :data:`MAX_BATCH_CHARS` characters of text,
  whichever comes first, so a corpus of huge documents does not multiply memory by
  ``batch_docs`` (a single document larger than that is a batch of its own). The record index
  is the file-global 0-based line number for jsonl formats (blank and bad lines count, so it
  always points at the physical line) and the row number for parquet.

While a line-based file is read, its raw (compressed) bytes are hashed on the way through
(:class:`HashingReader`), so the data component of the cache key costs no second pass.
Bad records are never silently dropped: each one is handed to an ``on_bad`` callback with its
reason (one of :data:`BAD_REASONS`), and with ``on_error="fail"`` raises
:class:`~shardcache.errors.BadRecordError`. A truncated or corrupt compressed file (or an
unreadable parquet row group) raises :class:`~shardcache.errors.SourceError` naming the file,
the last good line and the compressed offset; with ``on_error="skip"`` and an ``on_corrupt``
callback the records decoded before the damage are kept (they are complete, valid lines), the
loss is reported once (reason ``corrupt_file``) and the rest of that file is skipped.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np
import zstandard

from shardcache.build.chat import validate_messages
from shardcache.errors import BadRecordError, SourceError
from shardcache.store.files import READ_CHUNK, HashingReader, sha256_file
from shardcache.store.remote import filesystem, is_url

FORMATS = ("jsonl", "jsonl.zst", "json.gz", "parquet")
_SUFFIXES = {
    ".jsonl": "jsonl",
    ".jsonl.zst": "jsonl.zst",
    ".json.gz": "json.gz",
    ".jsonl.gz": "json.gz",
    ".parquet": "parquet",
}
BAD_REASONS = (
    "not_json",
    "not_an_object",
    "invalid_utf8",
    "no_text_field",
    "text_not_string",
    "empty_text",
    "blank_line",
    "corrupt_file",  # a damaged compressed file / parquet row group: the rest is lost
)
#: A batch is flushed at this many characters of text even below ``batch_docs`` documents.
#: 8 Mi characters keep one batch (texts + ids + encodings) at a few tens of MB while staying
#: far above the size where per-call overhead of ``encode_batch`` matters.
MAX_BATCH_CHARS = 8 * 1024 * 1024
_SCAN_CHUNK = 8 << 20
#: read size of an input on object storage: each read of a URL input is a range request of
#: this many bytes (fsspec's read-ahead cache holds one block), so memory stays bounded
URL_BLOCK_BYTES = 8 << 20

#: Called as ``on_bad(record_index, reason, excerpt)`` for every skipped record.
BadRecordCallback = Callable[[int, str, str], None]
#: Called as ``on_corrupt(record_index, compressed_offset, message)`` when a file is damaged:
#: ``record_index`` is the first line/row that could not be read.
CorruptFileCallback = Callable[[int, int, str], None]


@dataclass(frozen=True)
class InputFile:
    """One input file: absolute path (or URL), path relative to the corpus root, size,
    format; ``mtime_ns``: the modification time when the path cannot be ``stat``-ed (a URL)."""

    path: str
    relpath: str
    size: int
    format: str
    mtime_ns: int | None = None


def open_input(file: InputFile) -> BinaryIO:
    """Open an input for reading: a local file, or for a URL an fsspec file object whose
    reads are range requests of :data:`URL_BLOCK_BYTES` (streamed, never staged whole;
    seeks for byte-range partitions and parquet footers/row groups are range reads)."""
    if is_url(file.path):
        fs, path = filesystem(file.path)
        handle: BinaryIO = fs.open(path, "rb", block_size=URL_BLOCK_BYTES, cache_type="readahead")
        return handle
    return open(file.path, "rb")  # the caller closes it


def sha256_input(file: InputFile) -> str:
    """sha256 of an input's bytes (streamed for a URL)."""
    if not is_url(file.path):
        return sha256_file(file.path)
    with HashingReader(open_input(file)) as reader:  # type: ignore[arg-type]
        reader.drain()
        return reader.sha256.hexdigest()


def detect_format(path: str) -> str | None:
    """The input format implied by a file name, or None for files that are not inputs."""
    name = os.path.basename(path).lower()
    for suffix in sorted(_SUFFIXES, key=len, reverse=True):
        if name.endswith(suffix):
            return _SUFFIXES[suffix]
    return None


def _expand(spec: str) -> list[str]:
    if any(ch in spec for ch in "*?["):
        matches = glob.glob(spec, recursive=True)
        if not matches:
            raise SourceError(f"input {spec!r}: the pattern matches no file; check the path")
        return [m for m in matches if os.path.isfile(m)]
    if os.path.isdir(spec):
        found = []
        for root, dirs, files in os.walk(spec):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            found += [os.path.join(root, f) for f in files if detect_format(f)]
        if not found:
            raise SourceError(
                f"input {spec!r}: the folder holds no input file ({', '.join(FORMATS)})"
            )
        return found
    if os.path.isfile(spec):
        return [spec]
    raise SourceError(f"input {spec!r}: no such file or folder")


def list_inputs(specs: tuple[str, ...] | list[str]) -> list[InputFile]:
    """Resolve files / folders / globs into input files, sorted by relative path.

    A file given explicitly must have a known format; files inside folders without one are
    ignored. The same file reached twice (e.g. by a folder and a glob) is listed once.
    """
    paths: set[str] = set()
    for spec in specs:
        for p in _expand(os.fspath(spec)):
            if detect_format(p) is None:
                raise SourceError(
                    f"input {p!r}: unknown format; expected a name ending in "
                    f"{', '.join(sorted(_SUFFIXES))}"
                )
            paths.add(os.path.realpath(p))
    if not paths:
        raise SourceError(f"inputs {list(specs)}: no input file found")
    root = os.path.commonpath([os.path.dirname(p) for p in paths])
    files = [
        InputFile(
            path=p,
            relpath=os.path.relpath(p, root).replace(os.sep, "/"),
            size=os.path.getsize(p),
            format=detect_format(p) or "",
        )
        for p in paths
    ]
    files.sort(key=lambda f: f.relpath)
    return files


@dataclass(frozen=True)
class InputSlice:
    """The part of one input file that one partition reads.

    ``start``/``end`` are byte offsets (jsonl; ``end`` None = to the end of the file),
    ``first_record`` the file-global index of its first line or row, ``row_groups`` the
    parquet row groups (None = all).
    """

    start: int = 0
    end: int | None = None
    first_record: int = 0
    row_groups: tuple[int, ...] | None = None

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.end is None and self.row_groups is None

    def to_json(self) -> dict[str, Any]:
        return {
            "start": self.start,
            "end": self.end,
            "first_record": self.first_record,
            "row_groups": list(self.row_groups) if self.row_groups is not None else None,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> InputSlice:
        groups = data.get("row_groups")
        return cls(
            int(data["start"]),
            None if data["end"] is None else int(data["end"]),
            int(data["first_record"]),
            None if groups is None else tuple(int(g) for g in groups),
        )


def split_input(file: InputFile, partition_size_bytes: int) -> tuple[list[InputSlice], str]:
    """Cut ``file`` into slices of about ``partition_size_bytes``.

    Returns the slices and, when the file was read to split it, its sha256 ("" otherwise: the
    map step hashes whole-file partitions as it reads them). Files at or below the size, and
    compressed jsonl, are one slice.
    """
    if file.size <= partition_size_bytes or file.format not in ("jsonl", "parquet"):
        return [InputSlice()], ""
    if file.format == "parquet":
        return _split_parquet(file, partition_size_bytes), sha256_input(file)
    return _split_lines(file, partition_size_bytes)


def _split_lines(file: InputFile, size: int) -> tuple[list[InputSlice], str]:
    """One pass: hash, count newlines, and cut after the first newline past each target."""
    slices: list[InputSlice] = []
    start, first_line = 0, 0
    target = size
    pos = 0  # file offset of chunk[0]
    lines_before_chunk = 0
    try:
        f = open_input(file)
    except OSError as err:
        raise SourceError(f"{file.relpath}: cannot open: {err}") from err
    reader = HashingReader(f)  # type: ignore[arg-type]
    with reader:
        while chunk := reader.read(_SCAN_CHUNK):
            while target < pos + len(chunk):
                nl = chunk.find(b"\n", max(0, target - pos))
                if nl < 0:
                    break
                end = pos + nl + 1
                lines = lines_before_chunk + chunk.count(b"\n", 0, nl + 1)
                if end < file.size:
                    slices.append(InputSlice(start, end, first_line))
                    start, first_line = end, lines
                target = end + size
            lines_before_chunk += chunk.count(b"\n")
            pos += len(chunk)
    slices.append(InputSlice(start, None, first_line))
    return slices, reader.sha256.hexdigest()


def _split_parquet(file: InputFile, size: int) -> list[InputSlice]:
    """Runs of consecutive row groups of about ``size`` compressed bytes each."""
    import pyarrow.parquet as pq

    try:
        with open_input(file) as f:
            meta = pq.ParquetFile(f).metadata
    except Exception:  # unreadable: one slice, whose read reports the error
        return [InputSlice()]
    slices: list[InputSlice] = []
    groups: list[int] = []
    group_bytes, first_row, row = 0, 0, 0
    for g in range(meta.num_row_groups):
        rg = meta.row_group(g)
        groups.append(g)
        group_bytes += sum(rg.column(c).total_compressed_size for c in range(rg.num_columns))
        row += rg.num_rows
        if group_bytes >= size:
            slices.append(InputSlice(0, None, first_row, tuple(groups)))
            groups, group_bytes, first_row = [], 0, row
    if groups or not slices:
        slices.append(InputSlice(0, None, first_row, tuple(groups)))
    if len(slices) == 1:
        return [InputSlice()]
    return slices


class _RangeReader(io.RawIOBase):
    """Raw reads of ``[start, end)`` of a file (``end`` None = to its end)."""

    def __init__(self, raw: BinaryIO, start: int, end: int | None):
        self._raw = raw
        raw.seek(start)
        self._left = None if end is None else end - start

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer)
        if self._left is not None:
            if self._left <= 0:
                return 0
            view = view[: self._left]
        n = self._raw.readinto(view) or 0  # type: ignore[attr-defined]
        if self._left is not None:
            self._left -= n
        return n

    def close(self) -> None:
        self._raw.close()
        super().close()


@dataclass
class TextBatch:
    """Up to ``batch_docs`` valid texts of one file with their record indices."""

    texts: list[str]
    records: np.ndarray  # int64, record index of each text in its file


def _excerpt(data: bytes | str, limit: int = 120) -> str:
    if isinstance(data, bytes):
        data = data.decode("utf-8", errors="replace")
    data = data.strip()
    return data if len(data) <= limit else data[:limit] + "…"


def _validate(obj: Any, text_field: str, kind: str = "text") -> tuple[Any, str | None]:
    """Return (value, None) for a valid record, else (None, reason). ``kind="chat"``: the
    field holds a conversation (a list of {role, content} messages)."""
    if not isinstance(obj, dict):
        return None, "not_an_object"
    if kind == "chat":
        reason = validate_messages(obj.get(text_field))
        return (None, reason) if reason is not None else (obj[text_field], None)
    if text_field not in obj or obj[text_field] is None:
        return None, "no_text_field"
    text = obj[text_field]
    if not isinstance(text, str):
        return None, "text_not_string"
    if not text:
        return None, "empty_text"
    return text, None


class ZstdReader(io.RawIOBase):
    """Decompresses concatenated zstd frames; a file that ends inside a frame is an error
    (``stream_reader`` would report a silent, early end of data)."""

    def __init__(self, raw: io.RawIOBase):
        self._raw = raw
        self._dctx = zstandard.ZstdDecompressor()
        self._obj = self._dctx.decompressobj()
        self._in_frame = False
        self._pending = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._pending:
            chunk = self._raw.read(READ_CHUNK)
            if not chunk:
                if self._in_frame:
                    raise zstandard.ZstdError("input ends inside a zstd frame (truncated file)")
                return 0
            out = []
            while chunk:
                self._in_frame = True
                out.append(self._obj.decompress(chunk))
                if self._obj.eof:
                    chunk = self._obj.unused_data
                    self._obj = self._dctx.decompressobj()
                    self._in_frame = False
                else:
                    chunk = b""
            self._pending = memoryview(b"".join(out))
        n = min(len(buffer), len(self._pending))
        buffer[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n


def _open_lines(raw: HashingReader, fmt: str) -> io.BufferedIOBase:
    if fmt == "jsonl":
        return io.BufferedReader(raw, buffer_size=READ_CHUNK)
    if fmt == "jsonl.zst":
        return io.BufferedReader(ZstdReader(raw), buffer_size=READ_CHUNK)
    if fmt == "json.gz":
        return gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[return-value]
    raise SourceError(f"format {fmt!r} is not line-based")


class _Batcher:
    """Collects valid texts into batches; routes bad records to the callback or raises."""

    def __init__(
        self,
        relpath: str,
        batch_docs: int,
        on_error: str,
        on_bad: BadRecordCallback | None,
        on_corrupt: CorruptFileCallback | None = None,
    ):
        self.relpath = relpath
        self.batch_docs = batch_docs
        self.on_error = on_error
        self.on_bad = on_bad
        self.on_corrupt = on_corrupt
        self.kind = "text"
        self.texts: list[str] = []
        self.records: list[int] = []
        self.chars = 0

    def bad(self, index: int, reason: str, raw: bytes | str) -> None:
        excerpt = _excerpt(raw)
        if self.on_error == "fail":
            raise BadRecordError(
                f"{self.relpath}: record {index} is invalid ({reason}): {excerpt!r}; fix the "
                "input or build with --on-error skip to quarantine bad records"
            )
        if self.on_bad is not None:
            self.on_bad(index, reason, excerpt)

    def corrupt(self, index: int, offset: int, message: str, err: BaseException) -> None:
        """The file is damaged from record ``index`` on: report it once, or raise."""
        if self.on_error == "fail" or self.on_corrupt is None:
            raise SourceError(
                f"{message}; the file is truncated or corrupt: re-create or remove it, or "
                "build with --on-error skip to keep the records before the damage"
            ) from err
        self.on_corrupt(index, offset, message)

    def add(self, index: int, text: Any) -> list[TextBatch]:
        """Add one text (or conversation); returns the batches that became full (usually
        none)."""
        full = []
        size = len(text) if isinstance(text, str) else sum(len(m["content"]) for m in text)
        if self.texts and self.chars + size > MAX_BATCH_CHARS:
            full.append(self.flush())  # a huge text does not join (and inflate) a batch
        self.texts.append(text)
        self.records.append(index)
        self.chars += size
        if len(self.texts) >= self.batch_docs or self.chars >= MAX_BATCH_CHARS:
            full.append(self.flush())
        return [b for b in full if b is not None]

    def flush(self) -> TextBatch | None:
        if not self.texts:
            return None
        batch = TextBatch(self.texts, np.asarray(self.records, dtype=np.int64))
        self.texts, self.records, self.chars = [], [], 0
        return batch


def _iter_lines(
    file: InputFile, raw: HashingReader, batcher: _Batcher, text_field: str, first_record: int
) -> Iterator[TextBatch]:
    stream = _open_lines(raw, file.format)
    index = first_record - 1
    try:
        for index, line in enumerate(stream, first_record):
            if not line.strip():
                batcher.bad(index, "blank_line", line)
                continue
            try:
                decoded = line.decode("utf-8")
            except UnicodeDecodeError:
                batcher.bad(index, "invalid_utf8", line)
                continue
            try:
                obj = json.loads(decoded)
            except json.JSONDecodeError:
                batcher.bad(index, "not_json", decoded)
                continue
            text, reason = _validate(obj, text_field, batcher.kind)
            if reason is not None:
                batcher.bad(index, reason, decoded)
                continue
            yield from batcher.add(index, text)  # type: ignore[arg-type]
    except (zstandard.ZstdError, OSError, EOFError, zlib.error) as err:
        message = (
            f"{file.relpath}: cannot decompress {file.format} data after line {index + 1} "
            f"(compressed offset ~{raw.bytes_read} of {file.size} bytes): {err}"
        )
        batcher.corrupt(index + 1, raw.bytes_read, message, err)
    raw.drain()  # the digest must cover bytes a decompressor did not need (trailing data)
    batch = batcher.flush()
    if batch is not None:
        yield batch


def _iter_parquet(
    file: InputFile, batcher: _Batcher, text_field: str, part: InputSlice
) -> Iterator[TextBatch]:
    try:
        handle = open_input(file)
    except OSError as err:  # as an unreadable footer: reported, not raised
        message = f"{file.relpath}: not a readable parquet file: {err}"
        batcher.corrupt(part.first_record, 0, message, err)
        return
    with handle:
        yield from _iter_parquet_file(file, handle, batcher, text_field, part)


def _iter_parquet_file(
    file: InputFile, handle: BinaryIO, batcher: _Batcher, text_field: str, part: InputSlice
) -> Iterator[TextBatch]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    row = part.first_record
    try:
        pf = pq.ParquetFile(handle)
    except Exception as err:  # pyarrow raises several types for a bad footer
        batcher.corrupt(row, 0, f"{file.relpath}: not a readable parquet file: {err}", err)
        return
    names = pf.schema_arrow.names
    if text_field not in names:
        raise SourceError(
            f"{file.relpath}: parquet file has no column {text_field!r} (columns: {names}); "
            "pass --text-field with one of them"
        )
    groups = list(part.row_groups) if part.row_groups is not None else None
    batches = pf.iter_batches(
        batch_size=min(batcher.batch_docs, 65536), columns=[text_field], row_groups=groups
    )
    while True:
        try:
            record_batch = next(batches, None)
        except (pa.ArrowException, OSError) as err:
            message = f"{file.relpath}: cannot read parquet data at row {row}: {err}"
            batcher.corrupt(row, 0, message, err)
            break
        if record_batch is None:
            break
        for value in record_batch.column(0).to_pylist():
            text, reason = _validate({text_field: value}, text_field, batcher.kind)
            if reason is not None:
                batcher.bad(row, reason, repr(value))
            else:
                yield from batcher.add(row, text)  # type: ignore[arg-type]
            row += 1
    batch = batcher.flush()
    if batch is not None:
        yield batch


@dataclass
class FileDigest:
    """Filled in once a file has been read to the end."""

    sha256: str = ""


def iter_text_batches(
    file: InputFile,
    text_field: str = "text",
    batch_docs: int = 1024,
    on_error: str = "skip",
    on_bad: BadRecordCallback | None = None,
    on_bytes: Callable[[int], None] | None = None,
    digest: FileDigest | None = None,
    part: InputSlice | None = None,
    on_corrupt: CorruptFileCallback | None = None,
    kind: str = "text",
) -> Iterator[TextBatch]:
    """Stream a file's (or one slice's) valid records as :class:`TextBatch` es.

    ``on_bytes(n)`` is called as raw bytes are consumed (progress); when a whole file has been
    read to the end, ``digest.sha256`` holds the sha256 of the file's bytes (a slice leaves it
    empty: :func:`split_input` hashed the file).
    """
    part = part or InputSlice()
    batcher = _Batcher(file.relpath, batch_docs, on_error, on_bad, on_corrupt)
    batcher.kind = kind  # "text": a string field; "chat": a list of {role, content} messages
    if file.format == "parquet":
        yield from _iter_parquet(file, batcher, text_field, part)
        if part.whole:
            sha = sha256_input(file)
            if digest is not None:
                digest.sha256 = sha
        if on_bytes is not None:
            on_bytes(file.size if part.whole else 0)
        return
    try:
        handle = open_input(file)  # closed by the HashingReader below
    except OSError as err:
        raise SourceError(f"{file.relpath}: cannot open: {err}") from err
    source: Any = handle if part.whole else _RangeReader(handle, part.start, part.end)
    raw = HashingReader(source, on_bytes)
    try:
        yield from _iter_lines(file, raw, batcher, text_field, part.first_record)
        if digest is not None and part.whole:
            digest.sha256 = raw.sha256.hexdigest()
    finally:
        raw.close()
