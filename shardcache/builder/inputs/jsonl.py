"""JSON records: JSON lines (``.jsonl``, zstd or gzip compressed) and JSON arrays of objects.

A record is a line, or an item of a file's top-level array (told from the first bytes). An
uncompressed ``.jsonl`` file splits at line bounds, each slice hashed as it is cut; every
read hashes the raw bytes it reads. A valid text record is taken from orjson when installed,
anything else goes through ``json``, which classifies the bad ones.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import io
import json
import re
import zlib
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import zstandard

from shardcache.builder.inputs.base import (
    Batcher,
    InputFile,
    InputSlice,
    ReadHooks,
    TextBatch,
    has_lone_surrogate,
    input_changed,
    open_input,
    text_chars,
    validate_record,
)
from shardcache.builder.stage_times import StageTimes
from shardcache.errors import SourceError
from shardcache.store.files import READ_CHUNK, HashingReader

try:  # parses bytes with UTF-8 validation in one pass, well ahead of json.loads
    from orjson import loads as _orjson_loads
except ImportError:  # optional (shardcache[fast]): json alone then
    _orjson_loads = None

_SCAN_CHUNK = 8 << 20


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


class JsonBatcher(Batcher):
    """A ``Batcher`` that parses JSON records (lines or array items) itself."""

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
        text, reason = validate_record(obj, text_field, self.kind)
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
        limit, docs = self.max_chars, self.batch_docs
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
                size = text_chars(text)
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
    text, reason = validate_record(obj, text_field, kind)
    return text if reason is None else None


def _iter_lines(
    file: InputFile,
    raw: HashingReader,
    batcher: JsonBatcher,
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
            batcher.position = "item"
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


def _sample_json(file: InputFile, records: int) -> dict[str, str]:
    """Field name -> type name over the first ``records`` JSON records."""
    fields: dict[str, str] = {}
    with HashingReader(open_input(file)) as raw:  # type: ignore[arg-type]
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
    return fields


@dataclass(frozen=True)
class JsonFormat:
    """JSON lines or an array of objects, raw or compressed (``name`` says which codec)."""

    name: str
    suffixes: tuple[str, ...]
    splittable: bool = False  # uncompressed lines: cut at line bounds
    position: str = "line"
    in_folders: bool = True
    hashes_while_reading: bool = True

    def split(self, file: InputFile, partition_size_bytes: int) -> tuple[list[InputSlice], str]:
        """See ``InputFormat.split``."""
        if not self.splittable:
            return [InputSlice()], ""
        return _split_lines(file, partition_size_bytes)

    def read(
        self, file: InputFile, part: InputSlice, batcher: Batcher, text_field: str,
        hooks: ReadHooks,
    ) -> Iterator[TextBatch]:  # fmt: skip
        """See ``InputFormat.read``."""
        json_batcher = JsonBatcher(**{f: getattr(batcher, f) for f in _BATCHER_FIELDS})
        try:
            handle = open_input(file)  # closed by the HashingReader below
        except OSError as err:
            raise SourceError(f"{file.relpath}: cannot open: {err}") from err
        source: Any = handle if part.whole else _RangeReader(handle, part.start, part.end)
        raw = HashingReader(source, hooks.on_bytes)
        try:
            yield from _iter_lines(file, raw, json_batcher, text_field, part.first_record,
                                   hooks.times, hooks.chunk_bytes)  # fmt: skip
            if hooks.digest is not None:
                hooks.digest.bytes_read = raw.bytes_read
                hooks.digest.read_sha256 = raw.sha256.hexdigest()
                if part.whole:
                    hooks.digest.sha256 = raw.sha256.hexdigest()
        finally:
            raw.close()

    def sample_fields(self, file: InputFile, records: int) -> dict[str, str]:
        """See ``InputFormat.sample_fields``."""
        return _sample_json(file, records)

    def folder_files(self, folder: str) -> list[str] | None:
        """See ``InputFormat.folder_files``."""
        return None


_BATCHER_FIELDS = ("relpath", "batch_docs", "on_error", "on_bad", "on_corrupt", "kind",
                   "position", "on_layout", "max_chars")  # fmt: skip

FORMATS = (
    JsonFormat("jsonl", (".jsonl",), splittable=True),
    JsonFormat("jsonl.zst", (".jsonl.zst",)),
    JsonFormat("json", (".json",)),
    JsonFormat("json.gz", (".json.gz", ".jsonl.gz")),
)
