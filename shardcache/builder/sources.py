"""Build inputs: list them, split them into slices, stream their records in batches.

Invariants: listing is deterministic (sorted by path relative to the inputs' common parent;
cache folders and the build's output are skipped; non-regular files are refused); a record
index is file-global and 0-based (a line, a row, an item); no bad record is dropped silently
(``on_bad`` gets a reason from ``BAD_REASONS``, or ``BadRecordError`` with
``on_error="fail"``); a damaged file raises ``SourceError`` unless skipped through
``on_corrupt``; the data digest costs no second pass where a format hashes while it reads.
How a format is read is its module's in ``shardcache.builder.inputs``; this module asks the
registry.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import fnmatch
import glob
import os
import stat
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from shardcache.builder.inputs import (
    FORMATS,
    GLOB_FORMAT,
    detect_format,
    folder_files,
    named_only,
    no_folder_input,
    position_fields,
    reader_of,
    record_position,
    suffixes,
)
from shardcache.builder.inputs.base import (
    BAD_REASONS,
    MAX_BATCH_CHARS,
    URL_BLOCK_BYTES,
    BadRecordCallback,
    Batcher,
    CorruptFileCallback,
    FileDigest,
    InputFile,
    InputSlice,
    ReadHooks,
    TextBatch,
    has_lone_surrogate,
    input_changed,
    join_batches,
    open_input,
    sha256_input,
)
from shardcache.builder.inputs.jsonl import ARRAY_LAYOUT
from shardcache.builder.stage_times import StageTimes
from shardcache.errors import ConfigError, SourceError
from shardcache.store.files import READ_CHUNK
from shardcache.store.layout import BUILD_STATE, MANIFEST, PARTS_DIR
from shardcache.store.remote import filesystem, is_url

__all__ = [
    "ARRAY_LAYOUT",
    "BAD_REASONS",
    "FORMATS",
    "MAX_BATCH_CHARS",
    "URL_BLOCK_BYTES",
    "BadRecordCallback",
    "CorruptFileCallback",
    "FileDigest",
    "InputFile",
    "InputSlice",
    "TextBatch",
    "check_corpus_files",
    "check_unchanged",
    "detect_format",
    "field_hint",
    "has_lone_surrogate",
    "input_changed",
    "is_cache_folder",
    "iter_text_batches",
    "join_batches",
    "list_inputs",
    "open_input",
    "position_fields",
    "record_position",
    "sha256_input",
    "split_input",
]


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


def _expand(spec: str, exclude: frozenset[str] = frozenset()) -> list[tuple[str, str | None]]:
    """``(path, format)`` of each file a spec names (None: no format claims the name)."""
    if any(ch in spec for ch in "*?["):
        matches = glob.glob(spec, recursive=True)
        if not matches:
            raise SourceError(f"input {spec!r}: the pattern matches no file; check the path")
        found: list[tuple[str, str | None]] = []
        for m in matches:
            parents = (os.path.dirname(m), os.path.dirname(os.path.dirname(m)))
            if os.path.isdir(m) or _excluded(m, exclude) or any(map(is_cache_folder, parents)):
                continue
            _check_regular_file(m)
            found.append((m, detect_format(m) or GLOB_FORMAT))  # the glob named it a document
        return found
    if os.path.isdir(spec):
        found = []
        skipped: list[str] = []  # plain text: read when named or globbed, not from a folder
        for root, dirs, files in os.walk(spec):
            owned = folder_files(root)
            if owned is not None:  # a saved dataset: its data files, not its metadata
                dirs[:] = []
                files = [os.path.relpath(f, root) for f in owned]
            dirs[:] = [
                d
                for d in dirs
                if not d.startswith(".")
                and not _excluded(os.path.join(root, d), exclude)
                and not is_cache_folder(os.path.join(root, d))
            ]
            for name in files:
                if fmt := detect_format(name, in_folder=True):
                    _check_regular_file(os.path.join(root, name))
                    found.append((os.path.join(root, name), fmt))
                elif named_only(name):
                    skipped.append(os.path.join(root, name))
        if not found:
            raise SourceError(no_folder_input(spec, skipped))
        return found
    if os.path.lexists(spec):
        _check_regular_file(spec)
        return [(spec, detect_format(spec))]
    raise SourceError(f"input {spec!r}: no such file or folder")


def _excluded_by(path: str, spec: str, patterns: tuple[str, ...]) -> bool:
    """Whether a glob of ``patterns`` matches a file's name or its path as listed.

    The path as listed is relative to the folder given as input, else as the input named it.
    """
    if not patterns:
        return False
    listed = os.path.relpath(path, spec) if os.path.isdir(spec) else path
    names = (os.path.basename(path), listed.replace(os.sep, "/"), path.replace(os.sep, "/"))
    return any(fnmatch.fnmatchcase(n, p) for p in patterns for n in names)


def list_inputs(
    specs: tuple[str, ...] | list[str],
    *,
    exclude: tuple[str, ...] | list[str] = (),
    exclude_globs: tuple[str, ...] = (),
) -> list[InputFile]:
    """Resolve files, folders and globs (or URLs) into input files sorted by ``relpath``.

    A link is listed under its own name; a file reached twice is listed once; ``exclude``
    folders (the build's output) and cache folders are skipped, and so are files a glob of
    ``exclude_globs`` matches (``--exclude``). Inputs are all URLs or none (``ConfigError``); a
    URL's ``relpath`` is relative to the URLs' common prefix.
    """
    if any(is_url(spec) for spec in specs):
        return _list_url_inputs(list(specs), exclude_globs)
    excluded = frozenset(os.path.realpath(os.fspath(e)) for e in exclude)
    by_target: dict[str, str] = {}
    formats: dict[str, str] = {}
    for spec in specs:
        for p, fmt in _expand(os.fspath(spec), excluded):
            if _excluded_by(p, os.fspath(spec), exclude_globs):
                continue
            if fmt is None:
                raise SourceError(
                    f"input {p!r}: unknown format; expected a name ending in "
                    f"{', '.join(suffixes())}"
                )
            path = os.path.abspath(p)
            target = os.path.realpath(p)
            by_target[target] = min(by_target.get(target, path), path)
            formats[path] = fmt
    if not by_target:
        raise SourceError(f"inputs {list(specs)}: no input file found{_left_out(exclude_globs)}")
    root = os.path.commonpath([os.path.dirname(p) for p in by_target.values()])
    files = []
    for p in by_target.values():
        st = os.stat(p)
        relpath = os.path.relpath(p, root).replace(os.sep, "/")
        files.append(InputFile(p, relpath, st.st_size, formats[p], st.st_mtime_ns))
    return sorted(files, key=lambda f: f.relpath)


def _left_out(patterns: tuple[str, ...]) -> str:
    if not patterns:
        return ""
    return f" (--exclude {' '.join(patterns)} left files out: check the patterns)"


def _mtime_ns(fs: Any, path: str, info: dict[str, Any]) -> int:
    with contextlib.suppress(Exception):
        return int(fs.modified(path).timestamp() * 1e9)
    for key in ("mtime", "LastModified", "last_modified"):
        if key in info:
            value = info[key]
            return int((value.timestamp() if hasattr(value, "timestamp") else float(value)) * 1e9)
    return 0


def _list_url_inputs(specs: list[str], exclude_globs: tuple[str, ...] = ()) -> list[InputFile]:
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
                every = fs.find(path, detail=True)
                listed = {p: i for p, i in every.items() if detect_format(p, in_folder=True)}
                if not listed:
                    skipped = [p for p in every if named_only(p)]
                    raise SourceError(no_folder_input(spec, skipped, "prefix"))
            else:
                listed = {path: fs.info(path)}
        except FileNotFoundError as err:
            raise SourceError(f"input {spec!r}: no such object or prefix ({err})") from err
        for p, info in listed.items():
            if info.get("type") == "directory":
                continue
            if _excluded_by(p, "", exclude_globs):
                continue
            if detect_format(p) is None:
                raise SourceError(f"input {fs.unstrip_protocol(p)!r}: unknown format")
            found[fs.unstrip_protocol(p)] = (fs, p, info)
    if not found:
        raise SourceError(f"inputs {specs}: no input file found{_left_out(exclude_globs)}")
    root = os.path.commonpath([u.split("://", 1)[1].rsplit("/", 1)[0] for u in found])
    files = [
        InputFile(url, os.path.relpath(url.split("://", 1)[1], root).replace(os.sep, "/"),
                  int(info.get("size") or 0), detect_format(p) or "", _mtime_ns(fs, p, info))
        for url, (fs, p, info) in found.items()
    ]  # fmt: skip
    return sorted(files, key=lambda f: f.relpath)


def split_input(file: InputFile, partition_size_bytes: int) -> tuple[list[InputSlice], str]:
    """Cut ``file`` into slices of about ``partition_size_bytes`` where its format can.

    Returns the slices and the file's sha256 when it was read to split it (else ``""``).
    Files within the size, and formats that do not split, stay one slice.
    """
    if file.size <= partition_size_bytes:
        return [InputSlice()], ""
    return reader_of(file.format).split(file, partition_size_bytes)


def _sample_fields(file: InputFile, records: int = 100) -> dict[str, str]:
    """Field name -> type name over the first ``records`` records ({} if unreadable)."""
    try:
        return reader_of(file.format).sample_fields(file, records)
    except Exception:  # a hint only: the build already reported what is wrong with the file
        return {}


#: Text files whose fields are sampled for a hint (the largest field sets win, by bytes).
_HINT_FILES = 16
#: Names a text field often has, suggested when no field name is close to the one given.
_TEXT_NAMES = ("text", "content", "body", "document", "raw_content")


def _corpus_fields(files: list[InputFile]) -> dict[str, str]:
    """The fields of the corpus files among the first ones: the field set holding most bytes.

    A metadata file beside the corpus (an ``expected.json``) has other fields; it must not
    supply the hint.
    """
    sampled = [(f, _sample_fields(f)) for f in files[:_HINT_FILES]]
    weight: Counter[frozenset[str]] = Counter()
    for file, fields in sampled:
        if fields:
            weight[frozenset(fields)] += max(file.size, 1)
    if not weight:
        return {}
    corpus = weight.most_common(1)[0][0]
    return next(fields for _, fields in sampled if frozenset(fields) == corpus)


def field_hint(files: list[InputFile], field: str, kind: str = "text") -> str:
    """A hint for records that lack ``field``: the fields seen and the flag to pass.

    Samples the first records of the first files and keeps the fields of the corpus files
    (the field set most bytes hold); ``""`` when the field was seen.
    """
    fields = _corpus_fields(files)
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
        named = [n for n in _TEXT_NAMES if n in strings]
        guess = difflib.get_close_matches(field, strings, n=1) or named[:1] or strings[:1]
        flag = "--text-field"
    return f"{hint}; did you mean {flag} {guess[0]}?" if guess else hint


#: Records read from the start of each file at plan time to find a corpus record.
SAMPLE_RECORDS = 100
#: Bad-record reasons of a record that is not a corpus record at all (another kind of file);
#: any other reason (an empty text, a bad message) is a corpus record that is bad.
_NOT_CORPUS = ("not_json", "not_an_object", "invalid_utf8", "no_text_field",
               "no_messages_field")  # fmt: skip


class _SampleDone(Exception):
    """Ends a sample read early."""


def _holds_corpus_record(file: InputFile, field: str, kind: str) -> bool | None:
    """Whether a file's first records hold a corpus record (None: no record, or unreadable)."""
    not_corpus = 0

    def on_bad(index: int, reason: str, shown: str) -> None:
        nonlocal not_corpus
        if reason == "blank_line":
            return
        if reason not in _NOT_CORPUS:
            raise _SampleDone(True)
        not_corpus += 1
        if not_corpus >= SAMPLE_RECORDS:
            raise _SampleDone(False)

    def on_corrupt(index: int, offset: int, message: str) -> None:
        raise _SampleDone(None)

    reader = reader_of(file.format)
    batcher = Batcher(file.relpath, 1, "skip", on_bad, on_corrupt, kind, reader.position)
    batches = reader.read(file, InputSlice(), batcher, field, ReadHooks())
    try:
        for _ in batches:
            return True
    except _SampleDone as done:
        return done.args[0]
    except Exception:  # the build reports an unreadable file as it reads it
        return None
    finally:
        batches.close()
    return False if not_corpus else None


def check_corpus_files(files: list[InputFile], field: str, kind: str = "text") -> None:
    """Raise ``SourceError`` for files none of whose first records is a corpus record.

    Only when other files hold corpus records: when none does, the field is wrong, and the
    build reports that with ``field_hint``. Each file is read up to its first corpus record
    (at most ``SAMPLE_RECORDS`` records).
    """
    if len(files) < 2:
        return
    found = {f.relpath: _holds_corpus_record(f, field, kind) for f in files}
    stray = [name for name, holds in found.items() if holds is False]
    if not stray or True not in found.values():
        return
    what = "messages" if kind == "chat" else "text"
    shown = ", ".join(stray[:5]) + (f" and {len(stray) - 5} more" if len(stray) > 5 else "")
    glob_hint = " ".join(f"--exclude '{name}'" for name in stray[:3])
    raise SourceError(
        f"inputs: {len(stray)} of {len(files)} file(s) hold no corpus record in their first "
        f"{SAMPLE_RECORDS} records (none is an object with a {what} field {field!r}): "
        f"{shown}; they look like other files beside the corpus (metadata, a summary). Leave "
        f"them out with {glob_hint} (a glob, repeatable), or give the inputs as a glob that "
        "matches only the corpus files (e.g. --input 'DIR/*.jsonl')"
    )


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
    reader = reader_of(file.format)
    batcher = Batcher(file.relpath, batch_docs, on_error, on_bad, on_corrupt, kind,
                      reader.position, on_layout)  # fmt: skip
    hooks = ReadHooks(on_bytes, digest, times, chunk_bytes)
    yield from reader.read(file, part, batcher, text_field, hooks)
