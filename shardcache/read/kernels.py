"""Compiled batch kernels: gather and collate a batch in one pass over its tokens.

What this module owns
---------------------
:func:`pack_into` and :func:`pad_into` build the arrays of one batch (the same arrays as
``collate.pack_batch`` / ``collate.pad_batch``, which stay the reference) straight from the
memory-mapped shard files (:class:`~shardcache.store.cache.MappedTable`): each token is read
once and written once into ``input_ids``, ``labels`` and ``position_ids`` (or
``attention_mask``), padding runs and segment boundaries are laid out in the same loop, and
every segment is checked on the way (inside its sequence, inside its shard file, rows not
over-full, every id at most the tokenizer's largest: the store leaves that check of a whole
shard file, a pass over all of its bytes when it is opened, to the reader of these tokens).
There is no numpy call per segment, run or output array. Chat caches too: a sequence's loss
mask is a run of bits in its shard's file (``MappedTable.mask_starts``), and the labels of
tokens whose bit is 0 are -100, as on the numpy path. Each batch is located and checked first,
then copied with the rows or segments ahead prefetched (kernels_jit.py says why).

Why: the numpy path costs ~40 numpy calls a batch (1-2 us each on this machine), a fancy index
or slice copy per run, and a second pass per output array; at 16 x 2048 tokens that was
~165 us a batch against ~23 us for summing the same tokens from one flat memory map.

The kernels are compiled with numba (``pip install 'shardcache[fast]'``; ``cache=True``, so
once per machine). Without numba, or for what they do not handle (compressed shards, a
batch over more shards than the reader keeps open), the reader
takes the numpy path; tests/read/test_kernels.py checks that both give identical batches.
A kernel takes the batch's index and reads the epoch plan's arrays itself, so a batch costs one
kernel call (no per-batch plan lookup, shard lookup or output sizing in Python). When a shard
the batch needs is not open, the kernel says which; :class:`BatchKernels` opens it
(``Cache.open_mapped``) and calls again. A kernel that finds something wrong returns an error
code and the caller re-reads the batch on the numpy path, which raises the descriptive error.

Memory safety: the kernels read shards through raw addresses (numba cannot take a list of
arrays cheaply: a typed list costs ~25 us to build and ~140 us per item set from Python).
An address is that of an open shard's array in the table; shards open and close only in
Python, between kernel calls, and the kernels keep the GIL, so no address changes during a
call; every read is bounds-checked against the shard's size first.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import numpy as np

from shardcache.store.cache import Cache, MappedTable

logger = logging.getLogger("shardcache")


#: Why the kernels are off although numba is installed (they failed to compile or load), or
#: None: an optional speed-up never stops a reader, it only makes it take the numpy path.
disabled: str | None = None


@functools.cache
def _compiled() -> Any | None:
    """The compiled kernels (:mod:`shardcache.read.kernels_jit`), or None without numba."""
    if disabled is not None:
        return None
    try:
        from shardcache.read import kernels_jit
    except ImportError:
        return None
    return kernels_jit


def available(dtype: np.dtype) -> bool:
    """Whether the kernels can read shards of token type ``dtype`` (numba installed)."""
    return np.dtype(dtype).name in ("uint16", "uint32") and _compiled() is not None


_EMPTY = np.zeros(0, dtype=np.int64)
_EMPTY_READ_ONLY = np.zeros(0, dtype=np.int64)
_EMPTY_READ_ONLY.flags.writeable = False


def _plain(array: np.ndarray | None, read_only: bool) -> np.ndarray:
    """A plan array as numba takes it: a plain int64 ndarray (np.memmap is a subclass), an
    empty one for None (of the plan's writeability: one compiled signature per kind)."""
    if array is None:
        return _EMPTY_READ_ONLY if read_only else _EMPTY
    return np.asarray(array, dtype=np.int64).view(np.ndarray)


class BatchKernels:
    """The compiled reader of one cache and one epoch plan: :meth:`pack` / :meth:`pad` build
    batch ``index`` (the arrays of ``collate.pack_batch`` / ``collate.pad_batch``), or return
    None when the numpy path must (a compressed shard, a batch the kernel refuses).

    ``capacity`` is the most slots a batch can have (the plan's token budget): outputs are
    allocated at that size and cut to the batch's own."""

    def __init__(self, cache: Cache, table: MappedTable, plan: Any, capacity: int):
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
        self._wide = table.dtype.itemsize == 4
        self._info = np.zeros(5, dtype=np.int64)  # (kernels_jit.py)

    def _opened(self, code: int, opened: set[int]) -> bool:
        """After a kernel returned ``code``: True when it asked for a shard and that shard is
        now open (call it again); False when the numpy path must read the batch (refused: the
        numpy path names why; a compressed shard; a shard closed again for another of the
        same batch, which needs more shards than stay open)."""
        shard = int(self._info[3])
        if code != self._kernels.NEED_SHARD or shard in opened:
            return False
        opened.add(shard)
        return self.cache.open_mapped(shard)

    def pack(
        self, index: int, seq_len: int, pad_id: int, ids_dtype: np.dtype
    ) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """``(model inputs, meta)`` of packed batch ``index``, or None (the numpy path)."""
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
        offset = np.empty(segments + most_rows, dtype=np.int64)
        info = self._info
        t.clock[0] += 1
        stamp = int(t.clock[0])
        opened: set[int] = set()
        while True:
            code = self._kernels.pack(
                self._wide, t.addresses, t.sizes, t.last_used, stamp, t.shard_starts,
                t.file_starts, t.lengths, t.mask_starts, offsets, samples, starts, lengths, rows,
                index, seq_len, pad_id, t.max_id, ids, labels, positions, cu, sample, offset, info,
            )  # fmt: skip
            if code == 0:
                break
            if not self._opened(code, opened):
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
        return inputs, meta

    def pad(
        self, index: int, multiple: int, pad_id: int, ids_dtype: np.dtype
    ) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """``(model inputs, meta)`` of pad batch ``index``, or None (the numpy path)."""
        t = self.table
        offsets, samples = self._plan[0], self._plan[1]
        slots = self.capacity
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
                t.file_starts, t.lengths, t.mask_starts, offsets, samples, index, multiple, pad_id,
                t.max_id, ids, mask, labels, info,
            )  # fmt: skip
            if code == 0:
                break
            if not self._opened(code, opened):
                return None
        rows, width = int(info[0]), int(info[1])
        used = rows * width
        lo = int(offsets[index])
        inputs = {
            "input_ids": ids[:used].reshape(rows, width),
            "attention_mask": mask[:used].reshape(rows, width),
            "labels": labels[:used].reshape(rows, width),
        }
        # a copy: plans may be read-only
        return inputs, {"sample_ids": samples[lo : lo + rows].copy(), "num_tokens": int(info[2])}


def warm_up() -> None:
    """Load the compiled kernels for the common argument types now (a no-op without numba).

    A process's first call of a numba kernel pays numba's start (~0.13 s measured) plus
    loading the kernel from numba's cache (~6 ms); ``shardcache.read.dataset`` calls this when
    it is imported, so that cost is paid with the other imports, not in the first batch. Other
    types (int64 ids, uint16 shards, int64 file starts) load on first use."""
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
    """The plan arrays :meth:`BatchKernels` reads (warm_up's stand-in for an EpochPlan)."""

    def __init__(self, batch_offsets: Any, sample_ids: Any, row_offsets: Any) -> None:
        self.batch_offsets = batch_offsets
        self.sample_ids = sample_ids
        self.row_offsets = row_offsets
        self.seg_starts = None
        self.seg_lengths = None
