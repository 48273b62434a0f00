"""Read access to a committed cache: :func:`open_cache` -> :class:`Cache`.

A :class:`Cache` holds the manifest, the memory-mapped length index and an LRU of open
shards. Sample ids are global row numbers (shards in manifest order); everything a reader
needs to plan an epoch (lengths, buckets) is available without opening a shard, so opening a
cache of thousands of shards costs one JSON parse and one ``np.load(mmap_mode="r")`` (plus,
once per index version for all processes, its sha256: store/integrity.py).

Reads are vectorised (:meth:`Cache.gather`): the segments of a batch are located with one
``searchsorted``, grouped by shard, and each shard touched costs one gather and one scatter
(memory-mapped shards: over the whole mapped file, :meth:`ShardReader.flat_rows`; compressed
ones: per decoded record batch), or one slice copy when its segments are contiguous. There is
no Python work per sequence; the previous per-sequence reads cost ~4.9 us each.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardcache.errors import CorruptShardError
from shardcache.store import shards as shard_files
from shardcache.store.integrity import check_file
from shardcache.store.layout import LENGTHS_FILE, cache_path, shard_path
from shardcache.store.manifest import read_manifest
from shardcache.store.prefault import prefault
from shardcache.store.remote import RemoteCache, is_url
from shardcache.store.shards import FlatRows, ShardReader, flat_ranges

#: ``fetch(shard entry) -> (local path, release)``: where a shard's bytes are, and what to call
#: once the reader no longer needs them (a remote cache keeps its lock on the file until then).
Fetch = Callable[[dict[str, Any]], tuple[str, Callable[[], None]]]


def _no_release() -> None:
    return None


def _forget_in(arrays: dict[int, np.ndarray], addresses: np.ndarray) -> Callable[[int], None]:
    """``on_close`` of a :class:`ShardCache`: drop a closed shard's entry from ``arrays`` and
    its address from ``addresses`` (a closure over them, not the cache: no reference cycle)."""

    def forget(index: int) -> None:
        arrays.pop(index, None)
        addresses[index] = 0

    return forget


class ShardCache:
    """A small LRU of open :class:`~shardcache.store.shards.ShardReader` s.

    One class for local and remote caches: ``fetch`` says where a shard's file is (a local
    cache joins its folder and the name; a remote one downloads into the local object store
    and holds a shared lock on the file), and the release it returns is called when the
    shard leaves the LRU.
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
        self._open: OrderedDict[int, tuple[ShardReader, Callable[[], None]]] = OrderedDict()

    def get(self, index: int) -> ShardReader:
        entry = self._open.get(index)
        if entry is not None:
            self._open.move_to_end(index)
            return entry[0]
        info = self.shards[index]
        path, release = self.fetch(info)
        try:
            reader = ShardReader(path, info, self.dtype, **self.reader_options)
        except BaseException:
            release()
            raise
        self._open[index] = (reader, release)
        if len(self._open) > self.size:
            old_index, (old, old_release) = self._open.popitem(last=False)
            self._closed(old_index)
            old.close()
            old_release()
        return reader

    def touch(self, index: int) -> None:
        """Mark an open shard as the most recently used."""
        if index in self._open:
            self._open.move_to_end(index)

    def close_next(self, index: int) -> None:
        """Mark an open shard as the least recently used: the next one closed for room."""
        if index in self._open:
            self._open.move_to_end(index, last=False)

    def _closed(self, index: int) -> None:
        if self.on_close is not None:
            self.on_close(index)

    def shed(self) -> bool:
        """Release the least recently used open shard (False when none is open): the local
        shard cache of a remote cache asks for this when open shards leave no room."""
        if not self._open:
            return False
        index, (_, release) = self._open.popitem(last=False)
        self._closed(index)
        release()
        return True

    def close(self) -> None:
        """Release every open shard."""
        while self._open:
            index, (reader, release) = self._open.popitem(last=False)
            self._closed(index)
            with contextlib.suppress(Exception):
                reader.close()
                release()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


@dataclass(frozen=True)
class Gathered:
    """Segments read by :meth:`Cache.gather`: ``tokens`` (the cache dtype) concatenated,
    ``offsets`` (int64, ``len + 1``) cutting them, ``mask`` (bool per token) when asked."""

    tokens: np.ndarray
    offsets: np.ndarray
    mask: np.ndarray | None = None

    @property
    def lengths(self) -> np.ndarray:
        return self.offsets[1:] - self.offsets[:-1]  # np.diff costs ~5 us of Python a call


@dataclass(frozen=True)
class MappedTable:
    """Every memory-mapped shard of a cache by address, for a compiled reader
    (:meth:`Cache.mapped_table`; ``shardcache.read.kernels`` copies straight from the files).

    Shard ``s`` holds sample ids ``shard_starts[s] : shard_starts[s + 1]``; while it is open its
    tokens (``dtype``) are the ``sizes[s]`` values at address ``addresses[s]`` (0: not open,
    :meth:`Cache.open_mapped` opens it). Sample ``i`` starts at value ``file_starts[i]`` of its
    shard (filled when the shard is first opened) and holds ``lengths[i]`` tokens (the length
    index, checked against the shard then); in a chat cache its loss mask is ``lengths[i]``
    bits from bit ``mask_starts[i]`` of the same file. A reader advances ``clock[0]`` once
    per batch and records ``last_used[s] = clock[0]`` for every shard it reads (when the LRU
    must close a shard for a new one, it closes the least recently stamped), and it refuses
    any id above ``max_id``: the store has not checked the ids of these files, the reader
    checks those it copies. An address is valid until the next :meth:`Cache.open_mapped` or
    close, so a reader must not let Python code run between reading an address and copying
    from it.
    """

    addresses: np.ndarray  # int64, one per shard
    sizes: np.ndarray  # int64, one per shard
    last_used: np.ndarray  # int64, one per shard
    clock: np.ndarray  # int64, one: the current stamp
    shard_starts: np.ndarray  # int64, one per shard + 1
    file_starts: np.ndarray  # uint32 or int64, one per sample
    lengths: np.ndarray  # the length index, one per sample
    dtype: np.dtype
    max_id: int
    #: chat caches: per sample the bit position of its first loss-mask bit in its shard's
    #: file (filled with file_starts; the bits are at the same address); empty otherwise
    mask_starts: np.ndarray  # int64


@dataclass(frozen=True)
class Provenance:
    """Where a sequence came from: input file (relative path), record index, piece index."""

    source: str
    record: int  # 0-based, as stored
    piece: int

    @property
    def line(self) -> int:
        """The 1-based line (jsonl) or row (parquet) of the record, as people count."""
        return self.record + 1


@dataclass(frozen=True)
class Sequence:
    """One stored sequence with its sample id and provenance."""

    sample_id: int
    ids: np.ndarray
    provenance: Provenance
    #: bool per token, True where the token has a loss (chat data); None for plain text
    mask: np.ndarray | None = None


class Cache:
    """A committed cache directory. Use :func:`open_cache` to make one."""

    def __init__(self, path: str, open_shards: int = 8):
        self.path = os.fspath(path)
        # a URL: manifest and index downloaded, shards on demand into the local object store
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
        # the index decides batch shapes and is trusted by every read: checked against the
        # manifest like a shard (sha256 once per file version, store/integrity.py)
        entry = self.manifest.get("index", {}).get("lengths")
        if isinstance(entry, dict):
            check_file(lengths_path, entry, "length index")
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
        # the index as a plain ndarray over the same map: indexing a np.memmap subclass costs
        # a Python __getitem__ per call
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
        max_id = self.manifest.get("tokenizer", {}).get("max_token_id")
        #: the largest id a shard may hold (the tokenizer's; unknown: any)
        self._max_id = np.iinfo(np.int64).max if max_id is None else int(max_id)
        options = {
            "max_token_id": None if max_id is None else int(max_id),
            "with_mask": self.has_mask,
        }
        # memory-mapped shards already checked against the index, and their rows' starts in
        # their token arrays (filled as shards are first read: _flat_tokens); the token
        # arrays of the open ones, dropped when the LRU closes them
        self._flat_seen = np.zeros(len(self.shards), dtype=bool)
        # ... and those whose every id was checked against max_token_id (MappedTable readers
        # check the ids they copy instead)
        self._ids_checked = np.zeros(len(self.shards), dtype=bool)
        self._file_starts: np.ndarray | None = None
        self._mask_starts = np.zeros(self.num_sequences if self.has_mask else 0, dtype=np.int64)
        self._flat_open: dict[int, np.ndarray] = {}
        # the open ones' token arrays by address and size (MappedTable; 0 = not open)
        self._flat_addresses = np.zeros(len(self.shards), dtype=np.int64)
        self._flat_sizes = np.zeros(len(self.shards), dtype=np.int64)
        self._table: MappedTable | None = None
        self._shards = ShardCache(
            self.shards,
            self.dtype,
            open_shards,
            fetch,
            options,
            _forget_in(self._flat_open, self._flat_addresses),
        )
        if remote is not None:
            remote.shed = self._shards.shed

    def __repr__(self) -> str:
        return (
            f"Cache({self.path!r}, sequences={self.num_sequences}, tokens={self.num_tokens}, "
            f"shards={len(self.shards)})"
        )

    @property
    def num_sequences(self) -> int:
        return int(self.shard_starts[-1])

    @property
    def num_tokens(self) -> int:
        return int(self.manifest["totals"]["tokens"])

    @property
    def pad_id(self) -> int:
        return int(self.manifest["tokenizer"]["pad_id"])

    def buckets(self) -> np.ndarray:
        """Bucket index of every sample id (int32), derived from the shard table."""
        return np.repeat(self.shard_buckets, np.diff(self.shard_starts))

    def _locate(self, sample_id: int) -> tuple[int, int]:
        if not 0 <= sample_id < self.num_sequences:
            raise IndexError(
                f"sample id {sample_id} out of range: the cache holds {self.num_sequences}"
            )
        shard = int(np.searchsorted(self.shard_starts, sample_id, side="right")) - 1
        return shard, sample_id - int(self.shard_starts[shard])

    def read(self, sample_id: int) -> np.ndarray:
        """The ids of one sequence (read-only; a view into the mapped shard when possible)."""
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
    ) -> Gathered:
        """The tokens of several segments, concatenated in the order given.

        Segment ``k`` is tokens ``starts[k] : starts[k] + lengths[k]`` of sequence
        ``sample_ids[k]`` (``starts`` default 0, ``lengths`` default the rest of the sequence,
        from the length index). Vectorised: one ``searchsorted`` locates every segment, and
        each shard (and record batch) touched costs one index computation and one copy, so
        the cost is per shard touched plus per token, not per sequence. ``with_mask`` also
        gathers the loss masks (all True for plain-text caches). ``dtype`` (default the
        stored token type) is the type of the returned tokens: the copy casts, so a reader
        that delivers int32 or int64 ids pays no second pass. ``layout = (dst, size)`` places
        segment ``k`` at ``dst[k]`` of a ``size``-token array instead, the rest ``fill``
        (masks False): the padded rows of a batch without a second copy (the caller keeps
        segments apart; ``Gathered.offsets`` still cut the segments' lengths compactly).
        Every sequence read is checked against the length index (``CorruptShardError`` when
        they disagree).
        """
        ids = np.asarray(sample_ids, dtype=np.int64)
        n = len(ids)
        if n and (int(ids.min()) < 0 or int(ids.max()) >= self.num_sequences):
            bad = int(ids[(ids < 0) | (ids >= self.num_sequences)][0])
            raise IndexError(f"sample id {bad} out of range: the cache holds {self.num_sequences}")
        full = self._lengths_plain[ids].astype(np.int64)
        first = np.zeros(n, dtype=np.int64) if starts is None else np.asarray(starts, np.int64)
        take = full - first if lengths is None else np.asarray(lengths, dtype=np.int64)
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(take, out=offsets[1:])
        out_dtype = self.dtype if dtype is None else dtype
        if layout is None:
            tokens = np.empty(int(offsets[-1]), dtype=out_dtype)
            mask = np.empty(len(tokens), dtype=bool) if with_mask else None
            dst_starts = offsets
        else:
            dst_starts, size = np.asarray(layout[0], dtype=np.int64), int(layout[1])
            if len(dst_starts) != n or (
                n and (dst_starts.min() < 0 or (dst_starts + take).max() > size)
            ):
                raise IndexError(f"{self.path}: layout: segments fall outside the {size} slots")
            tokens = np.full(size, fill, dtype=out_dtype)
            mask = np.zeros(size, dtype=bool) if with_mask else None
        shard = np.searchsorted(self.shard_starts, ids, side="right") - 1
        if not with_mask and self._copy_runs(shard, ids, first, take, full, dst_starts, tokens):
            return Gathered(tokens, offsets, mask)
        rows = ids - self.shard_starts[shard]
        # segments grouped by shard (stable: in order inside a shard); group g is
        # order[bounds[g]:bounds[g + 1]]
        order = np.argsort(shard, kind="stable")
        sorted_shards = shard[order]
        cuts = np.flatnonzero(sorted_shards[1:] != sorted_shards[:-1]) + 1
        bounds = np.concatenate(([0], cuts, [n])).tolist()
        if not n:
            return Gathered(tokens, offsets, mask)
        # memory-mapped shards: every segment's source position in its shard's token array,
        # then one gather + one scatter per shard over precomputed index runs
        # (the shards' row starts are in the cache's table, their lengths checked against the
        # length index when each was first opened: _record_flat)
        starts_in_file = np.zeros(n, dtype=np.int64)
        flats: list[tuple[int, int, Any]] = []
        for lo, hi in itertools.pairwise(bounds):
            index = int(sorted_shards[lo])
            arrays = None if with_mask else self._flat_tokens([index])
            sel = order[lo:hi]
            if arrays is None:  # compressed (or masks asked): per record batch
                reader = self._shards.get(index)
                reader.gather_into(
                    rows[sel], first[sel], take[sel], dst_starts[sel], tokens, mask, full[sel]
                )
                continue
            starts_in_file[lo:hi] = self._starts_table()[ids[sel]]
            flats.append((lo, hi, arrays[index]))
        if not flats:
            return Gathered(tokens, offsets, mask)
        first_s, take_s = first[order], take[order]
        if np.any(first_s < 0) or np.any(first_s + take_s > full[order]):
            raise IndexError(f"{self.path}: a segment reaches past the end of its sequence")
        ends = np.cumsum(take_s)
        seg_src = starts_in_file + first_s
        seg_dst = dst_starts[:n][order]
        # a shard's segments that follow each other in the file (runs of one document,
        # unshuffled reads) or in the output (one shard per batch) need no index there
        step = take_s[:-1]
        src_breaks = np.concatenate(([0], np.cumsum(seg_src[1:] != seg_src[:-1] + step)))
        dst_breaks = np.concatenate(([0], np.cumsum(seg_dst[1:] != seg_dst[:-1] + step)))
        src = dst = None
        for lo, hi, flat_tokens in flats:
            a, b = (int(ends[lo - 1]) if lo else 0), int(ends[hi - 1])
            if src_breaks[hi - 1] == src_breaks[lo]:
                source = flat_tokens[int(seg_src[lo]) : int(seg_src[lo]) + b - a]
            else:
                if src is None:
                    src = flat_ranges(seg_src, take_s)
                source = flat_tokens[src[a:b]]
            if dst_breaks[hi - 1] == dst_breaks[lo]:
                tokens[int(seg_dst[lo]) : int(seg_dst[lo]) + b - a] = source
            else:
                if dst is None:
                    dst = flat_ranges(seg_dst, take_s)
                tokens[dst[a:b]] = source
        return Gathered(tokens, offsets, mask)

    def _flat_tokens(
        self, shards: Iterable[int], check_ids: bool = True
    ) -> dict[int, np.ndarray] | None:
        """The token arrays of memory-mapped shards (``None`` when one is compressed).

        The first time this cache sees a shard, its rows' stored lengths are compared with the
        length index in one vectorised check (``CorruptShardError`` when they disagree) and
        its rows' starts in the shard's token array are recorded in :attr:`_file_starts`, so a
        later read locates any segment with one fancy index and checks nothing per segment.
        """
        # a dict of this call's own: opening one shard may evict another of the same batch
        # from the LRU (its entry leaves _flat_open), yet its array stays valid while held
        arrays: dict[int, np.ndarray] = {}
        for index in shards:
            tokens = self._flat_open.get(index)
            if tokens is not None and (self._ids_checked[index] or not check_ids):
                self._shards.touch(index)  # open and checked: only marked as recently used
                arrays[index] = tokens
                continue
            reader = self._shards.get(index)
            flat = reader.flat_rows(check_ids)
            if flat is None:
                return None
            self._ids_checked[index] |= check_ids
            if not self._flat_seen[index]:
                self._record_flat(index, flat, reader)
            arrays[index] = self._flat_open[index] = flat.tokens
            self._flat_addresses[index] = flat.tokens.__array_interface__["data"][0]
            self._flat_sizes[index] = len(flat.tokens)
            if tokens is None:  # newly mapped (prefault.py: a no-op unless turned on)
                prefault(flat.tokens)
        return arrays

    def mapped_table(self) -> MappedTable | None:
        """The table of memory-mapped shards for compiled readers (None for a compressed
        cache). The same object for the cache's life; its arrays change as shards open and
        close."""
        layout = (self.manifest.get("options") or {}).get("layout") or {}
        if layout.get("compression", "none") != "none":
            return None  # (a cache resumed under another compression: open_mapped says so)
        if self._table is None:
            self._table = MappedTable(
                self._flat_addresses,
                self._flat_sizes,
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
        """Open shard ``index`` for :meth:`mapped_table` readers (checked like any open, its
        ids left to the reader); False when it is compressed (read it through
        :meth:`gather`). The shard the LRU closes for it is the least recently stamped one."""
        table = self.mapped_table()
        if table is not None and len(self._flat_open) >= self._shards.size:
            # the LRU closes the least recently stamped mapped shard (one argmin, not a sort)
            mapped = np.fromiter(self._flat_open, dtype=np.int64, count=len(self._flat_open))
            self._shards.close_next(int(mapped[np.argmin(table.last_used[mapped])]))
        arrays = self._flat_tokens([int(index)], check_ids=False)
        if arrays is None:
            return False
        if table is not None:
            table.last_used[index] = table.clock[0]  # used by the read that asked for it
        return True

    def _record_flat(self, index: int, flat: FlatRows, reader: ShardReader) -> None:
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
        self._flat_seen[index] = True

    def _starts_table(self) -> np.ndarray:
        """Every sample's start in its shard's token array (see :meth:`_record_flat`)."""
        if self._file_starts is None:
            # zero-filled pages cost no memory until a shard's rows are written into them;
            # 4 bytes a sequence when every shard file is under 4 G tokens (always, at the
            # default 64 MiB shards), else 8
            largest = max((int(info.get("bytes", 0)) for info in self.shards), default=0)
            small = largest // self.dtype.itemsize < 2**32
            kind = np.uint32 if small else np.int64
            self._file_starts = np.zeros(self.num_sequences, dtype=kind)
        return self._file_starts

    def _copy_runs(
        self,
        shard: np.ndarray,
        ids: np.ndarray,
        first: np.ndarray,
        take: np.ndarray,
        full: np.ndarray,
        dst: np.ndarray,
        tokens: np.ndarray,
    ) -> bool:
        """Memory-mapped shards, copied one slice per *run*: segments that follow each other
        in one shard's file and in the output (an unshuffled read, the pieces of one document)
        are one run, found with a few vectorised comparisons. A slice copy costs ~1 us, an
        index ~5 ns a token, so this is taken when runs average
        ``shards.LONG_SEGMENT_TOKENS`` tokens or more. False (nothing copied) otherwise, or
        when a shard is compressed: the caller takes the index or record-batch path."""
        n = len(ids)
        total = int(take.sum())
        if not n or total < shard_files.LONG_SEGMENT_TOKENS:
            return False
        arrays = self._flat_tokens(set(shard.tolist()))  # (np.unique costs ~15 us a call)
        if arrays is None:
            return False
        if np.any((first < 0) | (take < 0) | (first + take > full)):
            raise IndexError(f"{self.path}: a segment reaches past the end of its sequence")
        assert self._file_starts is not None
        source = self._file_starts[ids].astype(np.int64) + first
        dst = dst[:n]
        if n > 1:
            breaks = shard[1:] != shard[:-1]
            breaks |= source[1:] != source[:-1] + take[:-1]
            breaks |= dst[1:] != dst[:-1] + take[:-1]
            begin = np.flatnonzero(np.concatenate(([True], breaks)))
        else:
            begin = np.zeros(1, dtype=np.int64)
        if len(begin) * shard_files.LONG_SEGMENT_TOKENS > total:
            return False
        runs = np.add.reduceat(take, begin) if len(begin) < n else take
        for index, a, d, m in zip(
            shard[begin].tolist(), source[begin].tolist(), dst[begin].tolist(), runs.tolist()
        ):
            tokens[d : d + m] = arrays[index][a : a + m]
        return True

    def read_many(self, sample_ids: np.ndarray) -> list[np.ndarray]:
        """The ids of several sequences, in the order given (copies; see :meth:`gather`)."""
        got = self.gather(sample_ids)
        return np.split(got.tokens, got.offsets[1:-1])

    @property
    def has_mask(self) -> bool:
        """True for chat caches, whose shards store a loss mask per token."""
        return self.manifest.get("kind") == "chat"

    def read_masks(self, sample_ids: np.ndarray) -> list[np.ndarray]:
        """The loss masks of several sequences (all True for plain-text caches)."""
        got = self.gather(sample_ids, with_mask=True)
        assert got.mask is not None
        return np.split(got.mask, got.offsets[1:-1])

    def lookup(self, sample_id: int) -> Provenance:
        """The input file, record index and piece index a sample id came from."""
        shard, row = self._locate(sample_id)
        record, piece = self._shards.get(shard).provenance(row)
        return Provenance(source_of_row(self.shards[shard], row), record, piece)

    def iter_sequences(self) -> Iterator[Sequence]:
        """Every sequence in sample-id order, with provenance (one shard open at a time)."""
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


def shard_runs(info: dict[str, Any]) -> list[tuple[str, int]]:
    """``(input file, rows)`` in row order for the shard whose manifest entry is ``info``:
    its own ``source``, or a merged shard's ``sources``."""
    runs = info.get("sources")
    if runs is None:
        return [(str(info["source"]), int(info["rows"]))]
    return [(str(run["source"]), int(run["rows"])) for run in runs]


def source_of_row(info: dict[str, Any], row: int) -> str:
    """The input file of row ``row`` of the shard whose manifest entry is ``info``."""
    for source, rows in shard_runs(info):
        if row < rows:
            return source
        row -= rows
    raise IndexError(f"row beyond the {info['rows']} rows of shard {info['name']}")


def open_cache(path: str | os.PathLike[str]) -> Cache:
    """Open a committed cache directory or URL (CacheNotFoundError if there is none).

    A URL (``s3://bucket/prefix``) reads through the local shard cache of
    :mod:`shardcache.store.remote` (downloads checked against the manifest's sha256)."""
    return Cache(os.fspath(path))
