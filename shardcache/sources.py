"""Inputs: list them deterministically, stream their records with provenance.

Owns two things:

* :func:`list_inputs` turns files, folders and globs into a sorted list of
  :class:`InputFile` with a *relative path* (relative to the common parent folder of all
  inputs), so a corpus moved as a whole keeps the same provenance and cache key.
* :func:`iter_text_batches` streams one file as batches of ``(texts, record_indices)``.
  Nothing holds more than one batch of records. The record index is the 0-based line number
  for jsonl formats (blank and bad lines count, so it always points at the physical line) and
  the row number for parquet.

While a line-based file is read, its raw (compressed) bytes are hashed on the way through
(:class:`HashingReader`), so the data component of the cache key costs no second pass.
Bad records are never silently dropped: each one is handed to an ``on_bad`` callback with its
reason (one of :data:`BAD_REASONS`), and with ``on_error="fail"`` raises
:class:`~shardcache.errors.BadRecordError`.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import io
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np
import zstandard

from shardcache.errors import BadRecordError, SourceError

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
)
_READ_CHUNK = 1 << 20

#: Called as ``on_bad(record_index, reason, excerpt)`` for every skipped record.
BadRecordCallback = Callable[[int, str, str], None]


@dataclass(frozen=True)
class InputFile:
    """One input file: absolute path, path relative to the corpus root, size, format."""

    path: str
    relpath: str
    size: int
    format: str


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


class HashingReader(io.RawIOBase):
    """A raw reader that hashes (sha256) and counts every byte read through it."""

    def __init__(self, raw: BinaryIO, on_bytes: Callable[[int], None] | None = None):
        self._raw = raw
        self._on_bytes = on_bytes
        self.sha256 = hashlib.sha256()
        self.bytes_read = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = self._raw.readinto(buffer)
        if n:
            view = memoryview(buffer)[:n]
            self.sha256.update(view)
            self.bytes_read += n
            if self._on_bytes is not None:
                self._on_bytes(n)
        return n or 0

    def drain(self) -> None:
        """Read (and hash) whatever is left, so the digest covers the whole file."""
        buf = bytearray(_READ_CHUNK)
        while self.readinto(buf):
            pass

    def close(self) -> None:
        self._raw.close()
        super().close()


def hash_file(path: str, on_bytes: Callable[[int], None] | None = None) -> str:
    """sha256 hex digest of a file, read in 1 MiB chunks."""
    with open(path, "rb") as f:
        reader = HashingReader(f, on_bytes)  # type: ignore[arg-type]
        reader.drain()
        return reader.sha256.hexdigest()


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


def _validate(obj: Any, text_field: str) -> tuple[str | None, str | None]:
    """Return (text, None) for a valid record, else (None, reason)."""
    if not isinstance(obj, dict):
        return None, "not_an_object"
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
            chunk = self._raw.read(_READ_CHUNK)
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
        return io.BufferedReader(raw, buffer_size=_READ_CHUNK)
    if fmt == "jsonl.zst":
        return io.BufferedReader(ZstdReader(raw), buffer_size=_READ_CHUNK)
    if fmt == "json.gz":
        return gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[return-value]
    raise SourceError(f"format {fmt!r} is not line-based")


class _Batcher:
    """Collects valid texts into batches; routes bad records to the callback or raises."""

    def __init__(
        self, relpath: str, batch_docs: int, on_error: str, on_bad: BadRecordCallback | None
    ):
        self.relpath = relpath
        self.batch_docs = batch_docs
        self.on_error = on_error
        self.on_bad = on_bad
        self.texts: list[str] = []
        self.records: list[int] = []

    def bad(self, index: int, reason: str, raw: bytes | str) -> None:
        excerpt = _excerpt(raw)
        if self.on_error == "fail":
            raise BadRecordError(
                f"{self.relpath}: record {index} is invalid ({reason}): {excerpt!r}; fix the "
                "input or build with --on-error skip to quarantine bad records"
            )
        if self.on_bad is not None:
            self.on_bad(index, reason, excerpt)

    def add(self, index: int, text: str) -> TextBatch | None:
        self.texts.append(text)
        self.records.append(index)
        if len(self.texts) >= self.batch_docs:
            return self.flush()
        return None

    def flush(self) -> TextBatch | None:
        if not self.texts:
            return None
        batch = TextBatch(self.texts, np.asarray(self.records, dtype=np.int64))
        self.texts, self.records = [], []
        return batch


def _iter_lines(
    file: InputFile, raw: HashingReader, batcher: _Batcher, text_field: str
) -> Iterator[TextBatch]:
    stream = _open_lines(raw, file.format)
    index = -1
    try:
        for index, line in enumerate(stream):
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
            text, reason = _validate(obj, text_field)
            if reason is not None:
                batcher.bad(index, reason, decoded)
                continue
            batch = batcher.add(index, text)  # type: ignore[arg-type]
            if batch is not None:
                yield batch
    except (zstandard.ZstdError, OSError, EOFError) as err:
        raise SourceError(
            f"{file.relpath}: cannot decompress {file.format} data after line {index + 1} "
            f"(compressed offset ~{raw.bytes_read} of {file.size} bytes): {err}; the file is "
            "truncated or corrupt, re-create or remove it"
        ) from err
    raw.drain()  # the digest must cover bytes a decompressor did not need (trailing data)
    batch = batcher.flush()
    if batch is not None:
        yield batch


def _iter_parquet(file: InputFile, batcher: _Batcher, text_field: str) -> Iterator[TextBatch]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(file.path)
    except Exception as err:  # pyarrow raises several types for a bad footer
        raise SourceError(f"{file.relpath}: not a readable parquet file: {err}") from err
    names = pf.schema_arrow.names
    if text_field not in names:
        raise SourceError(
            f"{file.relpath}: parquet file has no column {text_field!r} (columns: {names}); "
            "pass --text-field with one of them"
        )
    row = 0
    for record_batch in pf.iter_batches(batch_size=batcher.batch_docs, columns=[text_field]):
        for value in record_batch.column(0).to_pylist():
            text, reason = _validate({text_field: value}, text_field)
            if reason is not None:
                batcher.bad(row, reason, repr(value))
            else:
                batch = batcher.add(row, text)  # type: ignore[arg-type]
                if batch is not None:
                    yield batch
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
) -> Iterator[TextBatch]:
    """Stream a file's valid records as :class:`TextBatch` es.

    ``on_bytes(n)`` is called as raw bytes are consumed (progress); when the file has been
    read to the end, ``digest.sha256`` holds the sha256 of the file's bytes.
    """
    batcher = _Batcher(file.relpath, batch_docs, on_error, on_bad)
    if file.format == "parquet":
        yield from _iter_parquet(file, batcher, text_field)
        sha = hash_file(file.path)
        if on_bytes is not None:
            on_bytes(file.size)
        if digest is not None:
            digest.sha256 = sha
        return
    try:
        handle = open(file.path, "rb")  # noqa: SIM115 - closed by the HashingReader below
    except OSError as err:
        raise SourceError(f"{file.relpath}: cannot open: {err}") from err
    raw = HashingReader(handle, on_bytes)  # type: ignore[arg-type]
    try:
        yield from _iter_lines(file, raw, batcher, text_field)
        if digest is not None:
            digest.sha256 = raw.sha256.hexdigest()
    finally:
        raw.close()
