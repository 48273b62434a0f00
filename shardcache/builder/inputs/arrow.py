"""Arrow IPC files (``.arrow``, Feather v2 ``.feather``) and HF ``datasets`` saved folders.

A record is a row; only the text column is used. ``.arrow`` holds either IPC layout: the file
one (Feather v2) or the stream one that ``datasets.Dataset.save_to_disk`` writes. A folder
with that method's ``state.json`` is read as its data files in the dataset's order, never as
its metadata. Files are not split (save_to_disk already shards large datasets) and are hashed
after they are read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from shardcache.builder.inputs.base import (
    Batcher,
    InputFile,
    InputSlice,
    ReadHooks,
    TextBatch,
    WholeFiles,
    flush_and_hash,
    open_input,
    read_column,
    record_columns,
)

#: What ``datasets.Dataset.save_to_disk`` writes beside the data files.
HF_STATE = "state.json"
#: What ``datasets.DatasetDict.save_to_disk`` writes beside its split folders.
HF_SPLITS = "dataset_dict.json"


def _open_ipc(handle: Any) -> tuple[Any, Iterator[Any]]:
    """``(schema, record batches)`` of an IPC file or stream."""
    import pyarrow as pa

    try:
        reader = pa.ipc.open_file(handle)
    except pa.ArrowInvalid:  # not the file layout: the stream one (save_to_disk)
        handle.seek(0)
        stream = pa.ipc.open_stream(handle)
        return stream.schema, iter(stream)
    return reader.schema, (reader.get_batch(i) for i in range(reader.num_record_batches))


def _read_arrow(
    file: InputFile, batcher: Batcher, text_field: str, part: InputSlice
) -> Iterator[TextBatch]:
    import pyarrow as pa

    with open_input(file) as handle:
        try:
            schema, batches = _open_ipc(handle)
        except Exception as err:  # pyarrow raises several types for a bad header
            message = f"{file.relpath}: not a readable Arrow IPC file: {err}"
            batcher.corrupt(part.first_record, 0, message, err)
            return
        names = list(schema.names)
        n_rows = 0
        selected = record_columns(batcher.kind, text_field, names)
        if not selected:
            n_rows = sum(b.num_rows for b in batches)
        columns = (b.select(selected) for b in batches)
        yield from read_column(file, batcher, text_field, part.first_record, names, n_rows,
                               columns, (pa.ArrowException, OSError), "Arrow")  # fmt: skip


def hf_data_files(folder: str) -> list[str] | None:
    """The data files of a ``save_to_disk`` folder, in the dataset's order (None: not one).

    A ``DatasetDict`` folder gives its splits' files, split by split.
    """
    try:
        if os.path.isfile(os.path.join(folder, HF_SPLITS)):
            with open(os.path.join(folder, HF_SPLITS), encoding="utf-8") as f:
                splits = json.load(f)["splits"]
            return [p for s in splits for p in hf_data_files(os.path.join(folder, s)) or []]
        if not os.path.isfile(os.path.join(folder, HF_STATE)):
            return None
        with open(os.path.join(folder, HF_STATE), encoding="utf-8") as f:
            files = json.load(f)["_data_files"]
        return [os.path.join(folder, entry["filename"]) for entry in files]
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass(frozen=True)
class ArrowFormat(WholeFiles):
    """Arrow IPC files, file or stream layout; a record is a row."""

    name: str = "arrow"
    suffixes: tuple[str, ...] = (".arrow", ".feather")
    position: str = "row"
    in_folders: bool = True
    hashes_while_reading: bool = False

    def read(
        self, file: InputFile, part: InputSlice, batcher: Batcher, text_field: str,
        hooks: ReadHooks,
    ) -> Iterator[TextBatch]:  # fmt: skip
        """See ``InputFormat.read``."""
        yield from flush_and_hash(
            _read_arrow(file, batcher, text_field, part), batcher, file, part, hooks
        )

    def sample_fields(self, file: InputFile, records: int) -> dict[str, str]:
        """See ``InputFormat.sample_fields``."""
        with open_input(file) as handle:
            schema, _ = _open_ipc(handle)
        return {name: str(schema.field(name).type) for name in schema.names}

    def folder_files(self, folder: str) -> list[str] | None:
        """See ``InputFormat.folder_files``."""
        return hf_data_files(folder)


FORMATS = (ArrowFormat(),)
