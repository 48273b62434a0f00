"""Export a committed cache to the formats other trainers read: Megatron ``.bin/.idx``, HF datasets.

Exported sequence ``i`` is the cache's sample id ``i`` (its provenance: ``Cache.lookup(i)``), and
each sequence is one document: pieces of a document cut by ``truncation="split"`` stay separate
documents, as Megatron's GPT dataset reads every sequence as a document. Writers stream about
``chunk_tokens`` tokens at a time (memory does not grow with the cache) into a temporary folder
``OUT.<pid>.<hex>.tmp/`` next to the output, locked while it is written, and rename into place at
the end: an error removes it; a killed run leaves it, and the next export to that output finds
it unlocked and cleans up after it. Megatron's ``.bin`` is renamed first and ``.idx`` (which
readers open first) last, from that folder, so a ``.bin`` without its ``.idx`` exists only while
the folder does, and the next run removes it. One writer per format behind ``EXPORTERS``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import BinaryIO

import numpy as np
import pyarrow as pa

from shardcache.errors import CacheError, ConfigError
from shardcache.store.cache import Cache, open_cache
from shardcache.store.columns import TOKEN_COLUMNS
from shardcache.store.files import atomic_file, fsync_dir, private_tmp
from shardcache.store.shards import numpy_arrow

#: Megatron's index header and version (megatron-core ``indexed_dataset._INDEX_HEADER``).
MEGATRON_INDEX_HEADER = b"MMIDIDX\x00\x00"
MEGATRON_INDEX_VERSION = 1
#: Megatron's dtype codes (``indexed_dataset.DType``) of the two types it picks for tokens.
MEGATRON_DTYPE_CODES = {np.dtype(np.uint16): 8, np.dtype(np.int32): 4}
#: Megatron stores tokens as uint16 below this vocabulary size, else int32 (``optimal_dtype``).
MEGATRON_UINT16_BELOW = 65500
#: Lengths per step when the index is written: its memory stays bounded for any cache.
INDEX_BLOCK = 1 << 20


@dataclass(frozen=True)
class ExportOptions:
    """How ``export_cache`` writes.

    Attributes:
        format: a name of ``EXPORTERS``: ``megatron`` or ``hf``.
        drop_loss_mask: megatron: export a chat cache's ids without its loss masks (the format
            has no place for them; without this a chat cache is refused).
        shard_size_bytes: hf: about the size of each Arrow data file (``datasets`` uses 500 MB).
        chunk_tokens: tokens read and written per step (bounds the memory used).
    """

    format: str
    drop_loss_mask: bool = False
    shard_size_bytes: int = 500 * 10**6
    chunk_tokens: int = 1 << 24

    def __post_init__(self) -> None:
        exporter_for(self.format)
        for name in ("shard_size_bytes", "chunk_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"export: {name} is {value!r}, expected an integer >= 1")


@dataclass(frozen=True)
class ExportReport:
    """What ``export_cache`` wrote.

    Attributes:
        format: the format's name.
        output: the prefix (megatron) or folder (hf) written.
        files: the paths written.
        sequences: sequences (= documents) exported.
        tokens: tokens exported.
        dtype: the stored token type.
        loss_mask: whether loss masks were written.
    """

    format: str
    output: str
    files: list[str] = field(default_factory=list)
    sequences: int = 0
    tokens: int = 0
    dtype: str = ""
    loss_mask: bool = False

    def to_json(self) -> dict[str, object]:
        """The report as JSON.

        Returns:
            A dict of the fields above.
        """
        return dict(self.__dict__)


Progress = Callable[[int], None]


def _chunks(lengths: np.ndarray, lo: int, hi: int, chunk_tokens: int) -> Iterator[tuple[int, int]]:
    """Sample-id ranges of ``[lo, hi)`` holding <= ``chunk_tokens`` tokens (or one sequence)."""
    for block in range(lo, hi, INDEX_BLOCK):
        end = min(block + INDEX_BLOCK, hi)
        cum = np.cumsum(lengths[block:end], dtype=np.int64)
        start = 0
        while start < len(cum):
            base = int(cum[start - 1]) if start else 0
            stop = int(np.searchsorted(cum, base + chunk_tokens, side="right"))
            stop = max(stop, start + 1)
            yield block + start, block + stop
            start = stop


def _refuse_existing(paths: list[str]) -> None:
    existing = [p for p in paths if os.path.lexists(p)]
    if existing:
        raise CacheError(
            f"export: {existing[0]!r} already exists; nothing was written. Remove it or "
            "choose another output"
        )


#: The name of the lock file in an export's temporary folder, held while it is written.
TMP_LOCK = "export.lock"


@contextlib.contextmanager
def _export_folder(output: str) -> Iterator[str]:
    """A locked temporary folder next to ``output``, after cleaning up killed runs' leftovers.

    Removed when the block raises; the block renames what it wrote out of it, and the folder
    goes when the block ends.
    """
    output = os.path.abspath(output)
    parent = os.path.dirname(output)
    os.makedirs(parent, exist_ok=True)
    _clean_leftovers(output)
    tmp = private_tmp(output)
    os.makedirs(tmp)
    try:
        fd = os.open(os.path.join(tmp, TMP_LOCK), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield tmp
        finally:
            os.close(fd)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    fsync_dir(parent)


def _clean_leftovers(output: str) -> None:
    """Remove the temporary folders of killed exports to ``output`` (and a lone ``.bin``).

    A folder whose lock no process holds is a killed run's; one still locked is a live
    export's, refused. A Megatron run killed between its two renames left ``OUT.bin`` without
    ``OUT.idx`` and its ``.idx`` in the folder: that ``.bin`` is removed with it.
    """
    parent, base = os.path.split(output)
    pattern = re.compile(re.escape(base) + r"\.\d+\.[0-9a-f]{8}\.tmp")
    for name in sorted(os.listdir(parent)):
        folder = os.path.join(parent, name)
        if not pattern.fullmatch(name) or not os.path.isdir(folder):
            continue
        lock = os.path.join(folder, TMP_LOCK)
        with contextlib.suppress(FileNotFoundError), open(lock, "rb") as f:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise CacheError(
                    f"export: another export to {output!r} is running (its temporary folder "
                    f"{folder!r} is locked); wait for it, or choose another output"
                ) from None
        killed_between = os.path.exists(os.path.join(folder, "data.idx")) and not os.path.exists(
            os.path.join(folder, "data.bin")
        )
        if killed_between and not os.path.exists(output + ".idx"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(output + ".bin")
        shutil.rmtree(folder, ignore_errors=True)


def _check_outside(cache: Cache, output: str) -> None:
    """Refuse an output inside the cache's folder (it would write into the cache)."""
    if cache.remote:
        return
    root = os.path.realpath(cache.path)
    target = os.path.realpath(output)
    if os.path.commonpath([root, target]) == root:
        raise ConfigError(
            f"export: the output {output!r} is inside the cache {cache.path!r}; an export "
            "would write into the cache's folder. Choose an output outside it"
        )


def _write_synced(path: str, write: Callable[[BinaryIO], None]) -> None:
    """Write a new file in an export's temporary folder and fsync it."""
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def megatron_dtype(cache: Cache) -> np.dtype:
    """The token type Megatron's ``preprocess_data`` would pick for the cache's vocabulary."""
    tokenizer = cache.manifest["tokenizer"]
    cardinality = max(int(tokenizer["vocab_size"]), int(tokenizer["max_token_id"]) + 1)
    return np.dtype(np.uint16 if cardinality < MEGATRON_UINT16_BELOW else np.int32)


def _write_megatron_index(f: BinaryIO, lengths: np.ndarray, dtype: np.dtype) -> None:
    """Write ``.idx``: header, int32 lengths, int64 byte pointers, document indices 0..n."""
    n = len(lengths)
    write = f.write
    write(MEGATRON_INDEX_HEADER)
    write(struct.pack("<Q", MEGATRON_INDEX_VERSION))
    write(struct.pack("<B", MEGATRON_DTYPE_CODES[dtype]))
    write(struct.pack("<Q", n))
    write(struct.pack("<Q", n + 1))  # document indices: one per document, plus the leading 0
    for lo in range(0, n, INDEX_BLOCK):
        write(np.asarray(lengths[lo : lo + INDEX_BLOCK], dtype=np.int32).tobytes())
    pointer = 0
    for lo in range(0, n, INDEX_BLOCK):
        block = np.asarray(lengths[lo : lo + INDEX_BLOCK], dtype=np.int64) * dtype.itemsize
        starts = np.cumsum(block) - block + pointer
        write(starts.tobytes())
        pointer += int(block.sum())
    for lo in range(0, n + 1, INDEX_BLOCK):
        write(np.arange(lo, min(lo + INDEX_BLOCK, n + 1), dtype=np.int64).tobytes())


def write_megatron(
    cache: Cache, output: str, options: ExportOptions, progress: Progress | None
) -> ExportReport:
    """Write ``output.bin`` and ``output.idx`` (megatron-core ``IndexedDataset``)."""
    if output.endswith((".bin", ".idx")):
        raise ConfigError(
            f"export --format megatron: {output!r} ends with {output[-4:]!r}; give the prefix "
            f"without it ({output[:-4]!r}): .bin and .idx are added"
        )
    if cache.has_mask and not options.drop_loss_mask:
        raise ConfigError(
            f"export --format megatron: {cache.path!r} is a chat cache with loss masks, which "
            "Megatron's .bin/.idx cannot hold; use --format hf to keep them, or "
            "--drop-loss-mask to export the ids alone"
        )
    bin_path, idx_path = output + ".bin", output + ".idx"
    dtype = megatron_dtype(cache)
    n = cache.num_sequences

    def write_data(data: BinaryIO) -> None:
        for lo, hi in _chunks(cache.lengths, 0, n, options.chunk_tokens):
            got = cache.gather(np.arange(lo, hi, dtype=np.int64), dtype=dtype)
            data.write(got.tokens.tobytes())
            if progress is not None:
                progress(len(got.tokens))

    with _export_folder(output) as tmp:
        _refuse_existing([bin_path, idx_path])
        _write_synced(os.path.join(tmp, "data.bin"), write_data)
        _write_synced(os.path.join(tmp, "data.idx"),
                      lambda f: _write_megatron_index(f, cache.lengths, dtype))  # fmt: skip
        _refuse_existing([bin_path, idx_path])
        # .bin first, .idx (which readers open first) last: a kill between the two leaves
        # data.idx in the folder, which tells the next run that the lone .bin is this run's
        os.rename(os.path.join(tmp, "data.bin"), bin_path)
        os.rename(os.path.join(tmp, "data.idx"), idx_path)
    return ExportReport("megatron", output, [bin_path, idx_path], n, cache.num_tokens,
                        dtype.name, False)  # fmt: skip


def _hf_schema(with_mask: bool, columns: Sequence[str] = ()) -> pa.Schema:
    """``input_ids``, ``loss_mask``, then one list per per-token column, named by its batch key."""
    fields = [pa.field("input_ids", pa.list_(pa.int32()))]
    if with_mask:
        fields.append(pa.field("loss_mask", pa.list_(pa.int8())))
    for name in columns:
        spec = TOKEN_COLUMNS[name]
        fields.append(pa.field(spec.batch_key, pa.list_(spec.arrow_type)))
    return pa.schema(fields)


def hf_shard_bounds(cache: Cache, with_mask: bool, shard_size_bytes: int) -> np.ndarray:
    """Sample-id bounds of the data files: equal row counts, as ``save_to_disk`` shards."""
    n = cache.num_sequences
    columns = [TOKEN_COLUMNS[name] for name in cache.columns]
    per_token = 4 + (1 if with_mask else 0) + sum(c.dtype.itemsize for c in columns)
    per_row = 4 + (4 if with_mask else 0) + 4 * len(columns)  # list offsets
    size = cache.num_tokens * per_token + n * per_row
    files = max(1, min(n, -(-size // shard_size_bytes)))
    return np.linspace(0, n, files + 1).round().astype(np.int64)


def write_hf(
    cache: Cache, output: str, options: ExportOptions, progress: Progress | None
) -> ExportReport:
    """Write a folder that ``datasets.load_from_disk`` reads: Arrow stream files + two JSONs."""
    _refuse_existing([output])
    with_mask, extras = cache.has_mask, cache.columns
    schema = _hf_schema(with_mask, extras)
    bounds = hf_shard_bounds(cache, with_mask, options.shard_size_bytes)
    names = [f"data-{i:05d}-of-{len(bounds) - 1:05d}.arrow" for i in range(len(bounds) - 1)]
    with _export_folder(output) as work:
        tmp = os.path.join(work, "dataset")  # the folder renamed to ``output``, without the lock
        os.makedirs(tmp)
        for name, lo, hi in zip(names, bounds[:-1], bounds[1:]):
            with atomic_file(os.path.join(tmp, name)) as f, pa.ipc.new_stream(f, schema) as out:
                for a, b in _chunks(cache.lengths, int(lo), int(hi), options.chunk_tokens):
                    got = cache.gather(np.arange(a, b, dtype=np.int64), with_mask=with_mask,
                                       dtype=np.int32, columns=extras)  # fmt: skip
                    offsets = numpy_arrow(got.offsets.astype(np.int32))
                    columns = [pa.ListArray.from_arrays(offsets, numpy_arrow(got.tokens))]
                    if got.mask is not None:
                        mask = numpy_arrow(got.mask.view(np.int8))
                        columns.append(pa.ListArray.from_arrays(offsets, mask))
                    for values in got.extras.values():
                        columns.append(pa.ListArray.from_arrays(offsets, numpy_arrow(values)))
                    out.write_batch(pa.record_batch(columns, schema=schema))
                    if progress is not None:
                        progress(len(got.tokens))
        # features left out: datasets infers them from the Arrow schema, in its own version's
        # spelling (List in datasets >= 4, Sequence before)
        info = {"citation": "", "description": "", "homepage": "", "license": ""}
        state: dict[str, object] = {
            "_data_files": [{"filename": name} for name in names],
            "_fingerprint": _fingerprint(cache, with_mask),
            "_format_columns": None,
            "_format_kwargs": {},
            "_format_type": None,
            "_output_all_columns": False,
            "_split": None,
        }
        for name, obj in (("dataset_info.json", info), ("state.json", state)):
            with atomic_file(os.path.join(tmp, name)) as f:
                f.write((json.dumps(obj, indent=2) + "\n").encode())
        _refuse_existing([output])
        os.rename(tmp, output)
    files = [os.path.join(output, name) for name in [*names, "dataset_info.json", "state.json"]]
    return ExportReport("hf", output, files, cache.num_sequences, cache.num_tokens, "int32",
                        with_mask)  # fmt: skip


def _fingerprint(cache: Cache, with_mask: bool) -> str:
    """A ``datasets`` fingerprint: the cache key's digest (16 hex), so equal caches share it."""
    digest = str((cache.manifest.get("key") or {}).get("digest", "")) or "0" * 16
    return digest[:15] + ("m" if with_mask else "0")


#: Export formats by name.
EXPORTERS: dict[str, Callable[[Cache, str, ExportOptions, Progress | None], ExportReport]] = {
    "hf": write_hf,
    "megatron": write_megatron,
}


def exporter_for(name: str) -> Callable[[Cache, str, ExportOptions, Progress | None], ExportReport]:
    """The writer of format ``name`` (``ConfigError`` listing the valid names otherwise)."""
    try:
        return EXPORTERS[name]
    except (KeyError, TypeError):
        raise ConfigError(
            f"export: unknown format {name!r}; valid formats: {', '.join(sorted(EXPORTERS))}"
        ) from None


def export_cache(
    cache: str | os.PathLike[str] | Cache,
    output: str | os.PathLike[str],
    options: ExportOptions,
    progress: Progress | None = None,
) -> ExportReport:
    """Export a cache's sequences, in sample-id order, one document each.

    Args:
        cache: the cache folder or URL, or an open ``Cache`` (left open).
        output: megatron: the path prefix (``.bin`` and ``.idx`` are added); hf: the folder.
        options: the format and its settings.
        progress: told the number of tokens written after each step.

    Returns:
        What was written.

    Raises:
        ConfigError: a chat cache to megatron without ``drop_loss_mask``; a prefix ending in
            ``.bin`` or ``.idx``; an output inside the cache's folder.
        CacheNotFoundError: no committed cache there.
        CacheError: the output exists (nothing is written), or another export to it is
            running.
        CorruptShardError: a shard is damaged (nothing is left under the output's name).
    """
    writer = exporter_for(options.format)
    out = os.fspath(output)
    if isinstance(cache, Cache):
        _check_outside(cache, out)
        return writer(cache, out, options, progress)
    with contextlib.closing(open_cache(cache)) as opened:
        _check_outside(opened, out)
        return writer(opened, out, options, progress)
