"""Compiled batch kernels (numba): gather and collate a batch in one pass over its tokens.

``BatchKernels`` builds the arrays of ``collate.pack_batch`` / ``pad_batch`` straight from the
mapped shards, bounds- and id-checking every segment; a refusal code becomes the numpy path's
error. Compressed caches, or batches over more shards than stay open, take the numpy path (tests
check both agree). Shards are read by raw address: they open and close only in Python between
kernel calls, the kernels hold the GIL, and every read is checked against the shard's size.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import numpy as np

from shardcache.errors import CorruptShardError
from shardcache.store.cache import Cache, MappedTable

logger = logging.getLogger("shardcache")


#: Why the kernels are off although numba is installed (they failed to compile or load), or
#: None: an optional speed-up never stops a reader, it only makes it take the numpy path.
disabled: str | None = None


@functools.cache
def _compiled() -> Any | None:
    """The compiled kernels module (``kernels_jit``), or None without numba or when disabled."""
    if disabled is not None:
        return None
    try:
        from shardcache.read.collate import kernels_jit
    except ImportError:
        return None
    return kernels_jit


def available(dtype: np.dtype) -> bool:
    """Whether the kernels can read shards of token type ``dtype`` (uint16/uint32, numba on)."""
    return np.dtype(dtype).name in ("uint16", "uint32") and _compiled() is not None


_EMPTY = np.zeros(0, dtype=np.int64)
_EMPTY_READ_ONLY = np.zeros(0, dtype=np.int64)
_EMPTY_READ_ONLY.flags.writeable = False


def _plain(array: np.ndarray | None, read_only: bool) -> np.ndarray:
    """A plan array as numba takes it: a plain int64 ndarray (None: an empty one).

    The empty one is as writeable as the plan: numba compiles one signature per kind.
    """
    if array is None:
        return _EMPTY_READ_ONLY if read_only else _EMPTY
    return np.asarray(array, dtype=np.int64).view(np.ndarray)


class BatchKernels:
    """The compiled reader of one cache (or mixture) and one epoch plan.

    Outputs are allocated at ``capacity`` slots (the token budget), then cut. With
    ``source_offsets`` (a mixture's) batches carry ``source_ids`` and ids within their source.
    """

    def __init__(
        self,
        cache: Cache,
        table: MappedTable,
        plan: Any,
        capacity: int,
        source_offsets: np.ndarray | None = None,
    ):
        kernels = _compiled()
        assert kernels is not None
        self._kernels = kernels
        self.cache = cache
        self.table = table
        self.plan = plan
        self.capacity = int(capacity)
        read_only = not np.asarray(plan.sample_ids).flags.writeable
        self._plan = (
            _plain(plan.batch_offsets, read_only),
            _plain(plan.sample_ids, read_only),
            _plain(plan.seg_starts, read_only),
            _plain(plan.seg_lengths, read_only),
            _plain(plan.row_offsets, read_only),
        )
        self._sources = (
            _EMPTY if source_offsets is None else np.array(source_offsets, dtype=np.int64)
        )
        self._wide = table.dtype.itemsize == 4
        self._info = np.zeros(5, dtype=np.int64)  # (kernels_jit.py)

    def _opened(self, code: int, opened: set[int], index: int) -> bool:
        """Whether the shard a kernel asked for is open now (call again); False: the numpy path."""
        if code != self._kernels.NEED_SHARD:
            self._refuse(code, index)
        shard = int(self._info[3])
        if shard in opened:
            return False
        opened.add(shard)
        return self.cache.open_mapped(shard)

    def _refuse(self, code: int, index: int) -> None:
        """Raise the error a kernel's refusal ``code`` of batch ``index`` stands for."""
        plan, cache, table = self.plan, self.cache, self.table
        lo, hi = int(plan.batch_offsets[index]), int(plan.batch_offsets[index + 1])
        ids = np.asarray(plan.sample_ids[lo:hi], dtype=np.int64)
        count = len(table.lengths)
        shards = np.unique(np.searchsorted(table.shard_starts, ids, side="right") - 1)
        if code == self._kernels.BAD_ID:
            for shard in shards.tolist():
                cache.check_ids(shard)  # raises, naming the file and the record batch
        if code == self._kernels.BAD_SEGMENT:
            bad = ids[(ids < 0) | (ids >= count)]
            if len(bad):
                raise IndexError(f"sample id {int(bad[0])} out of range: the cache holds {count}")
            raise IndexError(f"{cache.path}: a segment reaches past the end of its sequence")
        if code == self._kernels.BAD_SOURCE:
            raise CorruptShardError(
                f"{cache.path}: batch {index} reads past the end of one of shards "
                f"{shards.tolist()}; the index and the shards disagree: run `shardcache verify` "
                "and rebuild"
            )
        raise ValueError(
            f"batch {index} of the plan does not fit its rows or its budget of {self.capacity} "
            f"tokens (kernel code {code}); the plan does not match this cache: a bug, please "
            "report it"
        )

    def pack(
        self, index: int, seq_len: int, pad_id: int, ids_dtype: np.dtype
    ) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """``(inputs, meta)`` of packed batch ``index`` as ``pack_batch`` makes them, or None."""
        t = self.table
        offsets, samples, starts, lengths, rows = self._plan
        segments = int(offsets[index + 1] - offsets[index])
        slots = self.capacity
        most_rows = max(1, slots // seq_len)
        ids = np.empty(slots, dtype=ids_dtype)
        labels = np.empty(slots, dtype=np.int64)
        positions = np.empty(slots, dtype=ids_dtype)
        cu = np.empty(segments + most_rows + 1, dtype=np.int32)
        sample = np.empty(segments + most_rows, dtype=np.int64)
        source = np.empty(segments + most_rows if len(self._sources) else 0, dtype=np.int64)
        offset = np.empty(segments + most_rows, dtype=np.int64)
        info = self._info
        t.clock[0] += 1
        stamp = int(t.clock[0])
        opened: set[int] = set()
        while True:
            code = self._kernels.pack(
                self._wide, t.addresses, t.sizes, t.last_used, stamp, t.shard_starts,
                t.file_starts, t.lengths, t.mask_starts, offsets, samples, starts, lengths, rows,
                self._sources, index, seq_len, pad_id, t.max_id, ids, labels, positions, cu,
                sample, source, offset, info,
            )  # fmt: skip
            if code == 0:
                break
            if not self._opened(code, opened, index):
                return None
        num_rows, count = int(info[0]), int(info[1])
        shape = (num_rows, seq_len)
        used = num_rows * seq_len
        if used != slots:
            ids, labels, positions = ids[:used], labels[:used], positions[:used]
        inputs = {
            "input_ids": ids.reshape(shape),
            "labels": labels.reshape(shape),
            "position_ids": positions.reshape(shape),
        }
        meta = {
            "sample_ids": sample[:count],
            "sample_offsets": offset[:count],
            "cu_seqlens": cu[: count + 1],
            "max_seqlen": int(info[2]),
            "num_tokens": int(info[4]),
        }
        if len(self._sources):
            meta["source_ids"] = source[:count]
        return inputs, meta

    def pad(
        self, index: int, multiple: int, pad_id: int, ids_dtype: np.dtype
    ) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """The same for pad batch ``index``, as ``pad_batch`` makes them (None: the numpy path)."""
        t = self.table
        offsets, samples = self._plan[0], self._plan[1]
        slots = self.capacity
        num_rows = int(offsets[index + 1] - offsets[index])
        sample = np.empty(num_rows, dtype=np.int64)
        source = np.empty(num_rows if len(self._sources) else 0, dtype=np.int64)
        ids = np.empty(slots, dtype=ids_dtype)
        mask = np.empty(slots, dtype=ids_dtype)
        labels = np.empty(slots, dtype=np.int64)
        info = self._info
        t.clock[0] += 1
        stamp = int(t.clock[0])
        opened: set[int] = set()
        while True:
            code = self._kernels.pad(
                self._wide, t.addresses, t.sizes, t.last_used, stamp, t.shard_starts,
                t.file_starts, t.lengths, t.mask_starts, offsets, samples, self._sources, index,
                multiple, pad_id, t.max_id, ids, mask, labels, sample, source, info,
            )  # fmt: skip
            if code == 0:
                break
            if not self._opened(code, opened, index):
                return None
        rows, width = int(info[0]), int(info[1])
        used = rows * width
        inputs = {
            "input_ids": ids[:used].reshape(rows, width),
            "attention_mask": mask[:used].reshape(rows, width),
            "labels": labels[:used].reshape(rows, width),
        }
        meta = {"sample_ids": sample, "num_tokens": int(info[2])}
        if len(self._sources):
            meta["source_ids"] = source
        return inputs, meta


def warm_up() -> None:
    """Load the compiled kernels for the common argument types now (a no-op without numba).

    Called on import of ``dataset`` so numba's start is not paid by the first batch. A kernel that
    fails to load turns the kernels off with a warning.
    """
    global disabled
    try:
        _warm()
    except Exception as err:  # a broken numba install must not break reading
        disabled = f"{type(err).__name__}: {err}"
        _compiled.cache_clear()
        logger.warning(
            "shardcache: the compiled batch reader is off (%s); batches are read through numpy "
            "(same batches, slower). Reinstall numba (pip install 'shardcache[fast]') to fix",
            disabled,
        )


def _warm() -> None:
    kernels = _compiled()
    if kernels is None:
        return
    tokens = np.zeros(4, dtype=np.uint32)
    lengths = np.array([4], dtype=np.uint32)
    lengths.flags.writeable = False  # the length index is a read-only memory map
    table = MappedTable(
        addresses=np.array([tokens.__array_interface__["data"][0]], dtype=np.int64),
        sizes=np.array([len(tokens)], dtype=np.int64),
        last_used=np.zeros(1, dtype=np.int64),
        clock=np.ones(1, dtype=np.int64),
        shard_starts=np.array([0, 1], dtype=np.int64),
        file_starts=np.zeros(1, dtype=np.uint32),
        lengths=lengths,
        dtype=tokens.dtype,
        max_id=100,
        mask_starts=np.zeros(0, dtype=np.int64),
    )
    for shared in (False, True):  # plans computed here, or memory-mapped from the plan store
        pairs = (("batch_offsets", [0, 1]), ("sample_ids", [0]), ("row_offsets", [0, 1]))
        arrays = {name: np.array(v, dtype=np.int64) for name, v in pairs}
        for array in arrays.values():
            array.flags.writeable = not shared
        plan = _WarmPlan(**arrays)
        reader = BatchKernels(None, table, plan, 4)  # type: ignore[arg-type]
        reader.pack(0, 4, 0, np.dtype(np.int32))
        reader.pad(0, 1, 0, np.dtype(np.int32))
        plan = _WarmPlan(arrays["batch_offsets"], arrays["sample_ids"], None)
        BatchKernels(None, table, plan, 4).pack(0, 4, 0, np.dtype(np.int32))  # type: ignore[arg-type]


class _WarmPlan:
    """The plan arrays ``BatchKernels`` reads (``warm_up``'s stand-in for an EpochPlan)."""

    def __init__(self, batch_offsets: Any, sample_ids: Any, row_offsets: Any) -> None:
        self.batch_offsets = batch_offsets
        self.sample_ids = sample_ids
        self.row_offsets = row_offsets
        self.seg_starts = None
        self.seg_lengths = None
