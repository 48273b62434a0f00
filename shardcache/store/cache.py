"""Read access to a committed cache: :func:`open_cache` -> :class:`Cache`.

A :class:`Cache` holds the manifest, the memory-mapped length index and an LRU of open
shards. Sample ids are global row numbers (shards in manifest order); everything a reader
needs to plan an epoch (lengths, buckets) is available without opening a shard, so opening a
cache of thousands of shards costs one JSON parse and one ``np.load(mmap_mode="r")``.
"""

from __future__ import annotations

import bisect
import contextlib
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardcache.errors import CorruptShardError
from shardcache.store.layout import LENGTHS_FILE, cache_path, shard_path
from shardcache.store.manifest import read_manifest
from shardcache.store.remote import RemoteCache, is_url
from shardcache.store.shards import ShardReader

#: ``fetch(shard entry) -> (local path, release)``: where a shard's bytes are, and what to call
#: once the reader no longer needs them (a remote cache keeps its lock on the file until then).
Fetch = Callable[[dict[str, Any]], tuple[str, Callable[[], None]]]


def _no_release() -> None:
    return None


class ShardCache:
    """A small LRU of open :class:`~shardcache.store.shards.ShardReader` s.

    One class for local and remote caches: ``fetch`` says where a shard's file is (a local
    cache joins its folder and the name; a remote one downloads into the local object store
    and holds a shared lock on the file), and the release it returns is called when the
    shard leaves the LRU.
    """

    def __init__(self, shards: list[dict[str, Any]], dtype: np.dtype, size: int, fetch: Fetch):
        self.shards = shards
        self.dtype = dtype
        self.size = max(1, size)
        self.fetch = fetch
        self._open: OrderedDict[int, tuple[ShardReader, Callable[[], None]]] = OrderedDict()

    def get(self, index: int) -> ShardReader:
        entry = self._open.get(index)
        if entry is not None:
            self._open.move_to_end(index)
            return entry[0]
        info = self.shards[index]
        path, release = self.fetch(info)
        try:
            reader = ShardReader(path, info, self.dtype)
        except BaseException:
            release()
            raise
        self._open[index] = (reader, release)
        if len(self._open) > self.size:
            _, (_, old_release) = self._open.popitem(last=False)
            old_release()
        return reader

    def shed(self) -> bool:
        """Release the least recently used open shard (False when none is open): the local
        shard cache of a remote cache asks for this when open shards leave no room."""
        if not self._open:
            return False
        _, (_, release) = self._open.popitem(last=False)
        release()
        return True

    def close(self) -> None:
        """Release every open shard."""
        while self._open:
            _, (_, release) = self._open.popitem(last=False)
            with contextlib.suppress(Exception):
                release()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


@dataclass(frozen=True)
class Provenance:
    """Where a sequence came from: input file (relative path), record index, piece index."""

    source: str
    record: int
    piece: int


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
        try:
            self.lengths: np.ndarray = np.load(lengths_path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as err:
            raise CorruptShardError(
                f"{lengths_path}: cannot read the length index ({err}); rebuild the cache"
            ) from err
        if len(self.lengths) != int(self.shard_starts[-1]):
            raise CorruptShardError(
                f"{lengths_path}: {len(self.lengths)} lengths but the shards hold "
                f"{int(self.shard_starts[-1])} rows; the cache is damaged, rebuild it"
            )
        self._starts_list: list[int] = self.shard_starts.tolist()
        fetch: Fetch = (
            remote.fetch_shard
            if remote is not None
            else lambda info: (shard_path(self.path, info["name"]), _no_release)
        )
        self._shards = ShardCache(self.shards, self.dtype, open_shards, fetch)
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

    def read_many(self, sample_ids: np.ndarray) -> list[np.ndarray]:
        """The ids of several sequences, in the order given (read-only views when possible).

        Locates with ``bisect`` on Python lists (~1 us a sequence, against ~5 us for
        :meth:`read`, whose scalar numpy calls dominate for short sequences).
        """
        return [self._shards.get(s).tokens_many([row])[0] for s, row in self._rows(sample_ids)]

    def _rows(self, sample_ids: np.ndarray) -> list[tuple[int, int]]:
        """(shard index, row in shard) of each sample id, located with ``bisect``."""
        starts = self._starts_list
        out = []
        for sample_id in np.asarray(sample_ids, dtype=np.int64).tolist():
            if not 0 <= sample_id < self.num_sequences:
                raise IndexError(
                    f"sample id {sample_id} out of range: the cache holds {self.num_sequences}"
                )
            shard = bisect.bisect_right(starts, sample_id) - 1
            out.append((shard, sample_id - starts[shard]))
        return out

    @property
    def has_mask(self) -> bool:
        """True for chat caches, whose shards store a loss mask per token."""
        return self.manifest.get("kind") == "chat"

    def read_masks(self, sample_ids: np.ndarray) -> list[np.ndarray]:
        """The loss masks of several sequences (all True for plain-text caches)."""
        return [self._shards.get(s).masks_many([row])[0] for s, row in self._rows(sample_ids)]

    def lookup(self, sample_id: int) -> Provenance:
        """The input file, record index and piece index a sample id came from."""
        shard, row = self._locate(sample_id)
        record, piece = self._shards.get(shard).provenance(row)
        return Provenance(self.shards[shard]["source"], record, piece)

    def iter_sequences(self) -> Iterator[Sequence]:
        """Every sequence in sample-id order, with provenance (one shard open at a time)."""
        sample_id = 0
        for index, info in enumerate(self.shards):
            reader = self._shards.get(index)
            for row, (ids, record, piece) in enumerate(reader.iter_rows()):
                mask = reader.masks_many([row])[0] if reader.has_mask else None
                yield Sequence(sample_id, ids, Provenance(info["source"], record, piece), mask)
                sample_id += 1


def open_cache(path: str | os.PathLike[str]) -> Cache:
    """Open a committed cache directory or URL (CacheNotFoundError if there is none).

    A URL (``s3://bucket/prefix``) reads through the local shard cache of
    :mod:`shardcache.store.remote` (downloads checked against the manifest's sha256)."""
    return Cache(os.fspath(path))
