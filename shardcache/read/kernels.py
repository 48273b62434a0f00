"""Compiled batch kernels: gather and collate a batch in one pass over its tokens.

What this module owns
---------------------
:func:`pack_into` and :func:`pad_into` build the arrays of one batch (the same arrays as
``collate.pack_batch`` / ``collate.pad_batch``, which stay the reference) straight from the
memory-mapped shard files (:class:`~shardcache.store.cache.MappedSources`): each token is read
once and written once into ``input_ids``, ``labels`` and ``position_ids`` (or
``attention_mask``), padding runs and segment boundaries are laid out in the same loop, and
every segment is checked on the way (inside its sequence, inside its shard file, rows not
over-full). There is no numpy call per segment, run or output array.

Why: the numpy path costs ~40 numpy calls a batch (1-2 us each on this machine), a fancy index
or slice copy per run, and a second pass per output array; at 16 x 2048 tokens that was
~165 us a batch against ~23 us for summing the same tokens from one flat memory map.

The kernels are compiled with numba (``pip install 'shardcache[fast]'``; ``cache=True``, so
once per machine). Without numba, or for what they do not handle (chat caches with loss
masks, compressed shards, a batch over more shards than the reader keeps open), the reader
takes the numpy path; tests/read/test_kernels.py checks that both give identical batches.
A kernel that finds something wrong returns an error code and the caller re-reads the batch
on the numpy path, which raises the descriptive error.

Memory safety: the kernels read shards through raw addresses (numba cannot take a list of
arrays cheaply: a typed list costs ~25 us to build and ~140 us per item set from Python).
An address comes from an open shard's array and stays valid while
``MappedSources.keep`` holds that array, which the caller does for the whole call; every
read is bounds-checked against the shard's size first.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from shardcache.store.cache import MappedSources

OK = 0  # a kernel's result; below zero: what went wrong (kernels_jit)


@functools.cache
def _compiled() -> Any | None:
    """The compiled kernels (:mod:`shardcache.read.kernels_jit`), or None without numba."""
    try:
        from shardcache.read import kernels_jit
    except ImportError:
        return None
    return kernels_jit


def warm_up() -> None:
    """Load the compiled kernels for the common argument types now (a no-op without numba).

    A process's first call of a numba kernel pays numba's start (~0.13 s measured) plus
    loading the kernel from numba's cache (~6 ms); ``shardcache.read.dataset`` calls this when
    it is imported, so that cost is paid with the other imports, not in the first batch. Other
    types (int64 ids, uint16 shards, int64 file starts) load on first use."""
    if _compiled() is None:
        return
    tokens = np.zeros(4, dtype=np.uint32)
    lengths = np.array([4], dtype=np.uint32)
    lengths.flags.writeable = False  # the length index is a read-only memory map
    sources = MappedSources(
        shard=np.zeros(1, dtype=np.int64),
        addresses=np.array([tokens.__array_interface__["data"][0]], dtype=np.int64),
        sizes=np.array([len(tokens)], dtype=np.int64),
        file_starts=np.zeros(1, dtype=np.uint32),
        lengths=lengths,
        dtype=tokens.dtype,
        keep={0: tokens},
    )
    for shared in (False, True):  # plans computed here, or memory-mapped from the plan store
        one = np.zeros(1, dtype=np.int64)
        bounds = np.array([0, 1], dtype=np.int64)
        for array in (one, bounds):
            array.flags.writeable = not shared
        pack_into(sources, one, one, None, bounds, 4, 0, np.int32)
        pack_into(sources, one, one, one, bounds, 4, 0, np.int32)
        pad_into(sources, one, 4, 0, np.int32)


def available(dtype: np.dtype) -> bool:
    """Whether the kernels can read shards of token type ``dtype`` (numba installed)."""
    return np.dtype(dtype).name in ("uint16", "uint32") and _compiled() is not None


def pack_into(
    sources: MappedSources,
    sample_ids: np.ndarray,
    starts: np.ndarray,
    taken: np.ndarray | None,
    row_bounds: np.ndarray,
    seq_len: int,
    pad_id: int,
    ids_dtype: np.dtype | type,
) -> dict[str, np.ndarray | int] | None:
    """The arrays of ``collate.pack_batch`` for these segments, or None when the kernel found
    a problem (the caller reads the batch on the numpy path, which names it)."""
    kernels = _compiled()
    assert kernels is not None
    num_rows = len(row_bounds) - 1
    n = len(sample_ids)
    slots = num_rows * seq_len
    ids = np.empty(slots, dtype=ids_dtype)
    labels = np.empty(slots, dtype=np.int64)
    positions = np.empty(slots, dtype=ids_dtype)
    cu = np.empty(n + num_rows + 1, dtype=np.int32)
    sample = np.empty(n + num_rows, dtype=np.int64)
    offsets = np.empty(n + num_rows, dtype=np.int64)
    count, longest = kernels.pack(
        sources.dtype.itemsize == 4,
        sources.addresses,
        sources.sizes,
        sources.file_starts,
        sources.lengths,
        sources.shard,
        np.asarray(sample_ids, dtype=np.int64),
        np.asarray(starts, dtype=np.int64),
        starts if taken is None else np.asarray(taken, dtype=np.int64),
        taken is not None,
        np.asarray(row_bounds, dtype=np.int64),
        seq_len,
        pad_id,
        ids,
        labels,
        positions,
        cu,
        sample,
        offsets,
    )
    if count < 0:
        return None
    shape = (num_rows, seq_len)
    return {
        "input_ids": ids.reshape(shape),
        "labels": labels.reshape(shape),
        "position_ids": positions.reshape(shape),
        "cu_seqlens": cu[: count + 1],
        "max_seqlen": int(longest),
        "sample_ids": sample[:count],
        "sample_offsets": offsets[:count],
    }


def pad_into(
    sources: MappedSources,
    sample_ids: np.ndarray,
    width: int,
    pad_id: int,
    ids_dtype: np.dtype | type,
) -> dict[str, np.ndarray] | None:
    """The arrays of ``collate.pad_batch`` for these whole sequences, or None when the kernel
    found a problem (the caller reads the batch on the numpy path, which names it)."""
    kernels = _compiled()
    assert kernels is not None
    ids64 = np.asarray(sample_ids, dtype=np.int64)
    rows = len(ids64)
    ids = np.empty(rows * width, dtype=ids_dtype)
    mask = np.empty(rows * width, dtype=ids_dtype)
    labels = np.empty(rows * width, dtype=np.int64)
    code = kernels.pad(
        sources.dtype.itemsize == 4,
        sources.addresses,
        sources.sizes,
        sources.file_starts,
        sources.lengths,
        sources.shard,
        ids64,
        width,
        pad_id,
        ids,
        mask,
        labels,
    )
    if code != OK:
        return None
    shape = (rows, width)
    return {
        "input_ids": ids.reshape(shape),
        "attention_mask": mask.reshape(shape),
        "labels": labels.reshape(shape),
        "sample_ids": ids64.copy() if ids64 is sample_ids else ids64,
    }
