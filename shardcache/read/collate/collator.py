"""The collate stage of the read pipeline: a planned batch -> its arrays, one path chosen once.

``collator(...)`` picks, at construction, the collator of the batch mode and sample kind (pad or
pack; sequences or pairs) and, inside it, the gather-and-lay-out path of its options (compiled
kernels, transformed segments, grown concat pieces, or numpy rows laid out as read): no batch
chooses among them. A reader that gathers per-token columns (``store/columns.py``) takes the
numpy path, and its batches carry them under their batch keys. A collator returns numpy
``(arrays, meta)``; the dataset front makes them tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from shardcache.read.collate import kernels
from shardcache.read.collate.attention import block_causal_mask, varlen_keys
from shardcache.read.collate.layout import pack_batch, packed_layout, pad_batch
from shardcache.read.plan.epoch_plan import EpochPlan, PlanOptions
from shardcache.read.samples.readers import SequenceReader
from shardcache.read.selection.selection import Selection
from shardcache.store.cache import MappedTable
from shardcache.store.columns import TOKEN_COLUMNS

#: Bookkeeping keys, kept under ``batch["meta"]`` (never model inputs).
META_KEYS = ("sample_ids", "sample_offsets", "cu_seqlens", "max_seqlen", "num_tokens")

Arrays = tuple[dict[str, Any], dict[str, Any]]


def compiled_table(selection: Selection, enabled: bool) -> MappedTable | None:
    """The mapped shards the compiled kernels read, or None (off, no numba, not mappable)."""
    cache = selection.open()
    if not enabled or not kernels.available(cache.dtype):
        return None
    return cache.mapped_table()


class Compiled:
    """The compiled kernels of the current plan (numba, a local uncompressed cache)."""

    def __init__(self, selection: Selection, max_tokens: int) -> None:
        self.selection = selection
        self.max_tokens = max_tokens
        self._kernels: kernels.BatchKernels | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_kernels": None}

    def of(self, plan: EpochPlan) -> kernels.BatchKernels | None:
        """The compiled reader of ``plan``, or None when the numpy path reads its batches."""
        cache, cached = self.selection.open(), self._kernels
        if cached is not None and cached.plan is plan and cached.cache is cache:
            return cached
        table = compiled_table(self.selection, True)
        if table is None:
            return None
        sources = self.selection.kernel_sources()
        self._kernels = kernels.BatchKernels(cache, table, plan, self.max_tokens, sources)
        return self._kernels


def pad_rows(
    reader: SequenceReader,
    options: PlanOptions,
    sample_ids: np.ndarray,
    epoch: int,
    repeats: np.ndarray | None = None,
) -> Arrays:
    """Read sequences and pad them into one batch, one per row (pad mode, the numpy path)."""
    sample_ids = np.asarray(sample_ids)
    pad_id = reader.selection.pad_id
    if reader.chain is not None:  # flat, transformed, then padded to the longest result
        got = reader.gather(sample_ids, epoch, repeats=repeats)
        width = int(options.padded(int(got.lengths.max())))
        laid_out = False
    else:
        lengths = reader.selection.sample_lengths()
        width = int(options.padded(int(lengths[sample_ids].max())))
        rows = np.arange(0, len(sample_ids) * width, width, dtype=np.int64)
        got = reader.gather(sample_ids, epoch, layout=(rows, len(sample_ids) * width))
        laid_out = True
    batch = pad_batch(
        got.tokens, got.lengths, sample_ids, pad_id, width, got.mask, reader.ids_dtype,
        laid_out=laid_out, extras=got.extras,
    )  # fmt: skip
    meta = {k: batch.pop(k) for k in ("sample_ids", "num_tokens")}
    return batch, meta


class Collator:
    """What every collator holds: its reader, the batch options, the compiled kernels or None.

    Args:
        reader: the sample reader of the selection's kind.
        options: the batch options.
        compiled: the compiled kernels (plain sequences without transforms), or None.
        attention: the attention keys of packed rows (pack mode).
    """

    #: what ``ShardDataset.kernels`` was when the collator was chosen
    uses_kernels = True

    def __init__(
        self,
        reader: SequenceReader,
        options: PlanOptions,
        compiled: Compiled | None,
        attention: str | None = None,
    ) -> None:
        self.reader, self.options, self.compiled = reader, options, compiled

    def _kernel(self, plan: EpochPlan) -> kernels.BatchKernels | None:
        """The compiled kernels of ``plan``, or None (the numpy path reads the batch)."""
        return None if self.compiled is None else self.compiled.of(plan)


class PadCollator(Collator):
    """Pad mode: a sequence per row, rows padded to the batch's longest."""

    def __call__(self, plan: EpochPlan, index: int, wrap: int, epoch: int) -> Arrays:
        """The arrays and meta of global batch ``index`` of ``plan``."""
        kernel = self._kernel(plan)
        if kernel is not None:  # one pass, straight from the mapped shards
            made = kernel.pad(
                index, self.options.pad_to_multiple_of, self.reader.selection.pad_id,
                self.reader.ids_dtype,
            )  # fmt: skip
            if made is not None:
                return made
        repeats = self.reader.repeats(plan, index, wrap)
        return pad_rows(self.reader, self.options, plan.batch(index), epoch, repeats)


class PairPadCollator(PadCollator):
    """Pad mode over pairs: a pair's two rows adjacent, ``pair_ids`` and ``side`` in meta."""

    def __call__(self, plan: EpochPlan, index: int, wrap: int, epoch: int) -> Arrays:
        """The arrays and meta of global batch ``index`` of ``plan``."""
        units = np.asarray(plan.batch(index), dtype=np.int64)
        repeats = self.reader.repeats(plan, index, wrap)
        batch, meta = pad_rows(
            self.reader, self.options, self.reader.samples(units), epoch, repeats
        )
        meta["pair_ids"] = np.repeat(units, 2)
        meta["side"] = np.tile(np.array([0, 1]), len(units))
        return batch, meta


class PackCollator(Collator):
    """Pack mode: segments laid out in rows of ``seq_len``, kept apart by ``attention``."""

    def __init__(
        self,
        reader: SequenceReader,
        options: PlanOptions,
        compiled: Compiled | None,
        attention: str | None = None,
    ) -> None:
        super().__init__(reader, options, compiled)
        self.seq_len = int(options.seq_len or 0)
        self._attention = ATTENTION[attention or "none"]
        grows = options.packing == "concat" and bool(options.growth)
        # a function, not a bound method: no reference cycle keeps a closed reader's maps
        self._pack: Callable[..., dict[str, Any]]
        if reader.chain is not None and grows:
            self._pack = PackCollator._grown_pieces
        elif reader.chain is not None:
            self._pack = PackCollator._transformed
        else:
            self._pack = PackCollator._laid_out

    def __call__(self, plan: EpochPlan, index: int, wrap: int, epoch: int) -> Arrays:
        """The arrays and meta of global batch ``index`` of ``plan``."""
        made, kernel = None, self._kernel(plan)
        if kernel is not None:  # one pass, straight from the mapped shards
            pad_id = self.reader.selection.pad_id
            made = kernel.pack(index, self.seq_len, pad_id, self.reader.ids_dtype)
        if made is not None:
            batch, meta = made
        else:
            ids, starts, taken, row_bounds = plan.packed_segments(index)
            repeats = self.reader.repeats(plan, index, wrap)
            batch = self._pack(self, ids, starts, taken, row_bounds, epoch, repeats)
            meta = {k: batch.pop(k) for k in META_KEYS if k in batch}
        self._attention(batch)
        return batch, meta

    def _laid_out(
        self,
        ids: np.ndarray,
        starts: np.ndarray,
        taken: np.ndarray | None,
        row_bounds: np.ndarray,
        epoch: int,
        repeats: np.ndarray | None,
    ) -> dict[str, Any]:
        """Segments gathered straight into their rows (numpy), then laid out by layout.py."""
        seq_len, reader = self.seq_len, self.reader
        slots = (len(row_bounds) - 1) * seq_len
        lengths = reader.selection.sample_lengths()[ids] - starts if taken is None else taken
        laid_out = int(lengths.sum()) != slots  # rows with padding: gathered into their rows
        layout = (packed_layout(lengths, row_bounds, seq_len), slots) if laid_out else None
        got = reader.gather(ids, epoch, starts, taken, layout)
        return pack_batch(
            got.tokens, got.lengths, ids, starts, row_bounds, seq_len, reader.selection.pad_id,
            got.mask, reader.ids_dtype, laid_out, got.extras,
        )  # fmt: skip

    def _transformed(
        self,
        ids: np.ndarray,
        starts: np.ndarray,
        taken: np.ndarray | None,
        row_bounds: np.ndarray,
        epoch: int,
        repeats: np.ndarray | None,
    ) -> dict[str, Any]:
        """Flat and transformed (lengths may change), then laid out."""
        reader = self.reader
        got = reader.gather(ids, epoch, starts, taken, repeats=repeats)
        return pack_batch(
            got.tokens, got.lengths, ids, starts, row_bounds, self.seq_len,
            reader.selection.pad_id, got.mask, reader.ids_dtype, extras=got.extras,
        )  # fmt: skip

    def _grown_pieces(
        self,
        ids: np.ndarray,
        starts: np.ndarray,
        taken: np.ndarray,
        row_bounds: np.ndarray,
        epoch: int,
        repeats: np.ndarray | None,
    ) -> dict[str, Any]:
        """Concat pieces of documents that a transform may lengthen, laid out in rows.

        The plan cut each document as ``length + growth`` tokens, so a piece is read from the
        whole transformed document (seeded at start 0: every piece of it sees the same one),
        padded to that length with pad tokens that carry no loss.
        """
        reader = self.reader
        pad_id = reader.selection.pad_id
        got = reader.gather(ids, epoch, None, None, repeats=repeats)  # whole, transformed
        ends = got.lengths  # (at most the stored length + growth: checked)
        taken = np.asarray(taken, dtype=np.int64)
        first = np.cumsum(taken) - taken
        # each slot's place in its document as planned, and whether the transform filled it
        pos = np.repeat(np.asarray(starts, dtype=np.int64) - first, taken)
        pos += np.arange(int(taken.sum()), dtype=np.int64)
        real = pos < np.repeat(ends, taken)
        src = np.repeat(got.offsets[:-1], taken) + np.minimum(pos, np.repeat(ends - 1, taken))
        src = np.maximum(src, 0)  # (an empty batch)
        source = got.tokens[src] if len(got.tokens) else np.zeros(len(src), got.tokens.dtype)
        tokens = np.where(real, source, pad_id).astype(got.tokens.dtype, copy=False)
        mask = real if got.mask is None else real & got.mask[src]
        extras = {name: np.where(mask, values[src], TOKEN_COLUMNS[name].fill)
                  for name, values in got.extras.items()}  # fmt: skip
        return pack_batch(
            tokens, taken, ids, starts, row_bounds, self.seq_len, pad_id, mask, reader.ids_dtype,
            extras=extras,
        )  # fmt: skip


class PairPackCollator(PackCollator):
    """Pack mode over pairs: unit u is segments 2u (chosen), 2u + 1 (rejected).

    Both sides of a pair are whole segments of one row, adjacent; a row's padding is a segment
    of its own after them (``pair_ids`` and ``side`` -1), never part of a pair's.
    """

    def __call__(self, plan: EpochPlan, index: int, wrap: int, epoch: int) -> Arrays:
        """The arrays and meta of global batch ``index`` of ``plan``."""
        units, _, _, unit_bounds = plan.packed_segments(index)
        ids = self.reader.samples(units)
        starts = np.zeros(len(ids), dtype=np.int64)
        repeats = self.reader.repeats(plan, index, wrap)
        batch = self._pack(self, ids, starts, None, 2 * unit_bounds, epoch, repeats)
        meta = {k: batch.pop(k) for k in META_KEYS if k in batch}
        sample_ids = np.asarray(meta["sample_ids"])
        real = sample_ids >= 0
        meta["pair_ids"] = np.where(real, sample_ids // 2, -1)
        meta["side"] = np.where(real, sample_ids % 2, -1)
        self._attention(batch)
        return batch, meta


def _mask(batch: dict[str, Any]) -> None:
    batch["attention_mask"] = block_causal_mask(np.asarray(batch["position_ids"]))


def _varlen(batch: dict[str, Any]) -> None:
    batch.update(varlen_keys(np.asarray(batch["position_ids"])))


def _no_attention(batch: dict[str, Any]) -> None:
    return None


#: The keys that keep a packed batch's segments apart, by ``attention`` mode.
ATTENTION: dict[str, Callable[[dict[str, Any]], None]] = {
    "mask": _mask,
    "varlen": _varlen,
    "none": _no_attention,
}

#: The collators by (mode, sample kind).
COLLATORS: dict[tuple[str, bool], type[Collator]] = {
    ("pad", False): PadCollator,
    ("pad", True): PairPadCollator,
    ("pack", False): PackCollator,
    ("pack", True): PairPackCollator,
}


def kernels_read(reader: SequenceReader) -> bool:
    """Whether the compiled kernels can build this reader's batches (else: the numpy path).

    Plain sequences read as stored: no pairs, no transform, no per-token column.
    """
    return not reader.selection.pairs and reader.chain is None and not reader.columns


def collator(
    reader: SequenceReader,
    options: PlanOptions,
    attention: str | None,
    use_kernels: bool,
) -> Collator:
    """The collator of ``options.mode`` and the reader's kind, its path chosen here, once.

    The compiled kernels read plain sequences without transforms, when ``use_kernels`` and
    numba allow it; pairs, transformed segments and per-token columns take the numpy path.
    """
    compiled = None
    if use_kernels and kernels_read(reader):
        compiled = Compiled(reader.selection, options.max_tokens)
    made = COLLATORS[(options.mode, reader.selection.pairs)](reader, options, compiled, attention)
    made.uses_kernels = use_kernels
    return made
