"""Read access to a committed cache: ``open_cache`` -> ``Cache``.

A ``Cache`` owns the manifest, the memory-mapped length index and an LRU of open shard readers.
Sample ids are global row numbers (shards in manifest order); opening a cache opens no shard.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Container, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardcache.errors import ConfigError, CorruptShardError
from shardcache.store.columns import TOKEN_COLUMNS, stored_columns
from shardcache.store.files import sha256_text
from shardcache.store.integrity import check_file
from shardcache.store.layout import CONTENT_KEYS_FILE, LENGTHS_FILE, cache_path, shard_path
from shardcache.store.manifest import MASKED_KINDS, read_manifest
from shardcache.store.remote import RemoteCache, is_url
from shardcache.store.shards import DecodedBatches, FlatRows, ShardReader

#: ``fetch(shard entry) -> (local path, release)``: where a shard's bytes are, and what to call
#: once the reader no longer needs them (a remote cache keeps its lock on the file until then).
Fetch = Callable[[dict[str, Any]], tuple[str, Callable[[], None]]]


def _no_release() -> None:
    return None


class ShardCache:
    """An LRU of open ``ShardReader``s that owns them and the releases ``fetch`` gave with them.

    Closing a reader always calls its release: a remote download stays under a shared lock until
    then. ``on_close`` is told the index of each shard closed.
    """

    def __init__(
        self,
        shards: list[dict[str, Any]],
        dtype: np.dtype,
        size: int,
        fetch: Fetch,
        reader_options: dict[str, Any] | None = None,
        on_close: Callable[[int], None] | None = None,
    ):
        self.shards = shards
        self.on_close = on_close
        self.dtype = dtype
        self.size = max(1, size)
        self.fetch = fetch
        self.reader_options = dict(reader_options or {})
        #: decoded record batches of the compressed shards open here
        self.decoded = DecodedBatches()
        self.closed = False
        self._open: OrderedDict[int, tuple[ShardReader, Callable[[], None]]] = OrderedDict()

    def get(self, index: int) -> ShardReader:
        """Shard ``index``'s reader, opened when needed; owned here, valid until closed for room."""
        entry = self._open.get(index)
        if entry is not None:
            self._open.move_to_end(index)
            return entry[0]
        if self.closed:
            raise ValueError("the cache is closed: open it again to read")
        path, release = self.fetch(self.shards[index])
        try:
            reader = ShardReader(
                path, self.shards[index], self.dtype, decoded=self.decoded, **self.reader_options
            )
        except BaseException:
            release()
            raise
        self._open[index] = (reader, release)
        if len(self._open) > self.size:
            self._close_one()
        return reader

    def close_next(self, index: int) -> None:
        """Make open shard ``index`` the next one closed for room."""
        if index in self._open:
            self._open.move_to_end(index, last=False)

    def _close_one(self) -> None:
        self._close(next(iter(self._open)))

    def _close(self, index: int) -> None:
        reader, release = self._open.pop(index)
        if self.on_close is not None:
            self.on_close(index)
        try:
            reader.close()
        finally:
            release()

    def shed(self) -> bool:
        """Close the least recently used open shard; False when none was open."""
        if not self._open:
            return False
        self._close_one()
        return True

    def close_idle(self, keep: Container[int], room: int) -> int:
        """Close LRU shards not in ``keep`` till they hold <= ``room`` bytes; return their bytes."""
        idle = [index for index in self._open if index not in keep]
        used = sum(int(self.shards[index]["bytes"]) for index in idle)
        for index in idle:  # least recently used first
            if used <= room:
                break
            self._close(index)
            used -= int(self.shards[index]["bytes"])
        return used

    def close(self) -> None:
        """Close every open shard; ``get`` refuses afterwards."""
        self.closed = True
        while self._open:
            self._close_one()


@dataclass(frozen=True)
class Gathered:
    """Segments read by ``Cache.gather``: tokens, int64 offsets (one more than segments), mask.

    ``extras``: the per-token columns asked for (``TOKEN_COLUMNS`` names), each lined up with
    ``tokens``.
    """

    tokens: np.ndarray
    offsets: np.ndarray
    mask: np.ndarray | None = None
    extras: Mapping[str, np.ndarray] = field(default_factory=dict)

    @property
    def lengths(self) -> np.ndarray:
        """Tokens of each segment (int64)."""
        return self.offsets[1:] - self.offsets[:-1]


#: A ``MappedTable`` ``mask_starts`` entry of a sequence without a loss mask (every token
#: has a loss): a plain-text source's, in a mixture's table with chat sources.
NO_MASK = -1


@dataclass(frozen=True)
class MappedTable:
    """The open memory-mapped shards of a cache by address, for a compiled reader.

    Shard ``s`` holds sample ids ``shard_starts[s]:shard_starts[s+1]``; while open (``addresses[s]``
    non-zero) its tokens are the ``sizes[s]`` values there. Sample ``i`` starts at value
    ``file_starts[i]`` of its shard; a chat cache's loss mask is ``lengths[i]`` bits from bit
    ``mask_starts[i]`` (``NO_MASK``: none). A reader stamps ``last_used[s] = clock[0]`` (the LRU
    closes the oldest) and checks ids against ``max_id``. An address is valid until the next
    ``Cache.open_mapped`` or close: no Python code may run between reading and copying.
    """

    addresses: np.ndarray
    sizes: np.ndarray
    last_used: np.ndarray
    clock: np.ndarray
    shard_starts: np.ndarray
    file_starts: np.ndarray
    lengths: np.ndarray
    dtype: np.dtype
    max_id: int
    mask_starts: np.ndarray


@dataclass(frozen=True)
class Provenance:
    """Where a sequence came from.

    Attributes:
        source: the input file, relative to the build's input root.
        record: the record's 0-based index in that file.
        piece: the piece of the record (0 unless ``truncation="split"`` cut it).
    """

    source: str
    record: int
    piece: int

    @property
    def line(self) -> int:
        """The 1-based line (jsonl) or row (parquet) of the record."""
        return self.record + 1


@dataclass(frozen=True)
class Sequence:
    """One stored sequence, its provenance and its loss mask (chat caches; else None)."""

    sample_id: int
    ids: np.ndarray
    provenance: Provenance
    mask: np.ndarray | None = None


def _forget_in(addresses: np.ndarray, mapped: dict[int, np.ndarray]) -> Callable[[int], None]:
    """``on_close`` of a cache's ``ShardCache``: it holds the arrays, not the cache (no cycle)."""

    def forget(index: int) -> None:
        addresses[index] = 0
        mapped.pop(index, None)

    return forget


#: Share of the process's open-file limit that open shards may take (each memory map holds
#: a descriptor), leaving the rest to the program, its DataLoader pipes and other caches.
SHARD_SHARE_OF_FILE_LIMIT = 4


def shards_within_file_limit(requested: int, caches: int = 1) -> int:
    """Shards each of ``caches`` caches may open: <= ``requested``, in a share of the file limit."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return requested
    return max(4, min(requested, soft // SHARD_SHARE_OF_FILE_LIMIT // max(1, caches)))


class Cache:
    """A committed cache, local or at a URL; make one with [`open_cache`][shardcache.open_cache].

    A context manager; reads raise ``CorruptShardError`` on a damaged shard.

    Args:
        path: the cache folder or URL.
        open_shards: how many shards stay open at once.

    Raises:
        CacheNotFoundError: no committed cache there.
        CorruptShardError: the length index is damaged or disagrees with the manifest.
    """

    def __init__(self, path: str, open_shards: int = 8):
        self.path = os.fspath(path)
        remote = RemoteCache(self.path) if is_url(self.path) else None
        self.manifest: dict[str, Any] = (
            remote.manifest if remote is not None else read_manifest(self.path)
        )
        self.dtype = np.dtype(self.manifest["dtype"])
        self.shards: list[dict[str, Any]] = self.manifest["shards"]
        rows = np.fromiter((s["rows"] for s in self.shards), dtype=np.int64, count=len(self.shards))
        self.shard_starts = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(rows, out=self.shard_starts[1:])
        self.shard_buckets = np.fromiter(
            (s["bucket"] for s in self.shards), dtype=np.int32, count=len(self.shards)
        )
        lengths_path = (
            remote.lengths_path if remote is not None else cache_path(self.path, LENGTHS_FILE)
        )
        # the index decides batch shapes and every read trusts it: checked like a shard
        check_file(lengths_path, self.manifest["index"]["lengths"], "length index")
        try:
            self.lengths: np.ndarray = np.load(lengths_path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as err:
            raise CorruptShardError(
                f"{lengths_path}: cannot read the length index ({err}); rebuild the cache"
            ) from err
        if self.lengths.ndim != 1 or self.lengths.dtype.kind not in "ui":
            raise CorruptShardError(
                f"{lengths_path}: length index of dtype {self.lengths.dtype} and shape "
                f"{self.lengths.shape}, expected 1-d unsigned integers; rebuild the cache"
            )
        # a plain ndarray over the same map: np.memmap indexing costs a Python call
        self._lengths_plain = self.lengths.view(np.ndarray)
        if len(self.lengths) != int(self.shard_starts[-1]):
            raise CorruptShardError(
                f"{lengths_path}: {len(self.lengths)} lengths but the shards hold "
                f"{int(self.shard_starts[-1])} rows; the cache is damaged, rebuild it"
            )
        fetch: Fetch = (
            remote.fetch_shard
            if remote is not None
            else lambda info: (shard_path(self.path, info["name"]), _no_release)
        )
        self._max_id = int(self.manifest["tokenizer"]["max_token_id"])  # (validated)
        options = {
            "max_token_id": self._max_id,
            "with_mask": self.has_mask,
            "columns": self.columns,
        }
        # the mapped-shard table (mapped_table): shards whose rows were checked against the
        # index and recorded, and the token arrays of the open ones by address
        self._recorded = np.zeros(len(self.shards), dtype=bool)
        self._file_starts: np.ndarray | None = None
        self._mask_starts = np.zeros(self.num_sequences if self.has_mask else 0, dtype=np.int64)
        self._addresses = np.zeros(len(self.shards), dtype=np.int64)
        self._sizes = np.zeros(len(self.shards), dtype=np.int64)
        self._mapped: dict[int, np.ndarray] = {}
        self._table: MappedTable | None = None
        self._shards = ShardCache(
            self.shards, self.dtype, open_shards, fetch, options,
            _forget_in(self._addresses, self._mapped),
        )  # fmt: skip
        #: the object store behind a URL (None for a local folder)
        self.remote = remote
        self._content_keys: np.ndarray | None = None  # read when first asked for
        if remote is not None:
            remote.shed = self._shards.shed

    def __repr__(self) -> str:
        return (
            f"Cache({self.path!r}, sequences={self.num_sequences}, tokens={self.num_tokens}, "
            f"shards={len(self.shards)})"
        )

    def close(self) -> None:
        """Close the open shards and release the length index (idempotent)."""
        self._shards.close()
        self._table = None
        self.lengths = self._lengths_plain = np.zeros(0, dtype=self.lengths.dtype)
        self._content_keys = None

    def __enter__(self) -> Cache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def num_sequences(self) -> int:
        """Sequences (sample ids) in the cache."""
        return int(self.shard_starts[-1])

    @property
    def num_tokens(self) -> int:
        """Tokens in the cache."""
        return int(self.manifest["totals"]["tokens"])

    @property
    def pad_id(self) -> int:
        """The tokenizer's padding id."""
        return int(self.manifest["tokenizer"]["pad_id"])

    @property
    def has_mask(self) -> bool:
        """True for chat and preference caches, whose shards store a loss mask per token."""
        return self.manifest.get("kind") in MASKED_KINDS

    @property
    def columns(self) -> tuple[str, ...]:
        """The per-token columns its shards store beside the mask (``TOKEN_COLUMNS`` names).

        The manifest's tokenizer facts name the build option each came from.
        """
        return stored_columns(self.manifest)

    @property
    def has_weights(self) -> bool:
        """True when its shards store per-message loss weights (``"weights" in columns``)."""
        return "weights" in self.columns

    @property
    def is_preference(self) -> bool:
        """True for preference caches: pair ``k`` is sample ids ``2k`` (chosen), ``2k + 1``."""
        return self.manifest.get("kind") == "preference"

    def buckets(self) -> np.ndarray:
        """Bucket index of every sample id, from the shard table.

        Returns:
            int32, one per sample id.
        """
        return np.repeat(self.shard_buckets, np.diff(self.shard_starts))

    def _locate(self, sample_id: int) -> tuple[int, int]:
        if not 0 <= sample_id < self.num_sequences:
            raise IndexError(
                f"sample id {sample_id} out of range: the cache holds {self.num_sequences}"
            )
        shard = int(np.searchsorted(self.shard_starts, sample_id, side="right")) - 1
        return shard, sample_id - int(self.shard_starts[shard])

    def read(self, sample_id: int) -> np.ndarray:
        """The ids of one sequence.

        Args:
            sample_id: its global row number (IndexError when out of range).

        Returns:
            A read-only view into its shard.
        """
        shard, row = self._locate(sample_id)
        return self._shards.get(shard).tokens(row)

    def gather(
        self,
        sample_ids: np.ndarray,
        starts: np.ndarray | None = None,
        lengths: np.ndarray | None = None,
        with_mask: bool = False,
        dtype: np.dtype | type | None = None,
        layout: tuple[np.ndarray, int] | None = None,
        fill: int = 0,
        columns: tuple[str, ...] = (),
    ) -> Gathered:
        """The tokens of several segments, in the order given, one copy per record batch.

        Args:
            sample_ids: the sequence of each segment (IndexError when out of range).
            starts: first token of each segment (default 0).
            lengths: tokens of each segment (default: the rest of the sequence).
            with_mask: also gather the loss masks (all True for plain-text caches).
            dtype: type of the returned tokens (default the stored type; the copy casts).
            layout: ``(dst, size)`` places segment ``k`` at ``dst[k]`` of a ``size``-token array
                instead of concatenating them (padded rows without a second copy).
            fill: the value of the slots ``layout`` leaves empty (their mask is False).
            columns: also gather these per-token columns (``TOKEN_COLUMNS`` names; one the
                cache does not store: its spec's default; empty slots its ``fill``).

        Returns:
            The tokens, the segments' offsets (also with ``layout``), and the masks and
            columns when asked.
        """
        if self._shards.closed:
            raise ValueError(f"{self.path}: the cache is closed: open it again to read")
        ids = np.asarray(sample_ids, dtype=np.int64)
        n = len(ids)
        if n and (int(ids.min()) < 0 or int(ids.max()) >= self.num_sequences):
            bad = int(ids[(ids < 0) | (ids >= self.num_sequences)][0])
            raise IndexError(f"sample id {bad} out of range: the cache holds {self.num_sequences}")
        full = self._lengths_plain[ids].astype(np.int64)
        first = np.zeros(n, dtype=np.int64) if starts is None else np.asarray(starts, np.int64)
        take = full - first if lengths is None else np.asarray(lengths, dtype=np.int64)
        if np.any((first < 0) | (take < 0) | (first + take > full)):
            raise IndexError(f"{self.path}: a segment reaches past the end of its sequence")
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(take, out=offsets[1:])
        out_dtype = self.dtype if dtype is None else dtype
        if layout is None:
            tokens = np.empty(int(offsets[-1]), dtype=out_dtype)
            mask = np.empty(len(tokens), dtype=bool) if with_mask else None
            extras = {n: np.empty(len(tokens), TOKEN_COLUMNS[n].dtype) for n in columns}
            dst = offsets
        else:
            dst, size = np.asarray(layout[0], dtype=np.int64), int(layout[1])
            if len(dst) != n or (n and (dst.min() < 0 or (dst + take).max() > size)):
                raise IndexError(f"{self.path}: layout: segments fall outside the {size} slots")
            tokens = np.full(size, fill, dtype=out_dtype)
            mask = np.zeros(size, dtype=bool) if with_mask else None
            extras = {n: np.full(size, TOKEN_COLUMNS[n].fill, TOKEN_COLUMNS[n].dtype)
                      for n in columns}  # fmt: skip
        shard = np.searchsorted(self.shard_starts, ids, side="right") - 1
        rows = ids - self.shard_starts[shard]
        # segments grouped by shard (stable: in order inside a shard)
        order = np.argsort(shard, kind="stable")
        cuts = np.flatnonzero(np.diff(shard[order])) + 1
        for sel in np.split(order, cuts) if n else []:
            reader = self._shards.get(int(shard[sel[0]]))
            reader.gather_into(
                rows[sel], first[sel], take[sel], dst[sel], tokens, mask, full[sel], extras
            )
        return Gathered(tokens, offsets, mask, extras)

    def mapped_table(self) -> MappedTable | None:
        """The table of memory-mapped shards for compiled readers.

        Returns:
            One table for the cache's life, or None for a compressed cache.
        """
        layout = (self.manifest.get("options") or {}).get("layout") or {}
        if layout.get("compression", "none") != "none":
            return None  # (a cache resumed under another compression: open_mapped says so)
        if self._table is None:
            self._table = MappedTable(
                self._addresses,
                self._sizes,
                np.zeros(len(self.shards), dtype=np.int64),
                np.ones(1, dtype=np.int64),
                self.shard_starts,
                self._starts_table(),
                self._lengths_plain,
                self.dtype,
                self._max_id,
                self._mask_starts,
            )
        return self._table

    def open_mapped(self, index: int) -> bool:
        """Open a shard for ``mapped_table`` readers (checked like any open).

        Args:
            index: the shard's position in the manifest.

        Returns:
            False when the shard (or the cache) is compressed.
        """
        table = self.mapped_table()
        if table is None:
            return False
        if index not in self._mapped and len(self._mapped) >= self._shards.size:
            mapped = np.fromiter(self._mapped, dtype=np.int64, count=len(self._mapped))
            self._shards.close_next(int(mapped[np.argmin(table.last_used[mapped])]))
        reader = self._shards.get(index)
        flat = reader.flat_rows()
        if flat is None:
            return False
        if not self._recorded[index]:
            self._record(index, flat, reader)
        self._mapped[index] = flat.tokens  # keeps the address valid while the shard is open
        self._addresses[index] = flat.tokens.__array_interface__["data"][0]
        self._sizes[index] = len(flat.tokens)
        table.last_used[index] = table.clock[0]  # used by the read that asked for it
        return True

    def _record(self, index: int, flat: FlatRows, reader: ShardReader) -> None:
        """Check a shard's rows against the length index and record their starts."""
        lo, hi = int(self.shard_starts[index]), int(self.shard_starts[index + 1])
        want = self._lengths_plain[lo:hi]
        if len(flat.lengths) != hi - lo or not (flat.lengths == want).all():
            bad = np.flatnonzero(flat.lengths[: hi - lo] != want[: len(flat.lengths)])
            row = int(bad[0]) if len(bad) else min(len(flat.lengths), hi - lo)
            stored = int(flat.lengths[row]) if row < len(flat.lengths) else 0
            expected = int(want[row]) if row < len(want) else 0
            raise CorruptShardError(
                f"{self.path}: sample {lo + row} holds {stored} tokens but the length index "
                f"says {expected}; the index and the shards disagree: run `shardcache verify` "
                "and rebuild"
            )
        self._starts_table()[lo:hi] = flat.starts
        if self.has_mask:
            bits = reader.mask_bit_starts()
            assert bits is not None and len(bits) == hi - lo  # (uncompressed: flat is not None)
            self._mask_starts[lo:hi] = bits
        self._recorded[index] = True

    def _starts_table(self) -> np.ndarray:
        """Every sample's start in its shard's token array (filled by ``_record``)."""
        if self._file_starts is None:
            # zero pages cost no memory until written
            self._file_starts = np.zeros(self.num_sequences, dtype=self.starts_dtype())
        return self._file_starts

    def starts_dtype(self) -> np.dtype:
        """The row start table's type (``_starts_table``, ``adopt_starts``).

        Returns:
            uint32 when every shard file is under 4 G tokens, else int64.
        """
        largest = max((int(info.get("bytes", 0)) for info in self.shards), default=0)
        small = largest // self.dtype.itemsize < 2**32
        return np.dtype(np.uint32 if small else np.int64)

    def adopt_starts(self, table: np.ndarray) -> bool:
        """Record row starts into ``table`` (zeros; a slice of a mixture's combined table).

        Taken only before this cache made its own and when ``table`` fits: one table for the
        mixture instead of a copy per source.

        Args:
            table: zeros of ``starts_dtype()``, one per sample id.

        Returns:
            Whether it was taken.
        """
        if (
            self._file_starts is not None
            or table.dtype != self.starts_dtype()
            or table.shape != (self.num_sequences,)
        ):
            return False
        self._file_starts = table
        return True

    def close_idle(self, keep: Container[int], room: int) -> int:
        """Close idle shards to make room in a bounded local shard cache.

        Args:
            keep: shards that stay open.
            room: the most bytes (manifest sizes) the open shards outside ``keep`` may hold.

        Returns:
            The bytes they hold afterwards.
        """
        return self._shards.close_idle(keep, room)

    def check_ids(self, index: int) -> None:
        """Check every id of a shard against the tokenizer's largest (``CorruptShardError`` if not).

        Args:
            index: the shard's position in the manifest.
        """
        self._shards.get(index).check_ids()

    def read_many(self, sample_ids: np.ndarray) -> list[np.ndarray]:
        """The ids of several sequences (copies), in the order given.

        Args:
            sample_ids: their global row numbers.

        Returns:
            One array per sequence.
        """
        got = self.gather(sample_ids)
        return np.split(got.tokens, got.offsets[1:-1])

    def read_masks(self, sample_ids: np.ndarray) -> list[np.ndarray]:
        """The loss masks of several sequences.

        Args:
            sample_ids: their global row numbers.

        Returns:
            One bool array per sequence (all True for plain-text caches).
        """
        got = self.gather(sample_ids, with_mask=True)
        assert got.mask is not None
        return np.split(got.mask, got.offsets[1:-1])

    def read_column(self, name: str, sample_ids: np.ndarray) -> list[np.ndarray]:
        """A per-token column's values of several sequences.

        Args:
            name: a ``TOKEN_COLUMNS`` name (``KeyError`` otherwise).
            sample_ids: their global row numbers.

        Returns:
            One array per sequence: the stored values, else the column's default (its
            ``trained`` value where the mask is set, its ``fill`` elsewhere).
        """
        got = self.gather(sample_ids, columns=(name,))
        return np.split(got.extras[name], got.offsets[1:-1])

    def read_weights(self, sample_ids: np.ndarray) -> list[np.ndarray]:
        """The loss weights of several sequences: ``read_column("weights", sample_ids)``.

        Args:
            sample_ids: their global row numbers.

        Returns:
            One float32 array per sequence: the stored weights (``has_weights``), else 1 where
            the mask is set and 0 elsewhere.
        """
        return self.read_column("weights", sample_ids)

    def lookup(self, sample_id: int) -> Provenance:
        """Where a sample id came from.

        Args:
            sample_id: its global row number (IndexError when out of range).

        Returns:
            Its input file, record index and piece index.
        """
        shard, row = self._locate(sample_id)
        record, piece = self._shards.get(shard).provenance(row)
        return Provenance(source_of_row(self.shards[shard], row), record, piece)

    def shard_provenance(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """The record and piece index of every row of one shard.

        Args:
            index: the shard's position in the manifest.

        Returns:
            ``(records, pieces)``, int64, one per row.
        """
        return self._shards.get(index).provenance_all()

    @property
    def content_keys(self) -> np.ndarray | None:
        """The content key of every sample id's document; None in a cache built before them.

        A 64-bit hash of the document's whole text (a conversation's or a pair's canonical
        JSON), stored at build time in ``index/content_keys.npy`` (checked against the
        manifest's sha256 when first used): the pieces of a document and the two sides of a
        pair share it, and equal documents have equal keys wherever their files are.

        Raises:
            CorruptShardError: the file is damaged or disagrees with the manifest.
        """
        if self._content_keys is not None or "content_keys" not in self.manifest["index"]:
            return self._content_keys
        entry = self.manifest["index"]["content_keys"]
        path = (
            self.remote.index_path("content_keys")
            if self.remote is not None
            else cache_path(self.path, CONTENT_KEYS_FILE)
        )
        check_file(path, entry, "content key index")
        try:
            keys = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as err:
            raise CorruptShardError(
                f"{path}: cannot read the content key index ({err}); rebuild the cache"
            ) from err
        if keys.dtype != np.uint64 or keys.shape != (self.num_sequences,):
            raise CorruptShardError(
                f"{path}: content keys of dtype {keys.dtype} and shape {keys.shape}, expected "
                f"{self.num_sequences} uint64; the cache is damaged: rebuild it"
            )
        self._content_keys = keys.view(np.ndarray)
        return self._content_keys

    def document_keys(self, key: str = "content") -> np.ndarray:
        """A 64-bit key of every sample id's document, the identity held-out splits draw.

        ``"content"``: the stored ``content_keys`` (no shard is read); a cache built before
        them has only its path keys, given instead (``content_keys`` is None there).
        ``"path"``: a hash of the document's input file and record index, which reads the
        record column of every shard. Either way every piece of a document cut by
        ``truncation="split"`` has its document's key, and a rebuild of the same inputs with
        other shard sizes, workers or bucket edges gives each document the same key; only
        content keys stay the same when input files are renamed, re-cut or duplicated.

        Args:
            key: ``"content"`` or ``"path"``.

        Returns:
            uint64, one per sample id.

        Raises:
            ConfigError: another ``key``.
        """
        if key not in ("content", "path"):
            raise ConfigError(f"document_keys: key={key!r}, expected 'content' or 'path'")
        if key == "content" and self.content_keys is not None:
            return self.content_keys
        keys = np.empty(self.num_sequences, dtype=np.uint64)
        for index, info in enumerate(self.shards):
            records = self._shards.get(index).records()
            runs = shard_runs(info)
            files = np.repeat(
                np.array([path_key(source) for source, _ in runs], dtype=np.uint64),
                [rows for _, rows in runs],
            )
            lo = int(self.shard_starts[index])
            keys[lo : lo + len(records)] = mix64(files ^ mix64(records.astype(np.uint64)))
        return keys

    def iter_sequences(self) -> Iterator[Sequence]:
        """Every sequence in sample-id order.

        Yields:
            Each sequence with its provenance (and mask for chat caches).
        """
        sample_id = 0
        for index, info in enumerate(self.shards):
            reader = self._shards.get(index)
            runs = iter(shard_runs(info))
            source, left = "", 0
            for row, (ids, record, piece) in enumerate(reader.iter_rows()):
                while not left:
                    source, left = next(runs)
                left -= 1
                mask = reader.masks_many([row])[0] if reader.has_mask else None
                yield Sequence(sample_id, ids, Provenance(source, record, piece), mask)
                sample_id += 1


def path_key(path: str) -> int:
    """A 64-bit key of an input file's relative path (its sha256, first 16 hex digits)."""
    return int(sha256_text(path)[:16], 16)


def mix64(values: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser of uint64 values: well-mixed 64-bit hashes, vectorised."""
    with np.errstate(over="ignore"):
        z = np.asarray(values, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def shard_runs(info: dict[str, Any]) -> list[tuple[str, int]]:
    """``(input file, rows)`` runs of a shard's rows, merged shard or not."""
    runs = info.get("sources")
    if runs is None:
        return [(str(info["source"]), int(info["rows"]))]
    return [(str(run["source"]), int(run["rows"])) for run in runs]


def source_of_row(info: dict[str, Any], row: int) -> str:
    """The input file of one row of a shard (IndexError past its rows)."""
    for source, rows in shard_runs(info):
        if row < rows:
            return source
        row -= rows
    raise IndexError(f"row beyond the {info['rows']} rows of shard {info['name']}")


def open_cache(path: str | os.PathLike[str]) -> Cache:
    """Open a committed cache folder or URL (downloads checked against the manifest's sha256).

    Args:
        path: the cache folder or URL.

    Returns:
        The open [`Cache`][shardcache.Cache] (a context manager).

    Raises:
        CacheNotFoundError: no committed cache there.
        CorruptShardError: the manifest or the length index is damaged.
    """
    return Cache(os.fspath(path))
