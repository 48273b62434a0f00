"""What every input format shares: listed files, slices, text batches and the batcher.

A record index is file-global and 0-based (a line, a row, an array item or a file); a
``Batcher`` collects valid texts into bounded batches and routes every bad record to its
callback (or raises), so no format can drop a record silently. A format module (one per
format) reads records into a batcher; ``InputFormat`` is the protocol it implements.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any, BinaryIO, Protocol

import numpy as np

from shardcache.builder.chat import validate_messages
from shardcache.builder.preference import split_implicit_prompt
from shardcache.builder.stage_times import StageTimes
from shardcache.errors import BadRecordError, SourceError
from shardcache.store.files import READ_CHUNK, HashingReader, sha256_file
from shardcache.store.remote import filesystem, is_url

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
    "no_preference_field",  # preference: chosen or rejected missing
    "mixed_preference_types",  # preference: not all strings, not all message lists
    "empty_completion",  # preference: an empty chosen or rejected (nothing after the prompt)
    "no_shared_prompt",  # preference, implicit prompt: chosen and rejected share no prefix
    "divergence_not_assistant",  # implicit prompt: the first differing message is not assistant
    "last_not_assistant",  # implicit prompt: a side's last message is not an assistant turn
    "identical_sides",  # preference: chosen and rejected encode alike (keep_identical_pairs)
)
#: A batch is flushed at this many characters even below ``batch_docs`` (bounds memory).
MAX_BATCH_CHARS = 8 * 1024 * 1024
#: Range-request size when reading a URL input (fsspec holds one such block).
URL_BLOCK_BYTES = 8 << 20

#: Called as ``on_bad(record_index, reason, excerpt)`` for every skipped record.
BadRecordCallback = Callable[[int, str, str], None]
#: Called as ``on_corrupt(first_unread_index, compressed_offset, message)``.
CorruptFileCallback = Callable[[int, int, str], None]


def has_lone_surrogate(value: Any) -> bool:
    """Whether a string, or lists and dicts of them, hold a lone surrogate (not UTF-8)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, (list, tuple)):
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


def input_changed(file: InputFile, when: str, detail: str) -> SourceError:
    """The ``SourceError`` for an input that changed since it was listed, saying what to do."""
    return SourceError(
        f"{file.relpath}: the input changed {when} ({detail}); the bytes read are not the "
        "ones the build planned and hashed, so nothing was committed for them. Stop whatever "
        "writes the file, then rebuild with --force (the interrupted build's plan no longer "
        "matches the input)"
    )


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
        size = sum(map(text_chars, batch.texts))
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


def text_chars(text: Any) -> int:
    """Characters of a text, of a conversation's contents, or of a pair's three parts."""
    if isinstance(text, tuple):
        return sum(map(text_chars, text))
    return len(text) if isinstance(text, str) else sum(len(m["content"]) for m in text)


PAIR_FIELDS = ("prompt", "chosen", "rejected")


def validate_pair(obj: dict[str, Any]) -> tuple[Any, str | None]:
    """A preference record's ``(prompt, chosen, rejected)``, else ``(None, reason)``.

    All three are strings, or all three message lists (a prompt may be an empty list). Without
    a ``prompt`` (TRL's implicit-prompt shape), ``chosen`` and ``rejected`` are whole
    conversations (or texts) and the prompt is their shared prefix (``split_implicit_prompt``).
    """
    values = [obj.get(name) for name in PAIR_FIELDS]
    if values[1] is None or values[2] is None:
        return None, "no_preference_field"
    if values[0] is None:
        chosen, rejected = values[1:]
        if isinstance(chosen, list) and isinstance(rejected, list):
            reason = validate_messages(chosen) or validate_messages(rejected)
            if reason is not None:
                return None, reason
        elif not (isinstance(chosen, str) and isinstance(rejected, str)):
            return None, "mixed_preference_types"
        return split_implicit_prompt(chosen, rejected)
    if all(isinstance(v, str) for v in values):
        if not values[1] or not values[2]:
            return None, "empty_completion"
        return tuple(values), None
    if not all(isinstance(v, list) for v in values):
        return None, "mixed_preference_types"
    for value in values[1:] if not values[0] else values:
        reason = validate_messages(value)
        if reason is not None:
            return None, reason
    return tuple(values), None


def excerpt(data: bytes | str, limit: int = 120) -> str:
    """The start of a bad record, stripped, as shown in reports."""
    if isinstance(data, bytes):
        data = data.decode("utf-8", errors="replace")
    data = data.strip()
    return data if len(data) <= limit else data[:limit] + "…"


def validate_record(obj: Any, text_field: str, kind: str = "text") -> tuple[Any, str | None]:
    """``(value, None)`` for a valid record, else ``(None, reason)``.

    With ``kind="chat"`` the field holds a conversation (a list of {role, content} messages).
    """
    if not isinstance(obj, dict):
        return None, "not_an_object"
    if kind == "preference":
        return validate_pair(obj)
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


@dataclass
class FileDigest:
    """What reading a file or a slice to the end measured.

    ``sha256`` is a whole file's; ``read_sha256`` that of the bytes read (the slice's range or
    the whole file); ``bytes_read`` is 0 for parquet.
    """

    sha256: str = ""
    bytes_read: int = 0
    read_sha256: str = ""


@dataclass
class Batcher:
    """Collects valid texts into batches; routes bad records to the callback or raises.

    ``position`` names what a record index counts in messages (``"line"``, ``"row"``...).
    """

    relpath: str
    batch_docs: int
    on_error: str
    on_bad: BadRecordCallback | None
    on_corrupt: CorruptFileCallback | None
    kind: str  # "text": a string field; "chat": a list of {role, content} messages
    position: str
    on_layout: Callable[[str], None] | None = None
    texts: list[Any] = field(default_factory=list)
    records: list[int] = field(default_factory=list)
    chars: int = 0
    # read when the batcher is made (a test lowers the module's value)
    max_chars: int = field(default_factory=lambda: MAX_BATCH_CHARS)

    def bad(self, index: int, reason: str, raw: bytes | str) -> None:
        """Report record ``index`` as bad (or raise with ``on_error="fail"``)."""
        shown = excerpt(raw)
        if self.on_error == "fail":
            raise BadRecordError(
                f"{self.relpath}: {self.position} {index + 1} is invalid ({reason}): "
                f"{shown!r}; fix the "
                "input or build with --on-error skip to quarantine bad records"
            )
        if self.on_bad is not None:
            self.on_bad(index, reason, shown)

    def corrupt(self, index: int, offset: int, message: str, err: BaseException) -> None:
        """The file is damaged from record ``index`` on: report it once, or raise."""
        if self.on_error == "fail" or self.on_corrupt is None:
            raise SourceError(
                f"{message}; the file is truncated or corrupt: re-create or remove it, or "
                "build with --on-error skip to keep the records before the damage"
            ) from err
        self.on_corrupt(index, offset, message)

    def add_value(self, index: int, value: Any, text_field: str) -> list[TextBatch]:
        """Add a field's value read from a column (or a file): valid, or reported as bad."""
        return self.add_object(index, {text_field: value}, text_field, value)

    def add_object(
        self, index: int, obj: dict[str, Any], text_field: str, shown: Any = None
    ) -> list[TextBatch]:
        """Add a record read as an object (a row's columns): valid, or reported as bad."""
        text, reason = validate_record(obj, text_field, self.kind)
        if reason is not None:
            self.bad(index, reason, repr(obj if shown is None else shown))
            return []
        return self.add(index, text)

    def _flush_lists(self, texts: list[Any], records: list[int]) -> TextBatch:
        self.texts, self.records, self.chars = [], [], 0
        return TextBatch(texts, np.asarray(records, dtype=np.int64), self.relpath)

    def add(self, index: int, text: Any) -> list[TextBatch]:
        """Add one text or conversation; returns the batches that became full."""
        full = []
        size = text_chars(text)
        if self.texts and self.chars + size > self.max_chars:
            full.append(self.flush())  # a huge text does not join (and inflate) a batch
        self.texts.append(text)
        self.records.append(index)
        self.chars += size
        if len(self.texts) >= self.batch_docs or self.chars >= self.max_chars:
            full.append(self.flush())
        return [b for b in full if b is not None]

    def flush(self) -> TextBatch | None:
        """The texts collected so far as a batch (None: none)."""
        if not self.texts:
            return None
        return self._flush_lists(self.texts, self.records)


@dataclass
class ReadHooks:
    """What a read reports besides its batches: bytes read, the digest, stage times."""

    on_bytes: Callable[[int], None] | None = None
    digest: FileDigest | None = None
    times: StageTimes | None = None
    chunk_bytes: int = READ_CHUNK


class InputFormat(Protocol):
    """One input format: which files it reads, how they split, how their records are read.

    Attributes:
        name: the format's name, recorded in the plan and the manifest (``"jsonl"``).
        suffixes: lower-case file name endings it reads (``".jsonl.zst"``).
        position: what a record index counts, in messages (``"line"``, ``"row"``, ``"file"``).
        in_folders: whether a folder's files of this format are inputs (False: only when named
            or matched by a glob, so a README beside the corpus is not data).
        hashes_while_reading: whether ``read`` hashes the bytes it reads into the digest
            (a byte-range slice is then checked); otherwise the file is hashed after it.
    """

    name: str
    suffixes: tuple[str, ...]
    position: str
    in_folders: bool
    hashes_while_reading: bool

    def split(self, file: InputFile, partition_size_bytes: int) -> tuple[list[InputSlice], str]:
        """Cut a file of over ``partition_size_bytes`` into slices.

        Args:
            file: the input, larger than ``partition_size_bytes``.
            partition_size_bytes: the size a slice should have.

        Returns:
            The slices in order, and the file's sha256 when splitting read it (else ``""``).
        """
        ...

    def read(
        self, file: InputFile, part: InputSlice, batcher: Batcher, text_field: str,
        hooks: ReadHooks,
    ) -> Iterator[TextBatch]:  # fmt: skip
        """Stream the valid records of a slice into ``batcher`` and yield its batches.

        Args:
            file: the input.
            part: the slice of it to read.
            batcher: collects texts and reports bad records; the read flushes it at the end.
            text_field: the field holding the text (or the messages).
            hooks: where to report bytes read and the digest (filled once the read ends).

        Yields:
            Full batches in record order, then the last partial one.

        Raises:
            SourceError: the file cannot be read (a damaged one goes to ``batcher.corrupt``).
        """
        ...

    def sample_fields(self, file: InputFile, records: int) -> dict[str, str]:
        """Field name -> type name over the first ``records`` records ({} if unreadable).

        Args:
            file: the input.
            records: how many records to look at.

        Returns:
            The fields seen, in order.
        """
        ...

    def folder_files(self, folder: str) -> list[str] | None:
        """The input files of a folder this format owns as a whole (a saved dataset).

        Args:
            folder: a local folder met while listing inputs.

        Returns:
            Its data files, in order; None when the format does not own the folder (its
            files are then listed one by one).
        """
        ...


def whole_file(file: InputFile, partition_size_bytes: int) -> tuple[list[InputSlice], str]:
    """``InputFormat.split`` of a format that does not cut files: one slice, not hashed."""
    return [InputSlice()], ""


class WholeFiles:
    """Mixin of a format that never cuts a file into partitions."""

    def split(self, file: InputFile, partition_size_bytes: int) -> tuple[list[InputSlice], str]:
        """See ``InputFormat.split``: one slice, hashed while read."""
        return whole_file(file, partition_size_bytes)


def open_hashing(file: InputFile, hooks: ReadHooks) -> HashingReader:
    """Open an input that hashes (and counts) its bytes as they are read."""
    try:
        return HashingReader(open_input(file), hooks.on_bytes)  # type: ignore[arg-type]
    except OSError as err:
        raise SourceError(f"{file.relpath}: cannot open: {err}") from err


def flush_and_hash(
    batches: Iterator[TextBatch], batcher: Batcher, file: InputFile, part: InputSlice,
    hooks: ReadHooks,
) -> Iterator[TextBatch]:  # fmt: skip
    """A columnar format's batches, then the batcher's last one, then the file's digest."""
    yield from batches
    batch = batcher.flush()
    if batch is not None:
        yield batch
    hash_after_read(file, part, hooks)


def hash_after_read(file: InputFile, part: InputSlice, hooks: ReadHooks) -> None:
    """Fill the digest and the bytes read of a format that does not hash while reading."""
    if part.whole and hooks.digest is not None:
        hooks.digest.sha256 = sha256_input(file)
    if hooks.on_bytes is not None:
        hooks.on_bytes(file.size if part.whole else 0)


def record_columns(kind: str, text_field: str, names: list[str]) -> list[str]:
    """The columns a columnar file's records are read from (none: every row is bad).

    ``text_field`` for text and chat; for preference pairs those of ``prompt``, ``chosen`` and
    ``rejected`` it has, as long as it has ``chosen`` and ``rejected``.
    """
    if kind == "preference":
        found = [name for name in PAIR_FIELDS if name in names]
        return found if {"chosen", "rejected"} <= set(found) else []
    return [text_field] if text_field in names else []


def read_column(
    file: InputFile, batcher: Batcher, text_field: str, first_row: int,
    names: list[str], n_rows: int, batches: Iterator[Any], errors: tuple[type, ...],
    what: str,
) -> Iterator[TextBatch]:  # fmt: skip
    """The records of a columnar file: ``batches`` of its ``record_columns`` (Arrow).

    ``what`` names the format in messages.

    A file without those columns has ``n_rows`` bad records; an error raised by ``batches``
    (of the ``errors`` types) is the file's damage from the row reached on.
    """
    if not record_columns(batcher.kind, text_field, names):  # bad records, as in jsonl
        reason = {"chat": "no_messages_field", "preference": "no_preference_field"}.get(
            batcher.kind, "no_text_field"
        )
        for row in range(first_row, first_row + n_rows):
            batcher.bad(row, reason, f"columns: {', '.join(names)}")
        return
    pairs = batcher.kind == "preference"  # a pair is a row of several columns
    row = first_row
    while True:
        try:
            record_batch = next(batches, None)
        except errors as err:
            message = f"{file.relpath}: cannot read {what} data at row {row}: {err}"
            batcher.corrupt(row, 0, message, err)
            break
        if record_batch is None:
            break
        if pairs:
            for obj in record_batch.to_pylist():
                yield from batcher.add_object(row, obj, text_field)
                row += 1
            continue
        for value in record_batch.column(0).to_pylist():
            yield from batcher.add_value(row, value, text_field)
            row += 1
