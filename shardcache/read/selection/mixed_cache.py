"""The caches of a mixture read as one: checks at open, one id space, gathers across sources.

Sources must share the tokenizer. For the compiled reader one ``MappedTable`` spans all
sources' shards, re-synced by every call that may open or close a shard: between calls it never
holds a closed shard's address. Plain-text sources mixed with chat ones get ``NO_MASK`` mask
starts; a compressed source, or mixed token types, give no table (batches go through numpy).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any

import numpy as np

from shardcache.errors import CacheKeyMismatch
from shardcache.read.selection.mixture import MixtureIndex, Source
from shardcache.read.selection.mixture_table import MixtureTable, once_table, solve_mixture
from shardcache.store.cache import NO_MASK, Cache, Gathered, MappedTable
from shardcache.store.columns import TOKEN_COLUMNS, ordered
from shardcache.store.files import cache_root, private_tmp, sha256_text
from shardcache.store.key import CacheKey, compare, verify_manifest_key
from shardcache.store.remote import is_url
from shardcache.store.shards import flat_ranges

#: The cache-key components that say what ids mean: they must be equal in every source.
TOKENIZER_COMPONENTS = ("tokenizer", "special_tokens", "behaviour")
#: Behaviour probes rendered through the chat template (a chat build has one, a plain-text
#: build none): the template may differ between sources, so they are not compared.
TEMPLATE_PROBES = ("chat",)


def _tokenizer_key(cache: Cache) -> CacheKey:
    """The part of ``cache``'s key all sources must share (chat-template probes left out)."""
    key = cache.manifest.get("key") or {}
    components = dict(key.get("components") or {})
    if not components:  # a cache without a key: what its manifest records of the tokenizer
        components = {"tokenizer": cache.manifest.get("tokenizer")}
    behaviour = components.get("behaviour")
    if isinstance(behaviour, dict) and isinstance(behaviour.get("ids"), dict):
        ids = behaviour["ids"]
        components["behaviour"] = {
            "ids": {k: v for k, v in ids.items() if k not in TEMPLATE_PROBES}
        }
    return CacheKey({name: components.get(name) for name in TOKENIZER_COMPONENTS})


def check_same_tokenizer(sources: tuple[Source, ...], caches: list[Cache]) -> None:
    """Raise ``CacheKeyMismatch`` unless all sources share the first's tokenizer and pad id."""
    first = _tokenizer_key(caches[0])
    skip = tuple(n for n in ("template", "truncation", "data", "versions"))
    for source, cache in zip(sources[1:], caches[1:]):
        comparison = compare(first, _tokenizer_key(cache), skip=skip)
        changed = [d for d in comparison.differences if d.severity == "changed"]
        if cache.pad_id != caches[0].pad_id and not changed:
            changed = []
            message = f"  changed  pad_id: {caches[0].pad_id} -> {cache.pad_id}"
        elif changed:
            message = comparison.describe()
        else:
            continue
        raise CacheKeyMismatch(
            f"mixture: source {source.label!r} ({source.path}) was built with another tokenizer "
            f"than source {sources[0].label!r} ({sources[0].path}); ids would mean different "
            f"tokens in one batch:\n{message}\nrebuild it with the same tokenizer (templates, "
            "truncation and data may differ), or train on the sources separately",
            [(d.component, d.field, d.old, d.new) for d in changed],
        )


def warn_repeated_caches(sources: tuple[Source, ...], caches: list[Cache]) -> None:
    """Warn when two sources are one cache (the same key digest, or the same path).

    Each of its documents then fills both sources' shares, about twice an epoch: rarely meant.
    """
    seen: dict[str, Source] = {}
    for source, cache in zip(sources, caches):
        digest = (cache.manifest.get("key") or {}).get("digest")
        where = cache.path.rstrip("/") if is_url(cache.path) else os.path.realpath(cache.path)
        identity = f"key {str(digest)[:16]}" if digest else f"path {where}"
        first = seen.setdefault(identity, source)
        if first is not source:
            warnings.warn(
                f"mixture: sources {first.label!r} ({first.path}) and {source.label!r} "
                f"({source.path}) are the same cache ({identity}); its "
                "documents fill both shares, each used about twice an epoch. Give it once with "
                "the two weights added, unless that is what you mean",
                UserWarning,
                stacklevel=4,
            )


#: Under the local cache folder: a mixture's length index, every source's in turn (memory-mapped).
MIXTURES_DIR = "mixtures"


def mixture_lengths(caches: list[Cache]) -> np.ndarray:
    """Every source's length index in turn, read-only: a memory map shared by the machine.

    Written once per machine under ``$SHARDCACHE_CACHE_DIR/mixtures`` (named by the sources'
    index digests), so a process holds only the pages it reads, as of one cache's index,
    instead of a copy of every source's in each process and DataLoader worker. In memory
    when the folder cannot be written.
    """
    kind = np.result_type(*(c.lengths.dtype for c in caches))
    count = sum(len(c.lengths) for c in caches)
    digests = "|".join(str(c.manifest["index"]["lengths"]["sha256"]) for c in caches)
    name = sha256_text(f"{digests}|{kind.str}|{count}")
    path = os.path.join(cache_root(), MIXTURES_DIR, f"{name}.lengths.npy")
    for again in (False, True):  # (a file cut short by a crash is written again)
        with contextlib.suppress(OSError, ValueError):
            if again or not os.path.exists(path):
                _write_lengths(path, caches, kind, count)
            mapped = np.load(path, mmap_mode="r", allow_pickle=False)
            if mapped.dtype == kind and mapped.shape == (count,):
                return mapped
    lengths = np.concatenate([np.asarray(c.lengths, dtype=kind) for c in caches])
    lengths.flags.writeable = False
    return lengths


def _write_lengths(path: str, caches: list[Cache], kind: np.dtype, count: int) -> None:
    """Every source's lengths in turn as one ``.npy``, whole (synced, renamed) or not at all."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = private_tmp(path)
    try:
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=kind, shape=(count,))
        at = 0
        for cache in caches:
            out[at : at + len(cache.lengths)] = cache.lengths
            at += len(cache.lengths)
        out.flush()
        del out
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


class MixedCache:
    """The caches of a mixture, read through one mixture id space."""

    def __init__(
        self, sources: tuple[Source, ...], expect: Any = None, open_shards: int = 8
    ) -> None:
        self.sources = sources
        self.caches = [Cache(s.path, open_shards=open_shards) for s in sources]
        for source, cache in zip(sources, self.caches):
            wanted = source.expect if source.expect is not None else expect
            if wanted is not None:
                verify_manifest_key(cache.manifest, wanted, source.path)
        check_same_tokenizer(sources, self.caches)
        warn_repeated_caches(sources, self.caches)
        self.index = MixtureIndex.of([c.num_sequences for c in self.caches])
        self.dtype = np.result_type(*(c.dtype for c in self.caches))
        self._lengths: np.ndarray | None = None
        self._table: MappedTable | None = None  # the combined table (mapped_table)
        self._tables: list[MappedTable] = []  # the sources' own
        self._shard_offsets = np.zeros(1, dtype=np.int64)  # source s: shards [o[s], o[s + 1])
        self._copied = np.zeros(0, dtype=bool)  # shards whose row starts are in the table

    def close(self) -> None:
        """Close every source (idempotent); zero the combined table's addresses for the kernels."""
        for cache in self.caches:
            cache.close()
        if self._table is not None:
            self._table.addresses[:] = 0
            self._table.sizes[:] = 0
        self._table, self._tables = None, []
        self._lengths = None

    @property
    def remote(self) -> bool:
        """Whether any source is a URL (object storage)."""
        return any(is_url(s.path) for s in self.sources)

    @property
    def pad_id(self) -> int:
        """The pad id, the same in every source."""
        return self.caches[0].pad_id

    @property
    def has_mask(self) -> bool:
        """True when any source is a chat cache (the others' tokens all have a loss)."""
        return any(c.has_mask for c in self.caches)

    @property
    def columns(self) -> tuple[str, ...]:
        """The per-token columns any source stores (the others read their defaults)."""
        return ordered(name for c in self.caches for name in c.columns)

    @property
    def num_sequences(self) -> int:
        """Sequences of all sources together."""
        return int(self.index.offsets[-1])

    @property
    def lengths(self) -> np.ndarray:
        """Every mixture id's length; read-only like a cache's index (the kernels' ``warm_up``)."""
        if self._lengths is None:
            self._lengths = mixture_lengths(self.caches)
        return self._lengths

    def buckets(self) -> np.ndarray:
        """Every mixture id's bucket (int32); unequal edges rebucket by the union of all edges."""
        edges = self._union_edges()
        if edges is None:
            return np.concatenate([c.buckets() for c in self.caches])
        return np.searchsorted(edges, self.lengths).astype(np.int32)

    def shard_buckets(self, source: int, shard: int, local: np.ndarray) -> np.ndarray:
        """The buckets (as ``buckets``) of sample ids ``local`` of one shard of one source."""
        edges = self._union_edges()
        cache = self.caches[source]
        if edges is None:  # (a shard is bucket-pure)
            return np.full(len(local), cache.shard_buckets[shard], dtype=np.int32)
        return np.searchsorted(edges, np.asarray(cache.lengths[local])).astype(np.int32)

    def _union_edges(self) -> np.ndarray | None:
        """The union of the sources' bucket edges where they differ (None: all equal)."""
        ranges = [c.manifest.get("buckets", {}).get("ranges") for c in self.caches]
        if all(r == ranges[0] for r in ranges):
            return None
        edges = sorted({int(high) for r in ranges for _, high in (r or []) if high is not None})
        return np.asarray(edges, dtype=np.int64)

    def table(
        self,
        tokens_per_epoch: int | None = None,
        rows: tuple[np.ndarray, ...] | None = None,
        side: str | None = None,
        once: bool = False,
    ) -> MixtureTable:
        """The per-source targets (``solve_mixture``) of the caches, or of side ``side``.

        ``rows[s]``: the local ids of source ``s``'s side; ``once``: the table of an evaluation
        pass (``once_table``). A preference cache's documents are its pairs (a side holds both
        rows of a pair), each counting both sides' tokens.
        """
        if rows is None:
            documents = [c.num_sequences // (2 if c.is_preference else 1) for c in self.caches]
            # (the shards' token counts sum the length index: O(shards), nothing read)
            tokens = [sum(int(i["tokens"]) for i in c.shards) for c in self.caches]
        else:
            documents = [len(r) // (2 if c.is_preference else 1) for c, r in zip(self.caches, rows)]
            tokens = [
                int(np.sum(np.asarray(c.lengths)[r], dtype=np.int64))
                for c, r in zip(self.caches, rows)
            ]
        if once:
            return once_table(self.sources, documents, tokens)
        return solve_mixture(self.sources, documents, tokens, tokens_per_epoch, side)

    def mapped_table(self) -> MappedTable | None:
        """The combined table over all sources' shards (one object), or None: use numpy."""
        if self._table is not None:
            return self._table
        narrow = all(c.starts_dtype() == np.uint32 for c in self.caches)
        file_starts = np.zeros(self.num_sequences, dtype=np.uint32 if narrow else np.int64)
        for s, cache in enumerate(self.caches):  # (one table: the sources record into theirs)
            cache.adopt_starts(file_starts[self.index.offsets[s] : self.index.offsets[s + 1]])
        tables = [c.mapped_table() for c in self.caches]
        if any(t is None for t in tables):
            return None
        full = [t for t in tables if t is not None]
        if len({t.dtype for t in full}) != 1:
            return None
        counts = np.array([len(t.addresses) for t in full], dtype=np.int64)
        self._shard_offsets = np.zeros(len(full) + 1, dtype=np.int64)
        np.cumsum(counts, out=self._shard_offsets[1:])
        shards = int(self._shard_offsets[-1])
        starts = [t.shard_starts[:-1] + self.index.offsets[s] for s, t in enumerate(full)]
        shard_starts = np.concatenate([*starts, self.index.offsets[-1:]]).astype(np.int64)
        if not all(t.file_starts.dtype == file_starts.dtype for t in full):
            file_starts = np.zeros(self.num_sequences, dtype=np.int64)
        samples = self.num_sequences
        self._tables = full
        self._copied = np.zeros(shards, dtype=bool)
        self._table = MappedTable(
            np.zeros(shards, dtype=np.int64),
            np.zeros(shards, dtype=np.int64),
            np.zeros(shards, dtype=np.int64),
            np.ones(1, dtype=np.int64),
            shard_starts,
            file_starts,
            self.lengths,
            full[0].dtype,
            min(t.max_id for t in full),
            np.full(samples if self.has_mask else 0, NO_MASK, dtype=np.int64),
        )
        for s in range(len(full)):
            self._sync(s)
        return self._table

    def _sync(self, source: int) -> None:
        """Copy a source's open shards into the combined table; a shard's row starts only once."""
        table, own = self._table, self._tables[source]
        assert table is not None
        lo, hi = int(self._shard_offsets[source]), int(self._shard_offsets[source + 1])
        table.addresses[lo:hi] = own.addresses
        table.sizes[lo:hi] = own.sizes
        new = np.flatnonzero((own.addresses != 0) & ~self._copied[lo:hi])
        base = int(self.index.offsets[source])
        for shard in new.tolist():
            a, b = int(own.shard_starts[shard]), int(own.shard_starts[shard + 1])
            table.file_starts[base + a : base + b] = own.file_starts[a:b]
            if len(own.mask_starts):  # (a plain-text source's stay NO_MASK)
                table.mask_starts[base + a : base + b] = own.mask_starts[a:b]
            self._copied[lo + shard] = True

    def open_mapped(self, index: int) -> bool:
        """Open shard ``index`` via its source (LRU stamps synced first); False: use ``gather``."""
        table = self.mapped_table()
        if table is None:
            return False
        source = int(np.searchsorted(self._shard_offsets, index, side="right")) - 1
        lo, hi = int(self._shard_offsets[source]), int(self._shard_offsets[source + 1])
        own = self._tables[source]
        own.last_used[:] = table.last_used[lo:hi]  # the compiled reader stamps the combined one
        own.clock[0] = table.clock[0]
        opened = self.caches[source].open_mapped(int(index) - lo)
        self._sync(source)
        table.last_used[index] = table.clock[0]
        return opened

    def check_ids(self, index: int) -> None:
        """Check every id of shard ``index`` of the combined table (``Cache.check_ids``)."""
        source = int(np.searchsorted(self._shard_offsets, index, side="right")) - 1
        self.caches[source].check_ids(int(index) - int(self._shard_offsets[source]))

    def close_idle(self, keep: list[set[int] | None], room: int) -> int:
        """``Cache.close_idle`` over the sources (``keep[s]`` None: leave source ``s`` alone)."""
        used = 0
        for source, cache in enumerate(self.caches):
            kept = keep[source]
            if kept is not None:
                used += cache.close_idle(kept, max(0, room - used))
        self._sync_all()
        return used

    def _sync_all(self) -> None:
        if self._table is not None:
            for source in range(len(self._tables)):
                self._sync(source)

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
        """``Cache.gather`` over mixture ids, one gather per source (IndexError: out of range)."""
        ids = np.asarray(sample_ids, dtype=np.int64)
        source, local = self.index.locate(ids)
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= self.num_sequences):
            bad = int(ids[(ids < 0) | (ids >= self.num_sequences)][0])
            raise IndexError(
                f"mixture id {bad} out of range: the mixture holds {self.num_sequences}"
            )
        first = np.zeros(len(ids), np.int64) if starts is None else np.asarray(starts, np.int64)
        take = (
            self.lengths[ids].astype(np.int64) - first
            if lengths is None
            else np.asarray(lengths, dtype=np.int64)
        )
        offsets = np.zeros(len(ids) + 1, dtype=np.int64)
        np.cumsum(take, out=offsets[1:])
        touched = np.unique(source)
        if len(touched) == 1:  # one source: its own gather does the whole layout
            s = int(touched[0])
            got = self.caches[s].gather(local, first, take, with_mask, dtype, layout, fill, columns)
            self._sync_all()
            return Gathered(got.tokens, offsets, got.mask, got.extras)
        out_dtype = self.dtype if dtype is None else dtype
        if layout is None:
            dst, size = offsets[:-1], int(offsets[-1])
            tokens = np.empty(size, dtype=out_dtype)
        else:
            dst, size = np.asarray(layout[0], dtype=np.int64), int(layout[1])
            tokens = np.full(size, fill, dtype=out_dtype)
        mask = np.zeros(size, dtype=bool) if with_mask else None
        specs = [TOKEN_COLUMNS[n] for n in columns]
        extras = {c.name: np.full(size, c.fill, c.dtype) for c in specs}  # empty slots: fill
        for s in touched.tolist():
            sel = np.flatnonzero(source == s)
            got = self.caches[s].gather(
                local[sel], first[sel], take[sel], with_mask, dtype, columns=columns
            )
            where = flat_ranges(dst[sel], take[sel])
            tokens[where] = got.tokens
            if mask is not None and got.mask is not None:
                mask[where] = got.mask
            for name, values in got.extras.items():
                extras[name][where] = values
        self._sync_all()  # the sources may have opened and closed shards
        return Gathered(tokens, offsets, mask, extras)
