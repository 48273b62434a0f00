"""Build inputs: list them, split them into slices, stream their records in batches.

Invariants: listing is deterministic (sorted by path relative to the inputs' common parent;
cache folders and the build's output are skipped; non-regular files are refused); a record
index is the file-global 0-based line (jsonl family) or row (parquet); no bad record is
dropped silently (``on_bad`` gets a reason from ``BAD_REASONS``, or ``BadRecordError`` with
``on_error="fail"``); a damaged file raises ``SourceError`` unless skipped through
``on_corrupt``; raw bytes are hashed while read, so the cache key's data digest costs no
second pass.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import functools
import glob
import gzip
import hashlib
import io
import itertools
import json
import os
import re
import stat
import zlib
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import asdict, dataclass, field, replace
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
#: A batch is flushed at this many characters even below ``batch_docs`` (bounds memory).
MAX_BATCH_CHARS = 8 * 1024 * 1024
_SCAN_CHUNK = 8 << 20
#: Range-request size when reading a URL input (fsspec holds one such block).
URL_BLOCK_BYTES = 8 << 20

#: Called as ``on_bad(record_index, reason, excerpt)`` for every skipped record.
BadRecordCallback = Callable[[int, str, str], None]
#: Called as ``on_corrupt(first_unread_index, compressed_offset, message)``.
CorruptFileCallback = Callable[[int, int, str], None]


def _position_name(fmt: str) -> str:
    return {"parquet": "row", ARRAY_LAYOUT: "item"}.get(fmt, "line")


def record_position(fmt: str, index: int) -> str:
    """A record's human, 1-based position: ``"line 4"``, ``"row 4"`` or ``"item 4"``."""
    return f"{_position_name(fmt)} {index + 1}"


def position_fields(fmt: str, index: int) -> dict[str, int]:
    """The 1-based position stored next to the 0-based ``record`` in quarantine entries."""
    return {_position_name(fmt): index + 1}


def has_lone_surrogate(value: Any) -> bool:
    """Whether a string, or lists and dicts of them, hold a lone surrogate (not UTF-8)."""
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
    """One listed input; ``relpath`` is relative to the corpus root, ``path`` may be a URL.

    ``mtime_ns`` is the mtime seen at listing (None: unknown), checked again by
    ``check_unchanged``.
    """

    path: str
    relpath: str
    size: int
    format: str
    mtime_ns: int | None = None


def open_input(file: InputFile) -> BinaryIO:
    """Open an input for binary reading; the caller closes it. A URL is streamed, not staged."""
    if is_url(file.path):
        fs, path = filesystem(file.path)
        handle: BinaryIO = fs.open(path, "rb", block_size=URL_BLOCK_BYTES, cache_type="readahead")
        return handle
    return open(file.path, "rb")  # the caller closes it


def sha256_input(file: InputFile) -> str:
    """The hex sha256 of an input's bytes (streamed for a URL)."""
    if not is_url(file.path):
        return sha256_file(file.path)
    with HashingReader(open_input(file)) as reader:  # type: ignore[arg-type]
        reader.drain()
        return reader.sha256.hexdigest()


def detect_format(path: str) -> str | None:
    """The input format a file name implies; None for files that are not inputs."""
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


def _check_regular_file(path: str) -> None:
    """SourceError for anything but (a link to) a regular file, which could block or never end."""
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
    """Whether a folder is a build's output (a manifest or build state): never an input."""
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
            _check_regular_file(m)
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
                    _check_regular_file(os.path.join(root, name))
                    found.append(os.path.join(root, name))
        if not found:
            raise SourceError(
                f"input {spec!r}: the folder holds no input file ({', '.join(FORMATS)})"
            )
        return found
    if os.path.lexists(spec):
        _check_regular_file(spec)
        return [spec]
    raise SourceError(f"input {spec!r}: no such file or folder")


def list_inputs(
    specs: tuple[str, ...] | list[str], *, exclude: tuple[str, ...] | list[str] = ()
) -> list[InputFile]:
    """Resolve files, folders and globs (or URLs) into input files sorted by ``relpath``.

    A link is listed under its own name; a file reached twice is listed once; ``exclude``
    folders (the build's output) and cache folders are skipped. Inputs are all URLs or none
    (``ConfigError``); a URL's ``relpath`` is relative to the URLs' common prefix.
    """
    if any(is_url(spec) for spec in specs):
        return _list_url_inputs(list(specs))
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
    root = os.path.commonpath([os.path.dirname(p) for p in by_target.values()])
    files = []
    for p in by_target.values():
        st = os.stat(p)
        relpath = os.path.relpath(p, root).replace(os.sep, "/")
        files.append(InputFile(p, relpath, st.st_size, detect_format(p) or "", st.st_mtime_ns))
    return sorted(files, key=lambda f: f.relpath)


def _mtime_ns(fs: Any, path: str, info: dict[str, Any]) -> int:
    with contextlib.suppress(Exception):
        return int(fs.modified(path).timestamp() * 1e9)
    for key in ("mtime", "LastModified", "last_modified"):
        if key in info:
            value = info[key]
            return int((value.timestamp() if hasattr(value, "timestamp") else float(value)) * 1e9)
    return 0


def _list_url_inputs(specs: list[str]) -> list[InputFile]:
    """``list_inputs`` for URLs (objects, prefixes or globs), none of them read."""
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
    files = [
        InputFile(url, os.path.relpath(url.split("://", 1)[1], root).replace(os.sep, "/"),
                  int(info.get("size") or 0), detect_format(p) or "", _mtime_ns(fs, p, info))
        for url, (fs, p, info) in found.items()
    ]  # fmt: skip
    return sorted(files, key=lambda f: f.relpath)


@dataclass(frozen=True)
class InputSlice:
    """The part of one input a partition reads.

    A byte range ``[start, end)`` (jsonl; ``end`` None: to the end) or parquet ``row_groups``
    (None: all); ``first_record`` is its first record's index; ``sha256`` is the range's when
    the plan cut it (``""``: unknown).
    """

    start: int = 0
    end: int | None = None
    first_record: int = 0
    row_groups: tuple[int, ...] | None = None
    sha256: str = ""

    @property
    def whole(self) -> bool:
        """Whether the slice is the whole file."""
        return self.start == 0 and self.end is None and self.row_groups is None

    def to_json(self) -> dict[str, Any]:
        """The slice as JSON, its fields by name."""
        groups = list(self.row_groups) if self.row_groups is not None else None
        return {**asdict(self), "row_groups": groups}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> InputSlice:
        """The slice ``to_json`` recorded."""
        groups = data.get("row_groups")
        return cls(
            int(data["start"]),
            None if data["end"] is None else int(data["end"]),
            int(data["first_record"]),
            None if groups is None else tuple(int(g) for g in groups),
            str(data.get("sha256") or ""),
        )


def split_input(file: InputFile, partition_size_bytes: int) -> tuple[list[InputSlice], str]:
    """Cut ``file`` into slices of about ``partition_size_bytes`` at line or row-group bounds.

    Returns the slices and the file's sha256 when it was read to split it (else ``""``).
    Compressed formats and files within the size stay one slice.
    """
    if file.size <= partition_size_bytes or file.format not in ("jsonl", "parquet"):
        return [InputSlice()], ""
    if file.format == "parquet":
        return _split_parquet(file, partition_size_bytes), sha256_input(file)
    return _split_lines(file, partition_size_bytes)


def _split_lines(file: InputFile, size: int) -> tuple[list[InputSlice], str]:
    """One pass: hash the file and each slice, count lines, cut after each target."""
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


class _Reader(io.RawIOBase):
    """A readable raw stream over ``_raw`` (what io.BufferedReader and gzip wrap)."""

    def readable(self) -> bool:
        return True


class _RangeReader(_Reader):
    """Raw reads of ``[start, end)`` of a file (``end`` None = to its end)."""

    def __init__(self, raw: BinaryIO, start: int, end: int | None):
        self._raw = raw
        raw.seek(start)
        self._left = None if end is None else end - start

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
    """Valid texts of one file, or of several consecutive files (``join_batches``).

    ``records`` holds each text's record index in its file (int64). A joined batch lists its
    files in ``names`` and each text's file, as a position in ``names``, in ``files`` (None:
    all from ``source``).
    """

    texts: list[str]
    records: np.ndarray
    source: str = ""
    files: np.ndarray | None = None
    names: tuple[str, ...] = ()

    def take(self, keep: Any) -> TextBatch:
        """A new batch of the texts at positions ``keep``, in that order."""
        keep = np.asarray(keep, dtype=np.int64)
        files = None if self.files is None else self.files[keep]
        return replace(self, texts=[self.texts[i] for i in keep],
                       records=self.records[keep], files=files)  # fmt: skip

    def source_of(self, doc: int) -> str:
        """The relative path of the file text ``doc`` comes from."""
        return self.source if self.files is None else self.names[int(self.files[doc])]

    def runs(self, docs: np.ndarray) -> list[tuple[str, int, int]]:
        """``(file, start, end)`` runs: ``docs[start:end]`` come from ``file`` (file order)."""
        if self.files is None or not len(docs):
            return [(self.source, 0, len(docs))]
        files = self.files[docs]
        bounds = [0, *(np.flatnonzero(files[1:] != files[:-1]) + 1).tolist(), len(docs)]
        return [(self.names[int(files[a])], a, b) for a, b in itertools.pairwise(bounds)]


def join_batches(batches: Iterable[TextBatch], batch_docs: int) -> Iterator[TextBatch]:
    """Join consecutive one-file batches, so that many small files make a few large batches.

    A joined batch holds at most ``batch_docs`` texts and ``MAX_BATCH_CHARS`` characters.
    """
    pending: list[TextBatch] = []
    docs = chars = 0
    for batch in batches:
        size = sum(map(_text_chars, batch.texts))
        if pending and (docs + len(batch.texts) > batch_docs or chars + size > MAX_BATCH_CHARS):
            yield _joined(pending)
            pending, docs, chars = [], 0, 0
        pending.append(batch)
        docs += len(batch.texts)
        chars += size
    if pending:
        yield _joined(pending)


def _joined(batches: list[TextBatch]) -> TextBatch:
    if len(batches) == 1:
        return batches[0]
    names = tuple(dict.fromkeys(b.source for b in batches))  # the files, in order
    position = {name: k for k, name in enumerate(names)}
    files = np.concatenate([np.full(len(b.texts), position[b.source], np.int32) for b in batches])
    texts = [t for b in batches for t in b.texts]
    records = np.concatenate([b.records for b in batches])
    return TextBatch(texts, records, names[0], files, names)


def _text_chars(text: Any) -> int:
    """Characters of a text, or of a conversation's contents."""
    return len(text) if isinstance(text, str) else sum(len(m["content"]) for m in text)


def _excerpt(data: bytes | str, limit: int = 120) -> str:
    if isinstance(data, bytes):
        data = data.decode("utf-8", errors="replace")
    data = data.strip()
    return data if len(data) <= limit else data[:limit] + "…"


def _validate(obj: Any, text_field: str, kind: str = "text") -> tuple[Any, str | None]:
    """``(value, None)`` for a valid record, else ``(None, reason)``.

    With ``kind="chat"`` the field holds a conversation (a list of {role, content} messages).
    """
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


def _zstd_blocks(raw: io.RawIOBase, chunk_bytes: int = READ_CHUNK) -> Iterator[bytes]:
    """The decompressed bytes of concatenated zstd frames, a block per ``chunk_bytes`` read.

    Ending inside a frame raises ``ZstdError`` (zstandard's own stream_reader ends silently).
    """
    dctx = zstandard.ZstdDecompressor()
    obj = dctx.decompressobj()
    in_frame = False
    while chunk := raw.read(chunk_bytes):
        out = []
        while chunk:
            in_frame = True
            out.append(obj.decompress(chunk))
            if obj.eof:
                chunk = obj.unused_data
                obj = dctx.decompressobj()
                in_frame = False
            else:
                chunk = b""
        block = b"".join(out)
        if block:
            yield block
    if in_frame:
        raise zstandard.ZstdError("input ends inside a zstd frame (truncated file)")


class _BlockStream(_Reader):
    """A raw stream over an input's decoded ``blocks``, read timed as the ``read`` stage.

    ``next_block`` hands the next block over without a copy.
    """

    def __init__(self, blocks: Iterator[bytes], times: StageTimes | None = None):
        self._blocks = blocks
        self._times = times
        self._pending = b""  # the block being read; _pending[:_offset] is read
        self._offset = 0

    def _next(self) -> bytes:
        if self._times is None:
            return next(self._blocks, b"")
        with self._times.cpu("read"):
            return next(self._blocks, b"")

    def peek(self, size: int) -> bytes:
        """At least ``size`` unread bytes (fewer at the end), read ahead but not consumed."""
        while len(self._pending) - self._offset < size and (block := self._next()):
            self._pending = self._pending[self._offset :] + block
            self._offset = 0
        return self._pending[self._offset :]

    def next_block(self) -> bytes:
        """The next unread bytes, a block or what is left of one (b"" at the end)."""
        if self._offset < len(self._pending):
            block = self._pending[self._offset :] if self._offset else self._pending
            self._pending, self._offset = b"", 0
            return block
        return self._next()

    def readinto(self, buffer: Any) -> int:
        if self._offset >= len(self._pending):
            self._pending, self._offset = self._next(), 0
        n = min(len(buffer), len(self._pending) - self._offset)
        buffer[:n] = memoryview(self._pending)[self._offset : self._offset + n]
        self._offset += n
        return n


BOM = b"\xef\xbb\xbf"
#: The "format" of positions in a JSON array file: its records are items, not lines.
ARRAY_LAYOUT = "json-array"
_HEAD_BYTES = 64 * 1024
_WHITESPACE = b" \t\r\n"
_SPECIAL = re.compile(rb'["\\\[\]{},]')  # structure outside strings
#: The rest of a JSON string after its opening quote, through the closing one (unrolled loop).
_STRING_REST = re.compile(rb'[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)


def _record_layout(head: bytes) -> str:
    """Record layout told from a file's first bytes: ``"array"``, ``"cr"`` or ``"lines"``.

    ``"array"``: one top-level JSON array of objects; ``"cr"``: lines ended by CR alone.
    """
    body = head.removeprefix(BOM).lstrip(_WHITESPACE)
    if body.startswith(b"[") and body[1:].lstrip(_WHITESPACE)[:1] in (b"{", b"]"):
        return "array"
    if b"\n" not in head and b"\r" in head:
        return "cr"
    return "lines"


def array_items(stream: Any) -> Iterator[bytes]:
    """Stream the elements of a file's top-level JSON array(s), holding one element and a chunk.

    Trailing non-array bytes, or an unterminated array's last element, come as one (bad)
    element.
    """
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


class _CrToLf(_Reader):
    """Reads a stream whose lines end with CR alone as if they ended with LF."""

    def __init__(self, stream: Any):
        self._raw = stream

    def readinto(self, buffer: Any) -> int:
        data = self._raw.read(len(buffer))
        buffer[: len(data)] = data.replace(b"\r", b"\n")
        return len(data)


def _line_spans(stream: _BlockStream) -> Iterator[tuple[bytes, int, int]]:
    """``(data, start, end)``: the lines of ``stream`` in order, as LF-ended lines of a slice.

    The last one may lack its LF. A line longer than a block is joined once it ends, and comes
    alone.
    """
    rest: list[bytes] = []  # pieces of the line the last block ended inside
    while block := stream.next_block():
        first = block.find(b"\n")
        if first < 0:
            rest.append(block)
            continue
        last = block.rfind(b"\n")
        start = 0
        if rest:
            rest.append(block[:first])
            line = b"".join(rest)
            yield line, 0, len(line)
            rest, start = [], first + 1
        if start <= last:
            yield block, start, last + 1
        if last + 1 < len(block):
            rest = [block[last + 1 :]]
    if rest:
        line = b"".join(rest)
        yield line, 0, len(line)


def _raw_records(stream: Any, at_start: bool) -> tuple[str, Iterator[bytes]]:
    """``(layout, raw records)`` of a line-based stream (layout told only ``at_start``)."""
    layout = _stream_layout(stream, at_start)
    return layout, _records_of(stream, layout)


def _stream_layout(stream: Any, at_start: bool) -> str:
    """``_record_layout`` of a stream's first bytes (``"lines"`` unless ``at_start``)."""
    return _record_layout(stream.peek(_HEAD_BYTES)[:_HEAD_BYTES]) if at_start else "lines"


def _records_of(stream: Any, layout: str) -> Iterator[bytes]:
    """The raw records of a stream of that layout."""
    if layout == "cr":
        return iter(io.BufferedReader(_CrToLf(stream), buffer_size=READ_CHUNK))
    if layout == "array":
        return array_items(stream)
    if isinstance(stream, _BlockStream):
        return iter(io.BufferedReader(stream, buffer_size=READ_CHUNK))
    return iter(stream)


class _TimedReader(_Reader):
    """Adds the CPU time of each chunk read to the ``read`` stage."""

    def __init__(self, raw: Any, times: StageTimes):
        self._raw = raw
        self._times = times

    def readinto(self, buffer: Any) -> int:
        with self._times.cpu("read"):
            return self._raw.readinto(buffer)


def _open_lines(
    raw: HashingReader, fmt: str, times: StageTimes | None = None, chunk_bytes: int = READ_CHUNK
) -> Any:
    """Decoded bytes of a line input: ``_BlockStream`` (``chunk_bytes`` raw a block) or gzip."""
    if fmt == "json.gz":  # gzip reads the raw stream itself: its decompression counts as "parse"
        source = raw if times is None else _TimedReader(raw, times)
        return gzip.GzipFile(fileobj=source, mode="rb")
    if fmt == "jsonl.zst":
        return _BlockStream(_zstd_blocks(raw, chunk_bytes), times)
    return _BlockStream(iter(functools.partial(raw.read, chunk_bytes), b""), times)


@dataclass
class _Batcher:
    """Collects valid texts into batches; routes bad records to the callback or raises."""

    relpath: str
    batch_docs: int
    on_error: str
    on_bad: BadRecordCallback | None
    on_corrupt: CorruptFileCallback | None
    kind: str  # "text": a string field; "chat": a list of {role, content} messages
    format: str  # the file's, or ARRAY_LAYOUT once a JSON array is found
    on_layout: Callable[[str], None] | None
    texts: list[Any] = field(default_factory=list)
    records: list[int] = field(default_factory=list)
    chars: int = 0

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

    def parse(self, index: int, line: bytes, text_field: str) -> Any | None:
        """The text (or conversation) of record ``index``; None once it is reported as bad.

        ``line`` may hold its newline or not.
        """
        if index == 0 and line.startswith(BOM):
            line = line[len(BOM) :]
        if not line or line.isspace():  # what strip() empties, without a copy
            self.bad(index, "blank_line", line)
            return None
        text = _fast_text(line, text_field, self.kind)
        if text is not None:
            return text
        try:
            decoded = line.decode("utf-8")
        except UnicodeDecodeError:
            self.bad(index, "invalid_utf8", line)
            return None
        try:
            obj = json.loads(decoded)
        except RecursionError:
            self.bad(index, "too_deep", decoded)
            return None
        except ValueError:  # JSONDecodeError, or an integer beyond int_max_str_digits
            self.bad(index, "not_json", decoded)
            return None
        text, reason = _validate(obj, text_field, self.kind)
        if reason is None and "\\u" in decoded and has_lone_surrogate(text):
            reason = "invalid_unicode"  # only an escape can make one: checked only then
        if reason is not None:
            self.bad(index, reason, decoded)
            return None
        return text

    def add_span(
        self, index: int, data: bytes, start: int, end: int, text_field: str
    ) -> Generator[TextBatch, None, int]:
        """Add the records of the lines of ``data[start:end]``, the first being ``index + 1``.

        Yields each batch as it fills (a reader wanting a few documents stops mid-block) and
        returns the last record's index. A valid text record nested at most ``FAST_MAX_DEPTH``
        deep is taken inline from orjson; any other goes through ``parse``.
        """
        loads = _orjson_loads if self.kind == "text" else None
        texts, records, chars = self.texts, self.records, self.chars
        limit, docs = MAX_BATCH_CHARS, self.batch_docs
        flat = _CONTAINERS.isdisjoint
        view, find, pos = memoryview(data), data.find, start
        while pos < end:
            stop = find(b"\n", pos, end)
            if stop < 0:
                stop = end
            line = view[pos:stop]
            pos = stop + 1
            index += 1
            text = None
            if loads is not None:
                try:
                    obj = loads(line)
                except ValueError:  # orjson.JSONDecodeError: parse() classifies the line
                    obj = None
                if type(obj) is dict:
                    text = obj.get(text_field)
                    shallow = flat(map(type, obj.values())) or _shallow(obj)
                    if type(text) is not str or not text or not shallow:
                        text = None
            if text is None:
                text = self.parse(index, bytes(line), text_field)
                if text is None:
                    continue
                size = _text_chars(text)
            else:
                size = len(text)
            if texts and chars + size > limit:  # a huge text does not join (and inflate) a batch
                batch = self._flush_lists(texts, records)
                texts, records, chars = self.texts, self.records, 0
                yield batch
            texts.append(text)
            records.append(index)
            chars += size
            if len(texts) >= docs or chars >= limit:
                batch = self._flush_lists(texts, records)
                texts, records, chars = self.texts, self.records, 0
                yield batch
        self.chars = chars
        return index

    def _flush_lists(self, texts: list[Any], records: list[int]) -> TextBatch:
        self.texts, self.records, self.chars = [], [], 0
        return TextBatch(texts, np.asarray(records, dtype=np.int64), self.relpath)

    def add(self, index: int, text: Any) -> list[TextBatch]:
        """Add one text or conversation; returns the batches that became full."""
        full = []
        size = _text_chars(text)
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
        return self._flush_lists(self.texts, self.records)


#: Deepest nesting a record may have to be taken from orjson: deeper records take the
#: ``json`` path, whose recursion limit decides ``too_deep``.
FAST_MAX_DEPTH = 256
_CONTAINERS = frozenset((dict, list))


def _nesting(value: Any, limit: int) -> int:
    """Levels of nested lists and objects in ``value`` (1: flat), counted to ``limit + 1``."""
    depth, level = 0, [value]
    while level and depth <= limit:
        depth += 1
        inner = []
        for container in level:
            items = container.values() if type(container) is dict else container
            inner += [v for v in items if type(v) is dict or type(v) is list]
        level = inner
    return depth


def _shallow(obj: dict[str, Any]) -> bool:
    """Whether ``obj`` nests at most ``FAST_MAX_DEPTH`` levels (json parses it below its limit)."""
    if _CONTAINERS.isdisjoint(map(type, obj.values())):
        return True
    return _nesting(obj, FAST_MAX_DEPTH) <= FAST_MAX_DEPTH


def _fast_text(line: bytes, text_field: str, kind: str) -> Any | None:
    """The record's text through orjson for a valid record, else None (``json`` classifies it).

    orjson accepts a subset of what ``json`` accepts and parses it to equal strings, so results
    match the ``json`` path.
    """
    if _orjson_loads is None:
        return None
    try:
        obj = _orjson_loads(line)
    except ValueError:  # orjson.JSONDecodeError
        return None
    if isinstance(obj, dict) and not _shallow(obj):
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
    chunk_bytes: int = READ_CHUNK,
) -> Iterator[TextBatch]:
    stream: Any = _open_lines(raw, file.format, times, chunk_bytes)
    index = first_record - 1
    try:
        layout = _stream_layout(stream, first_record == 0)
        if layout == "array":  # records are array elements: "item N" in messages
            batcher.format = ARRAY_LAYOUT
            if batcher.on_layout is not None:
                batcher.on_layout(ARRAY_LAYOUT)
        if layout == "lines" and isinstance(stream, _BlockStream):  # whole blocks at a time
            for data, start, end in _line_spans(stream):
                index = yield from batcher.add_span(index, data, start, end, text_field)
        else:
            for index, line in enumerate(_records_of(stream, layout), first_record):
                text = batcher.parse(index, line, text_field)
                if text is not None:
                    yield from batcher.add(index, text)
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
    import pyarrow as pa
    import pyarrow.parquet as pq

    row = part.first_record
    with contextlib.ExitStack() as stack:
        try:  # an unopenable file is reported as an unreadable footer is, not raised
            pf = pq.ParquetFile(stack.enter_context(open_input(file)))
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


def _sample_fields(file: InputFile, records: int = 100) -> dict[str, str]:
    """Field name -> type name over the first ``records`` records ({} if unreadable)."""
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
        pass
    return fields


def field_hint(files: list[InputFile], field: str, kind: str = "text") -> str:
    """A hint for records that lack ``field``: the fields seen and the flag to pass.

    Samples the first records of the first three files; ``""`` when the field was seen.
    """
    fields: dict[str, str] = {}
    for file in files[:3]:
        for name, type_name in _sample_fields(file).items():
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
    """What reading a file or a slice to the end measured.

    ``sha256`` is a whole file's; ``read_sha256`` that of the bytes read (the slice's range or
    the whole file); ``bytes_read`` is 0 for parquet.
    """

    sha256: str = ""
    bytes_read: int = 0
    read_sha256: str = ""


def check_unchanged(file: InputFile, when: str) -> None:
    """Raise ``SourceError`` if an input is gone or lost its listed size and mtime.

    ``when`` names the step in the message.
    """
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
    """The ``SourceError`` for an input that changed since it was listed, saying what to do."""
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
    chunk_bytes: int = READ_CHUNK,
) -> Iterator[TextBatch]:
    """Stream the valid records of a file (or of one slice of it) as ``TextBatch`` objects.

    ``text_field`` holds the messages when ``kind="chat"``. A batch holds at most
    ``batch_docs`` records and ``MAX_BATCH_CHARS`` characters. Bad records go to ``on_bad``
    (``BadRecordError`` with ``on_error="fail"``); a damaged file's loss to ``on_corrupt`` when
    skipping, else ``SourceError``. ``digest`` is filled once the read ends; ``on_layout``
    hears ``ARRAY_LAYOUT`` before a JSON array file's first record. A damaged zstd file loses
    the lines of the ``chunk_bytes`` chunk the damage is in, so the build keeps the default.
    """
    part = part or InputSlice()
    batcher = _Batcher(file.relpath, batch_docs, on_error, on_bad, on_corrupt, kind, file.format,
                       on_layout)  # fmt: skip
    if file.format == "parquet":
        yield from _iter_parquet(file, batcher, text_field, part)
        if part.whole and digest is not None:
            digest.sha256 = sha256_input(file)
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
        yield from _iter_lines(
            file, raw, batcher, text_field, part.first_record, times, chunk_bytes
        )
        if digest is not None:
            digest.bytes_read = raw.bytes_read
            digest.read_sha256 = raw.sha256.hexdigest()
            if part.whole:
                digest.sha256 = raw.sha256.hexdigest()
    finally:
        raw.close()
