"""Inputs: list them deterministically, stream their records with provenance.

Owns two things:

* :func:`list_inputs` turns files, folders and globs into a sorted list of
  :class:`InputFile` with a *relative path* (relative to the common parent folder of all
  inputs), so a corpus moved as a whole keeps the same provenance and cache key. A symbolic
  link is listed under its own name (its format and provenance come from the link, as in a
  Hugging Face hub snapshot). The build's output and any folder holding a cache or a build
  state are skipped (a cache inside its corpus folder must not feed itself), and anything
  that is not a regular file (a FIFO, a socket, /dev/zero, a symlink loop) is refused at
  listing, naming it, instead of hanging the build.
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

Line-based files (jsonl, jsonl.zst, json, json.gz) hold JSON lines, lines ended by CR alone,
or one top-level array of objects (a common export form, read element by element by
:func:`array_items` with one element in memory); a UTF-8 BOM is skipped. The layout is told
from the first 64 KiB (:func:`record_layout`).

A record that fails anywhere on its own is that record's: a lone surrogate (valid JSON, not
text) is ``invalid_unicode``, nesting past the parser's limit ``too_deep``, and a tokenizer
failure on one record ``encode_error`` (:func:`~shardcache.builder.tokenize.encode_isolating`).

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

import contextlib
import difflib
import errno
import glob
import gzip
import hashlib
import io
import json
import os
import re
import stat
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np
import zstandard

from shardcache.builder.chat import validate_messages
from shardcache.builder.stage_times import StageTimes
from shardcache.errors import BadRecordError, ConfigError, SourceError
from shardcache.store.files import READ_CHUNK, HashingReader, sha256_file
from shardcache.store.layout import BUILD_STATE, MANIFEST, PARTS_DIR
from shardcache.store.remote import filesystem, is_url

try:  # parses bytes with UTF-8 validation in one pass, well ahead of json.loads
    from orjson import loads as _orjson_loads
except ImportError:  # optional (shardcache[fast]): json alone then
    _orjson_loads = None

FORMATS = ("jsonl", "jsonl.zst", "json", "json.gz", "parquet")
_SUFFIXES = {
    ".jsonl": "jsonl",
    ".json": "json",
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
    "invalid_unicode",  # valid JSON holding a lone surrogate ("\ud800"): not encodable text
    "too_deep",  # nested deeper than the JSON parser's recursion limit
    "encode_error",  # the tokenizer failed on this record alone (the detail says how)
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


def _position_name(fmt: str) -> str:
    return {"parquet": "row", ARRAY_LAYOUT: "item"}.get(fmt, "line")


def record_position(fmt: str, index: int) -> str:
    """How a person finds record ``index`` (0-based, as stored) of a file of format ``fmt``:
    "line 4" (1-based, what editors and ``sed -n 4p`` show), "row 4" for parquet, "item 4"
    for the elements of a JSON array file (``fmt`` :data:`ARRAY_LAYOUT`)."""
    return f"{_position_name(fmt)} {index + 1}"


def position_fields(fmt: str, index: int) -> dict[str, int]:
    """The 1-based position stored next to the 0-based ``record`` in quarantine entries."""
    return {_position_name(fmt): index + 1}


def has_lone_surrogate(value: Any) -> bool:
    """True when a text (or any string of a conversation) holds a lone surrogate: JSON
    allows ``"\ud800"`` but such a string is not Unicode text (it cannot be encoded)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, list):
        return any(has_lone_surrogate(v) for v in value)
    if isinstance(value, dict):
        return any(has_lone_surrogate(v) for v in value.values())
    return False


@dataclass(frozen=True)
class InputFile:
    """One input file: absolute path (or URL), path relative to the corpus root, size,
    format, and ``mtime_ns``: the modification time seen when it was listed (a URL's from the
    store; None: unknown). A partition checks the size and mtime again (check_unchanged)."""

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


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):  # fmt: skip
        if test(mode):
            return name
    return "not a regular file"


def check_regular_file(path: str) -> None:
    """Raise :class:`SourceError` unless ``path`` is (a link to) a regular file: reading a
    FIFO, a socket or a device such as /dev/zero would block or never end."""
    try:
        st = os.stat(path)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise SourceError(
                f"input {path!r}: too many levels of symbolic links (a symlink loop); fix or "
                "remove the link"
            ) from err
        if os.path.islink(path):
            raise SourceError(
                f"input {path!r}: a symbolic link to {os.readlink(path)!r}, which does not "
                "exist; fix or remove the link"
            ) from err
        raise SourceError(
            f"input {path!r}: cannot read it ({err.strerror}); check the path"
        ) from err
    if not stat.S_ISREG(st.st_mode):
        raise SourceError(
            f"input {path!r} is {_file_kind(st.st_mode)}, not a regular file: reading it could "
            "block forever or never end; remove it from the inputs (or move it out of the folder)"
        )


def is_cache_folder(path: str) -> bool:
    """True for a folder holding a shardcache manifest or build state: a cache (or a build
    in progress) inside a corpus folder is output, never input (its quarantine.jsonl and
    parts/*.jsonl would otherwise feed the next build)."""
    return os.path.isfile(os.path.join(path, MANIFEST)) or os.path.isfile(
        os.path.join(path, PARTS_DIR, BUILD_STATE)
    )


def _excluded(path: str, exclude: frozenset[str]) -> bool:
    real = os.path.realpath(path)
    return any(real == e or real.startswith(e + os.sep) for e in exclude)


def _expand(spec: str, exclude: frozenset[str] = frozenset()) -> list[str]:
    if any(ch in spec for ch in "*?["):
        matches = glob.glob(spec, recursive=True)
        if not matches:
            raise SourceError(f"input {spec!r}: the pattern matches no file; check the path")
        found = []
        for m in matches:
            parents = (os.path.dirname(m), os.path.dirname(os.path.dirname(m)))
            if os.path.isdir(m) or _excluded(m, exclude) or any(map(is_cache_folder, parents)):
                continue
            check_regular_file(m)
            found.append(m)
        return found
    if os.path.isdir(spec):
        found = []
        for root, dirs, files in os.walk(spec):
            dirs[:] = [
                d
                for d in dirs
                if not d.startswith(".")
                and not _excluded(os.path.join(root, d), exclude)
                and not is_cache_folder(os.path.join(root, d))
            ]
            for name in files:
                if detect_format(name):
                    check_regular_file(os.path.join(root, name))
                    found.append(os.path.join(root, name))
        if not found:
            raise SourceError(
                f"input {spec!r}: the folder holds no input file ({', '.join(FORMATS)})"
            )
        return found
    if os.path.lexists(spec):
        check_regular_file(spec)
        return [spec]
    raise SourceError(f"input {spec!r}: no such file or folder")


def list_inputs(
    specs: tuple[str, ...] | list[str], *, exclude: tuple[str, ...] | list[str] = ()
) -> list[InputFile]:
    """Resolve files / folders / globs (or URLs: :func:`list_url_inputs`) into input files,
    sorted by relative path.

    A file given explicitly must have a known format; files inside folders without one are
    ignored. The format and the relative path come from the name as listed, so a symbolic
    link (a Hugging Face hub snapshot: ``snap/train.jsonl -> ../blobs/<hash>``) is read as
    the link names it. The same file reached twice (by a folder and a glob, or by two links)
    is listed once. Folders in ``exclude`` (the build's output) and folders holding a cache
    or a build state are skipped; anything that is not a regular file is refused.
    """
    if any(is_url(spec) for spec in specs):
        return list_url_inputs(specs)
    excluded = frozenset(os.path.realpath(os.fspath(e)) for e in exclude)
    by_target: dict[str, str] = {}
    for spec in specs:
        for p in _expand(os.fspath(spec), excluded):
            if detect_format(p) is None:
                raise SourceError(
                    f"input {p!r}: unknown format; expected a name ending in "
                    f"{', '.join(sorted(_SUFFIXES))}"
                )
            path = os.path.abspath(p)
            target = os.path.realpath(p)
            by_target[target] = min(by_target.get(target, path), path)
    if not by_target:
        raise SourceError(f"inputs {list(specs)}: no input file found")
    paths = sorted(by_target.values())
    root = os.path.commonpath([os.path.dirname(p) for p in paths])
    files = []
    for p in paths:
        st = os.stat(p)
        relpath = os.path.relpath(p, root).replace(os.sep, "/")
        fmt = detect_format(p) or ""
        files.append(InputFile(p, relpath, st.st_size, fmt, st.st_mtime_ns))
    files.sort(key=lambda f: f.relpath)
    return files


def _mtime_ns(fs: Any, path: str, info: dict[str, Any]) -> int:
    with contextlib.suppress(Exception):
        return int(fs.modified(path).timestamp() * 1e9)
    for key in ("mtime", "LastModified", "last_modified"):
        if key in info:
            value = info[key]
            return int((value.timestamp() if hasattr(value, "timestamp") else float(value)) * 1e9)
    return 0


def list_url_inputs(specs: Iterable[str]) -> list[InputFile]:
    """List URL inputs (files, folders/prefixes or globs) without reading them.

    Returns input files whose ``path`` is the object's URL, ``relpath`` relative to the URLs'
    common prefix (as a local listing would make it), ``size`` the object's and ``mtime_ns``
    its modification time (the resume fingerprint).
    """
    specs = list(specs)
    found: dict[str, tuple[Any, str, dict[str, Any]]] = {}
    for spec in specs:
        if not is_url(spec):
            raise ConfigError(
                f"inputs: {spec!r} is a local path among URL inputs; give all inputs as URLs "
                "or all as local paths"
            )
        fs, path = filesystem(spec)
        try:
            if any(ch in path for ch in "*?["):
                listed = fs.glob(path, detail=True)
                if not listed:
                    raise SourceError(f"input {spec!r}: the pattern matches no object")
            elif fs.isdir(path):
                listed = {p: i for p, i in fs.find(path, detail=True).items()
                          if detect_format(p)}  # fmt: skip
                if not listed:
                    raise SourceError(f"input {spec!r}: the prefix holds no input file")
            else:
                listed = {path: fs.info(path)}
        except FileNotFoundError as err:
            raise SourceError(f"input {spec!r}: no such object or prefix ({err})") from err
        for p, info in listed.items():
            if info.get("type") == "directory":
                continue
            if detect_format(p) is None:
                raise SourceError(f"input {fs.unstrip_protocol(p)!r}: unknown format")
            found[fs.unstrip_protocol(p)] = (fs, p, info)
    if not found:
        raise SourceError(f"inputs {specs}: no input file found")
    root = os.path.commonpath([u.split("://", 1)[1].rsplit("/", 1)[0] for u in found])
    files = []
    for url, (fs, p, info) in sorted(found.items()):
        files.append(
            InputFile(
                path=url,
                relpath=os.path.relpath(url.split("://", 1)[1], root).replace(os.sep, "/"),
                size=int(info.get("size") or 0),
                format=detect_format(p) or "",
                mtime_ns=_mtime_ns(fs, p, info),
            )
        )
    files.sort(key=lambda f: f.relpath)
    return files


@dataclass(frozen=True)
class InputSlice:
    """The part of one input file that one partition reads.

    ``start``/``end`` are byte offsets (jsonl; ``end`` None = to the end of the file),
    ``first_record`` the file-global index of its first line or row, ``row_groups`` the
    parquet row groups (None = all), ``sha256`` the digest of the byte range when the plan
    cut it (a partition checks that it read those bytes; "" = not known).
    """

    start: int = 0
    end: int | None = None
    first_record: int = 0
    row_groups: tuple[int, ...] | None = None
    sha256: str = ""

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.end is None and self.row_groups is None

    def to_json(self) -> dict[str, Any]:
        return {
            "start": self.start,
            "end": self.end,
            "first_record": self.first_record,
            "row_groups": list(self.row_groups) if self.row_groups is not None else None,
            "sha256": self.sha256,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> InputSlice:
        groups = data.get("row_groups")
        return cls(
            int(data["start"]),
            None if data["end"] is None else int(data["end"]),
            int(data["first_record"]),
            None if groups is None else tuple(int(g) for g in groups),
            str(data.get("sha256") or ""),
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
    """One pass: hash (the file, and each slice's byte range), count newlines, and cut after
    the first newline past each target."""
    slices: list[InputSlice] = []
    piece = hashlib.sha256()  # of the current slice's bytes
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
            view, hashed = memoryview(chunk), 0  # chunk[:hashed] is in a slice's digest
            while target < pos + len(chunk):
                nl = chunk.find(b"\n", max(0, target - pos))
                if nl < 0:
                    break
                end = pos + nl + 1
                lines = lines_before_chunk + chunk.count(b"\n", 0, nl + 1)
                if end < file.size:
                    piece.update(view[hashed : nl + 1])
                    hashed = nl + 1
                    slices.append(InputSlice(start, end, first_line, sha256=piece.hexdigest()))
                    start, first_line, piece = end, lines, hashlib.sha256()
                target = end + size
            piece.update(view[hashed:])
            lines_before_chunk += chunk.count(b"\n")
            pos += len(chunk)
    if reader.bytes_read != file.size:  # the cuts and the hash would describe other bytes
        raise input_changed(file, "while the plan read it", f"listed with {file.size} bytes, "
                            f"{reader.bytes_read} read")  # fmt: skip
    slices.append(InputSlice(start, None, first_line, sha256=piece.hexdigest()))
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


BOM = b"\xef\xbb\xbf"
#: The "format" of positions in a JSON array file: its records are items, not lines.
ARRAY_LAYOUT = "json-array"
_HEAD_BYTES = 64 * 1024
_WHITESPACE = b" \t\r\n"
_SPECIAL = re.compile(rb'["\\\[\]{},]')  # structure outside strings
#: The rest of a JSON string after its opening quote, through the closing one (unrolled loop).
_STRING_REST = re.compile(rb'[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)


def record_layout(head: bytes) -> str:
    """How the records of a line-based file are laid out, from its first bytes: ``"array"``
    (one top-level JSON array of objects, a common export form), ``"cr"`` (lines ended by
    CR alone: classic Mac), or ``"lines"`` (JSON lines)."""
    body = head.removeprefix(BOM).lstrip(_WHITESPACE)
    if body.startswith(b"[") and body[1:].lstrip(_WHITESPACE)[:1] in (b"{", b"]"):
        return "array"
    if b"\n" not in head and b"\r" in head:
        return "cr"
    return "lines"


def array_items(stream: Any) -> Iterator[bytes]:
    """The elements of the top-level JSON array(s) in ``stream``, as bytes, streamed: memory
    holds one element plus one read chunk. A string is skipped with one regex match to its
    closing quote, so brackets and commas inside texts are never structure. Anything after
    the array that is not another array is yielded as one (bad) element."""
    buf, pos, depth, elem_from = b"", 0, 0, 0
    while True:
        m = _SPECIAL.search(buf, pos)
        string_end = None
        if m is not None and m.group() == b'"':
            string_end = _STRING_REST.match(buf, m.end())
        if m is None or (m.group() == b'"' and string_end is None):  # need more bytes
            chunk = stream.read(READ_CHUNK)
            if not chunk:
                break
            resume = m.start() if m is not None else len(buf)
            keep = elem_from if depth >= 1 else resume
            buf, pos, elem_from = buf[keep:] + chunk, resume - keep, 0
            continue
        p, c = m.start(), m.group()
        pos = p + 1
        if string_end is not None:
            pos = string_end.end()
        elif depth == 0:
            if c != b"[" or buf[:p].replace(BOM, b"").strip(_WHITESPACE):
                yield buf[p:] + stream.read(_HEAD_BYTES)  # trailing garbage: one bad element
                return
            depth, elem_from = 1, p + 1
        elif c in (b"[", b"{"):
            depth += 1
        elif c in (b"]", b"}"):
            depth -= 1
            if depth == 0:  # the end of the top-level array
                item = buf[elem_from:p].strip(_WHITESPACE)
                if item:
                    yield item
                buf, pos, elem_from = buf[p + 1 :], 0, 0
        elif c == b"," and depth == 1:
            yield buf[elem_from:p].strip(_WHITESPACE)
            elem_from = p + 1
    rest = buf[elem_from:].strip(_WHITESPACE) if depth >= 1 else b""
    if rest:
        yield rest  # an unterminated array: the partial element is reported as bad


class _CrToLf(io.RawIOBase):
    """Reads a stream whose lines end with CR alone as if they ended with LF."""

    def __init__(self, stream: Any):
        self._stream = stream

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self._stream.read(len(buffer))
        n = len(data)
        buffer[:n] = data.replace(b"\r", b"\n")
        return n


def _raw_records(stream: Any, at_start: bool) -> tuple[str, Iterator[bytes]]:
    """``(layout, raw records)`` of a line-based stream: its lines, the lines of a CR-only
    file, or the elements of a JSON array file (the layout is told from the first bytes,
    ``at_start``; see :func:`record_layout`)."""
    layout = record_layout(stream.peek(_HEAD_BYTES)[:_HEAD_BYTES]) if at_start else "lines"
    if layout == "cr":
        return layout, iter(io.BufferedReader(_CrToLf(stream), buffer_size=READ_CHUNK))
    return layout, array_items(stream) if layout == "array" else iter(stream)


class _TimedReader(io.RawIOBase):
    """A raw reader that adds the CPU time of each read (file, hash, decompression) to the
    ``read`` stage (one clock read per chunk, never per record)."""

    def __init__(self, raw: Any, times: StageTimes):
        self._raw = raw
        self._times = times

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        with self._times.cpu("read"):
            return self._raw.readinto(buffer)


def _open_lines(raw: HashingReader, fmt: str, times: StageTimes | None = None) -> io.BufferedIOBase:
    timed: Any = raw if times is None else _TimedReader(raw, times)
    if fmt in ("jsonl", "json"):
        return io.BufferedReader(timed, buffer_size=READ_CHUNK)
    if fmt == "jsonl.zst":
        zstd: Any = ZstdReader(raw) if times is None else _TimedReader(ZstdReader(raw), times)
        return io.BufferedReader(zstd, buffer_size=READ_CHUNK)
    if fmt == "json.gz":  # gzip reads (and so its offsets) as before: decompression is "parse"
        return gzip.GzipFile(fileobj=timed, mode="rb")  # type: ignore[return-value]
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
        self.format = ""
        self.on_layout: Callable[[str], None] | None = None
        self.texts: list[str] = []
        self.records: list[int] = []
        self.chars = 0

    def bad(self, index: int, reason: str, raw: bytes | str) -> None:
        excerpt = _excerpt(raw)
        if self.on_error == "fail":
            raise BadRecordError(
                f"{self.relpath}: {record_position(self.format, index)} is invalid ({reason}): "
                f"{excerpt!r}; fix the "
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


#: Brackets a line may hold for orjson to parse it: ``json`` refuses nesting near the
#: interpreter's recursion limit (``too_deep``, depending on the stack), orjson only past its
#: own, higher one, so a line that could nest that deep takes the reference path.
FAST_MAX_BRACKETS = 256


def _fast_text(line: bytes, text_field: str, kind: str) -> Any | None:
    """The record's text (or conversation) through orjson when it parses the line (UTF-8
    checked in the same pass) and the record is valid, else None: the line then takes the
    reference path (``json``), which classifies it. orjson accepts no line that ``json``
    rejects (no NaN, no lone surrogate, no invalid UTF-8, no integer past
    ``int_max_str_digits``; nesting is bounded by :data:`FAST_MAX_BRACKETS`) and parses what
    both accept to equal strings, so texts and bad-record reasons are those of ``json``
    alone (a test compares the two on every kind of line)."""
    if _orjson_loads is None:
        return None
    try:
        obj = _orjson_loads(line)
    except ValueError:  # orjson.JSONDecodeError
        return None
    if line.count(b"[") + line.count(b"{") > FAST_MAX_BRACKETS:
        return None
    text, reason = _validate(obj, text_field, kind)
    return text if reason is None else None


def _iter_lines(
    file: InputFile,
    raw: HashingReader,
    batcher: _Batcher,
    text_field: str,
    first_record: int,
    times: StageTimes | None = None,
) -> Iterator[TextBatch]:
    stream: Any = _open_lines(raw, file.format, times)
    index = first_record - 1
    try:
        layout, records = _raw_records(stream, first_record == 0)
        if layout == "array":  # records are array elements: "item N" in messages
            batcher.format = ARRAY_LAYOUT
            if batcher.on_layout is not None:
                batcher.on_layout(ARRAY_LAYOUT)
        for index, line in enumerate(records, first_record):
            if index == 0 and line.startswith(BOM):
                line = line[len(BOM) :]
            if not line or line.isspace():  # what strip() empties, without a copy
                batcher.bad(index, "blank_line", line)
                continue
            text = _fast_text(line, text_field, batcher.kind)
            if text is not None:
                yield from batcher.add(index, text)
                continue
            try:
                decoded = line.decode("utf-8")
            except UnicodeDecodeError:
                batcher.bad(index, "invalid_utf8", line)
                continue
            try:
                obj = json.loads(decoded)
            except RecursionError:
                batcher.bad(index, "too_deep", decoded)
                continue
            except ValueError:  # JSONDecodeError, or an integer beyond int_max_str_digits
                batcher.bad(index, "not_json", decoded)
                continue
            text, reason = _validate(obj, text_field, batcher.kind)
            if reason is None and "\\u" in decoded and has_lone_surrogate(text):
                reason = "invalid_unicode"  # only an escape can make one: checked only then
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
    groups = list(part.row_groups) if part.row_groups is not None else None
    if text_field not in names:  # every row lacks the field: bad records, as in jsonl
        reason = "no_messages_field" if batcher.kind == "chat" else "no_text_field"
        meta = pf.metadata
        n_rows = sum(meta.row_group(g).num_rows for g in (groups or range(meta.num_row_groups)))
        for row in range(part.first_record, part.first_record + n_rows):
            batcher.bad(row, reason, f"columns: {', '.join(names)}")
        return
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


def sample_fields(file: InputFile, records: int = 100) -> dict[str, str]:
    """The fields of the first ``records`` records of ``file`` (name -> type of its first
    value), for messages that suggest the right field; {} when the file cannot be read."""
    fields: dict[str, str] = {}
    try:
        if file.format == "parquet":
            import pyarrow.parquet as pq

            schema = pq.read_schema(file.path)
            return {name: str(schema.field(name).type) for name in schema.names}
        with HashingReader(open(file.path, "rb")) as raw:
            _, stream = _raw_records(_open_lines(raw, file.format), at_start=True)
            for _, line in zip(range(records), stream):
                if len(line) > _HEAD_BYTES * 16:
                    continue  # a huge record: not worth parsing for a hint
                try:
                    obj = json.loads(line)
                except (ValueError, RecursionError):
                    continue
                if isinstance(obj, dict):
                    for key, value in obj.items():
                        fields.setdefault(str(key), type(value).__name__)
    except Exception:  # a hint only: the build already reported what is wrong with the file
        return fields
    return fields


def field_hint(files: list[InputFile], field: str, kind: str = "text") -> str:
    """Why records lack ``field`` and what to pass instead, from the first records' fields:
    "no record has field 'body'; fields seen in the first records: text, id; did you mean
    --text-field text?" ("" when nothing can be said)."""
    fields: dict[str, str] = {}
    for file in files[:3]:
        for name, type_name in sample_fields(file).items():
            fields.setdefault(name, type_name)
    if not fields or field in fields:
        return ""
    seen = ", ".join(list(fields)[:12])
    hint = f"no record has field {field!r}; fields seen in the first records: {seen}"
    lists = [n for n, t in fields.items() if t == "list" or t.startswith(("list", "large_list"))]
    strings = [n for n, t in fields.items() if t in ("str", "string", "large_string")]
    if kind == "chat":
        guess = difflib.get_close_matches(field, lists, n=1) or lists[:1]
        flag = "--messages-field"
    else:
        chat = [n for n in lists if n in ("messages", "conversations", "conversation", "chat")]
        if chat and not strings:
            return f"{hint}; this is chat data: build it with --chat --messages-field {chat[0]}"
        guess = difflib.get_close_matches(field, strings, n=1) or strings[:1]
        flag = "--text-field"
    return f"{hint}; did you mean {flag} {guess[0]}?" if guess else hint


@dataclass
class FileDigest:
    """Filled in once a file (or a line-based slice) has been read to the end: the sha256 of
    a whole file, and the raw bytes read (0 for parquet, read by row groups)."""

    sha256: str = ""
    bytes_read: int = 0
    read_sha256: str = ""  # of the bytes read (the slice's range, or the whole file)


def check_unchanged(file: InputFile, when: str) -> None:
    """Raise :class:`SourceError` naming ``file`` if its size or modification time is not
    the one it had when it was listed and planned (the plan hashed and cut those bytes)."""
    try:
        if is_url(file.path):  # one HEAD request; the store's mtime is not compared
            fs, path = filesystem(file.path)
            with contextlib.suppress(Exception):
                fs.invalidate_cache(path)
            size, mtime_ns = int(fs.info(path).get("size") or 0), None
        else:
            st = os.stat(file.path)
            size, mtime_ns = st.st_size, st.st_mtime_ns
    except OSError as err:
        raise SourceError(f"{file.relpath}: the input disappeared {when} ({err})") from err
    moved = file.mtime_ns is not None and mtime_ns is not None and mtime_ns != file.mtime_ns
    if size != file.size or moved:
        raise input_changed(
            file, when, f"size {file.size} -> {size} bytes, mtime_ns {file.mtime_ns} -> "
            f"{mtime_ns}"
        )  # fmt: skip


def input_changed(file: InputFile, when: str, detail: str) -> SourceError:
    return SourceError(
        f"{file.relpath}: the input changed {when} ({detail}); the bytes read are not the "
        "ones the build planned and hashed, so nothing was committed for them. Stop whatever "
        "writes the file, then rebuild with --force (the interrupted build's plan no longer "
        "matches the input)"
    )


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
    on_layout: Callable[[str], None] | None = None,
    times: StageTimes | None = None,
) -> Iterator[TextBatch]:
    """Stream a file's (or one slice's) valid records as :class:`TextBatch` es.

    ``on_bytes(n)`` is called as raw bytes are consumed (progress); when a whole file has been
    read to the end, ``digest.sha256`` holds the sha256 of the file's bytes (a slice leaves it
    empty: :func:`split_input` hashed the file). ``on_layout(ARRAY_LAYOUT)`` is called before
    the first record of a JSON array file (its records are items, not lines). ``times``:
    the CPU of reading, hashing and decompressing a line-based file goes to its ``read``
    stage.
    """
    part = part or InputSlice()
    batcher = _Batcher(file.relpath, batch_docs, on_error, on_bad, on_corrupt)
    batcher.kind = kind  # "text": a string field; "chat": a list of {role, content} messages
    batcher.format = file.format
    batcher.on_layout = on_layout
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
        yield from _iter_lines(file, raw, batcher, text_field, part.first_record, times)
        if digest is not None:
            digest.bytes_read = raw.bytes_read
            digest.read_sha256 = raw.sha256.hexdigest()
            if part.whole:
                digest.sha256 = raw.sha256.hexdigest()
    finally:
        raw.close()
