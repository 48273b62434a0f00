"""CSV and TSV files with a header row: a record is a data row, its text a named column.

Preference pairs are a row of the ``prompt``, ``chosen`` and ``rejected`` columns (strings).

Quoted fields may span lines, so files are not split. The raw bytes are hashed while read.
Text is UTF-8 (a leading BOM dropped); bytes that are not end the read as a damaged file.
"""

from __future__ import annotations

import csv
import io
import sys
from collections.abc import Iterator
from dataclasses import dataclass

from shardcache.builder.inputs.base import (
    Batcher,
    InputFile,
    InputSlice,
    ReadHooks,
    TextBatch,
    WholeFiles,
    open_hashing,
    open_input,
    record_columns,
)
from shardcache.store.files import HashingReader

csv.field_size_limit(sys.maxsize)  # a document may be far longer than csv's 128 KiB default


def _rows(raw: HashingReader, delimiter: str) -> tuple[list[str], Iterator[list[str]]]:
    """``(header, data rows)`` of a delimited stream (an empty file: no header, no rows)."""
    buffered = io.BufferedReader(raw)  # type: ignore[arg-type]
    text = io.TextIOWrapper(buffered, encoding="utf-8-sig", newline="")
    rows = csv.reader(text, delimiter=delimiter)
    return next(rows, []), rows


def _read_values(
    header: list[str], rows: Iterator[list[str]], batcher: Batcher, text_field: str
) -> Iterator[TextBatch]:
    """Text (or chat) records: each row's ``text_field`` cell; a row without one is bad."""
    column = header.index(text_field) if text_field in header else -1
    reason = "no_messages_field" if batcher.kind == "chat" else "no_text_field"
    for row, values in enumerate(rows):
        if column < 0 or column >= len(values):
            batcher.bad(row, reason, f"columns: {', '.join(header)}")
            continue
        yield from batcher.add_value(row, values[column], text_field)


def _read_pairs(
    header: list[str], rows: Iterator[list[str]], batcher: Batcher, text_field: str
) -> Iterator[TextBatch]:
    """Preference records: the ``prompt``, ``chosen`` and ``rejected`` cells of each row.

    Cells are strings (a cell holding JSON is its text, not a message list). A row too short to
    hold a side lacks it (``no_preference_field``); without a ``chosen`` or ``rejected`` column
    every row is bad, as for Parquet and Arrow files.
    """
    names = record_columns(batcher.kind, text_field, header)
    columns = [(name, header.index(name)) for name in names]
    for row, values in enumerate(rows):
        if not columns:
            batcher.bad(row, "no_preference_field", f"columns: {', '.join(header)}")
            continue
        obj = {name: values[i] for name, i in columns if i < len(values)}
        yield from batcher.add_object(row, obj, text_field, values)


@dataclass(frozen=True)
class DelimitedFormat(WholeFiles):
    """Delimiter-separated values with a header row."""

    name: str
    suffixes: tuple[str, ...]
    delimiter: str
    position: str = "row"
    in_folders: bool = True
    hashes_while_reading: bool = True

    def read(
        self, file: InputFile, part: InputSlice, batcher: Batcher, text_field: str,
        hooks: ReadHooks,
    ) -> Iterator[TextBatch]:  # fmt: skip
        """See ``InputFormat.read``."""
        raw = open_hashing(file, hooks)
        row = -1
        with raw:
            try:
                header, rows = _rows(raw, self.delimiter)
                if batcher.kind == "preference":  # a pair is a row of several columns
                    yield from _read_pairs(header, rows, batcher, text_field)
                else:
                    yield from _read_values(header, rows, batcher, text_field)
            except (UnicodeDecodeError, csv.Error) as err:
                message = f"{file.relpath}: cannot read {self.name} data at row {row + 2}: {err}"
                batcher.corrupt(row + 1, raw.bytes_read, message, err)
            raw.drain()
            if hooks.digest is not None:
                hooks.digest.bytes_read = raw.bytes_read
                hooks.digest.read_sha256 = hooks.digest.sha256 = raw.sha256.hexdigest()
        batch = batcher.flush()
        if batch is not None:
            yield batch

    def sample_fields(self, file: InputFile, records: int) -> dict[str, str]:
        """See ``InputFormat.sample_fields``."""
        with HashingReader(open_input(file)) as raw:  # type: ignore[arg-type]
            header, _ = _rows(raw, self.delimiter)
        return dict.fromkeys(header, "str")

    def folder_files(self, folder: str) -> list[str] | None:
        """See ``InputFormat.folder_files``."""
        return None


FORMATS = (
    DelimitedFormat("csv", (".csv",), ","),
    DelimitedFormat("tsv", (".tsv",), "\t"),
)
