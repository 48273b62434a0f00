"""Parquet: a record is a row; a large file splits into runs of whole row groups.

Only the text column is read. A file without it has every row bad (as records without the
field); a damaged row group loses the rows from there on. The file is hashed after it is read
(a slice of row groups is not a byte range).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from shardcache.builder.inputs.base import (
    Batcher,
    InputFile,
    InputSlice,
    ReadHooks,
    TextBatch,
    flush_and_hash,
    open_input,
    read_column,
    record_columns,
    sha256_input,
)


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


def _read_parquet(
    file: InputFile, batcher: Batcher, text_field: str, part: InputSlice
) -> Iterator[TextBatch]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with contextlib.ExitStack() as stack:
        try:  # an unopenable file is reported as an unreadable footer is, not raised
            pf = pq.ParquetFile(stack.enter_context(open_input(file)))
        except Exception as err:  # pyarrow raises several types for a bad footer
            message = f"{file.relpath}: not a readable parquet file: {err}"
            batcher.corrupt(part.first_record, 0, message, err)
            return
        groups = list(part.row_groups) if part.row_groups is not None else None
        meta = pf.metadata
        n_rows = sum(meta.row_group(g).num_rows for g in (groups or range(meta.num_row_groups)))
        names = pf.schema_arrow.names
        columns = record_columns(batcher.kind, text_field, names)
        batches = iter(()) if not columns else pf.iter_batches(
            batch_size=min(batcher.batch_docs, 65536), columns=columns, row_groups=groups
        )  # fmt: skip
        yield from read_column(file, batcher, text_field, part.first_record, names, n_rows,
                               batches, (pa.ArrowException, OSError), "parquet")  # fmt: skip


@dataclass(frozen=True)
class ParquetFormat:
    """Parquet files; a record is a row."""

    name: str = "parquet"
    suffixes: tuple[str, ...] = (".parquet",)
    position: str = "row"
    in_folders: bool = True
    hashes_while_reading: bool = False

    def split(self, file: InputFile, partition_size_bytes: int) -> tuple[list[InputSlice], str]:
        """See ``InputFormat.split``."""
        return _split_parquet(file, partition_size_bytes), sha256_input(file)

    def read(
        self, file: InputFile, part: InputSlice, batcher: Batcher, text_field: str,
        hooks: ReadHooks,
    ) -> Iterator[TextBatch]:  # fmt: skip
        """See ``InputFormat.read``."""
        yield from flush_and_hash(
            _read_parquet(file, batcher, text_field, part), batcher, file, part, hooks
        )

    def sample_fields(self, file: InputFile, records: int) -> dict[str, str]:
        """See ``InputFormat.sample_fields``."""
        import pyarrow.parquet as pq

        schema = pq.read_schema(file.path)
        return {name: str(schema.field(name).type) for name in schema.names}

    def folder_files(self, folder: str) -> list[str] | None:
        """See ``InputFormat.folder_files``."""
        return None


FORMATS = (ParquetFormat(),)
