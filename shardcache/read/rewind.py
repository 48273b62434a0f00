"""Rewind: the exact batches behind a training step, recomputed from the run record alone.

The stream is a pure function of the sources, options, seed and global position, so a step's
batches are found by arithmetic (``run_record``: step -> rank's micro-batch -> epoch and global
batch) and collated on their own: only the shards those batches use are read, and no earlier
batch is. The inverse question (at which steps a document is read) scans the plan, not the
data. Skipping steps on resume is ``ShardDataset.load_state_dict(state, skip_steps=...)``;
``skip_state`` is its offline form, and ``exclude_state`` that of leaving documents out
(``load_state_dict(state, exclude=...)``). A run's exclusions are in its record: the batches
recomputed here are without their documents from where each starts, as the run read them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardcache.errors import ConfigError, StateError
from shardcache.read.batch import Batch
from shardcache.read.dataset import ShardDataset
from shardcache.read.exclusion import Document, plan_units, recorded_documents
from shardcache.read.plan.epoch_plan import PlanOptions, split_epoch
from shardcache.read.run_record import (
    RunRecord,
    Segment,
    batch_of_micro,
    check_step,
    dataset_arguments,
    micro_index,
    micro_of_cursor,
    read_run_record,
    write_record_file,
)
from shardcache.store.cache import Cache, open_cache
from shardcache.store.show import document_pieces

#: What ``rewind`` and ``find_document`` take as a run: a record, its file or folder, a state.
Run = RunRecord | str | os.PathLike[str] | dict[str, Any]


def as_record(run: Run) -> RunRecord:
    """The run record of ``run`` (a record, a path, or a state / record dict)."""
    if isinstance(run, RunRecord):
        return run
    if isinstance(run, dict):
        return RunRecord.from_json(run)
    return read_run_record(run)


def open_run(record: RunRecord, transform: Any = None) -> ShardDataset:
    """A reader opened as the run's was (rank 0 of its last world size; the caller closes it).

    Raises:
        StateError: a source's data changed since the run (its key digest differs).
        ConfigError: a recorded transform cannot be rebuilt and ``transform`` is None.
    """
    arguments = dataset_arguments(record.dataset, transform)
    path = arguments.pop("path")
    options = PlanOptions.from_json(record.plan)
    ds = ShardDataset(
        path, options=options, seed=record.seed, rank=0, world_size=record.world_size,
        **arguments,
    )  # fmt: skip
    if ds.cache_digest != record.cache_digest:
        ds.close()
        paths = [s["path"] for s in record.dataset["sources"]]
        raise StateError(
            f"rewind: the data at {paths} has digest {ds.cache_digest!r} but the run read "
            f"{record.cache_digest!r}; the cache changed since, so its batches cannot be "
            "recomputed from it. Rewind against the caches the run read"
        )
    for exclusion in record.exclusions:  # (each from its own position, as the run left them out)
        ds.exclude(exclusion.names(), at=(exclusion.epoch, exclusion.consumed))
    return ds


@dataclass(frozen=True)
class Rewound:
    """One recomputed micro-batch of a step.

    Attributes:
        step: the optimizer step.
        rank: the rank that read it.
        micro: its place among the step's micro-batches on that rank (gradient accumulation).
        epoch: the epoch.
        index: the global batch in the epoch's plan.
        batch: the batch, as the rank got it (tensors and ``meta``).
    """

    step: int
    rank: int
    micro: int
    epoch: int
    index: int
    batch: Batch


class Rewinder:
    """A run's reader opened once, to recompute its steps' batches (a context manager).

    Args:
        run: a [`RunRecord`][shardcache.RunRecord], its file or checkpoint folder, or a
            reader state (which holds one).
        transform: the run's transform(s), when the record cannot rebuild them (a user's
            callable; FIM and SpanMask are rebuilt).

    Raises:
        StateError: no readable record, or the data changed since the run.
    """

    def __init__(self, run: Run, transform: Any = None) -> None:
        self.record = as_record(run)
        self.ds = open_run(self.record, transform)
        self._caches: dict[int, Cache] = {}

    def close(self) -> None:
        """Close the reader and the caches opened for provenance."""
        self.ds.close()
        for cache in self._caches.values():
            cache.close()
        self._caches.clear()

    def __enter__(self) -> Rewinder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def batches_of(self, epoch: int) -> int:
        """Global batches of an epoch: as the record counted them, else planned here.

        Args:
            epoch: the epoch.

        Returns:
            The count.
        """
        known = self.record.epoch_batches.get(epoch)
        return int(known) if known is not None else len(self.ds.plan(epoch))

    def locate(self, step: int, rank: int, micro: int) -> tuple[int, int, int]:
        """Where one micro-batch of a step is in the stream (arithmetic: nothing is read).

        Args:
            step: the optimizer step.
            rank: the rank.
            micro: the micro-batch of the step on that rank.

        Returns:
            ``(epoch, global batch, virtual index)``: the virtual index is the place in the
            rank's deal, past the plan's end for a batch ``tail="wrap"`` reads again.

        Raises:
            ConfigError: a step before the record, or a micro-batch out of range.
        """
        segment = self.record.segment_of(step)
        if not 0 <= micro < segment.grad_accum:
            raise ConfigError(
                f"micro: got {micro}, expected 0 <= micro < grad_accum={segment.grad_accum} "
                f"(the run's accumulation at step {step})"
            )
        first = micro_index(segment, step, micro)
        if first < 0:  # the first step of a segment that started inside it
            raise ConfigError(
                f"step {step} micro {micro}: read before the run resumed in it; ask for "
                f"micro >= {segment.micro}"
            )
        return batch_of_micro(segment, first, rank, self.batches_of, self.record.tail)

    def step(self, step: int, rank: int | None = None, micro: int | None = None) -> list[Rewound]:
        """The batches of optimizer step ``step``: every rank's and micro-batch, or those asked.

        Args:
            step: the optimizer step, as the trainer counted it.
            rank: one rank (None: all of the step's world size).
            micro: one micro-batch of the step (None: all ``grad_accum`` of them).

        Returns:
            The batches, by rank then micro-batch.

        Raises:
            ConfigError: a step before the record, a rank or micro-batch out of range.
        """
        check_step("step", step)
        segment = self.record.segment_of(step)
        ranks = range(segment.world_size) if rank is None else [rank]
        micros = range(segment.grad_accum) if micro is None else [micro]
        if segment.step == step and micro is None:
            micros = range(segment.micro, segment.grad_accum)
        out = []
        for r in ranks:
            for k in micros:
                epoch, index, virtual = self.locate(step, r, k)
                out.append(Rewound(step, r, k, epoch, index, self._collate(epoch, index, virtual)))
        return out

    def _collate(self, epoch: int, index: int, virtual: int) -> Batch:
        ds = self.ds
        ds.set_epoch(epoch)
        total = self.batches_of(epoch)
        # an epoch of whole stream rounds: plan the batch's stream alone, not the epoch
        part, place = ds.locate_batch(epoch, index, self.record.epoch_rounds.get(epoch))
        # as the reader does: a batch read again past the end (tail="wrap") is seeded anew
        wrap = virtual // total if ds.transform is not None else 0
        batch = ds.collate_batch(part, place, wrap, position=virtual)
        if ds.eval:
            batch["meta"]["filler"] = virtual >= total or bool(batch["meta"].get("filler"))
        return batch

    def cache(self, source: int) -> Cache:
        """The cache of a source (opened once, for provenance).

        Args:
            source: the source's index in the record (0 for one cache).

        Returns:
            The open cache (closed by ``close``).
        """
        if source not in self._caches:
            self._caches[source] = open_cache(self.record.dataset["sources"][source]["path"])
        return self._caches[source]

    def rows(self, rewound: Rewound) -> list[dict[str, Any]]:
        """A batch's segments with provenance (padding: ``sample_id`` None).

        Args:
            rewound: a batch ``step`` gave.

        Returns:
            Each segment: row, span, source, file, record, line, piece, split side,
            transform (and whether it changed the tokens), trainable tokens, ids and labels.
        """
        batch = rewound.batch
        meta = batch["meta"]
        ids, labels = _numpy(batch["input_ids"]), _numpy(batch["labels"])
        mask = batch.get("attention_mask")
        sample_ids = _numpy(meta["sample_ids"]).tolist()
        sources = _numpy(meta["source_ids"]).tolist() if "source_ids" in meta else None
        offsets = meta.get("sample_offsets")
        offsets = None if offsets is None else _numpy(offsets).tolist()
        spec = self.record.dataset
        transform = spec.get("transform")
        names = None if not transform else [t["class"] for t in transform]
        out = []
        for row, start, end, k in _segments(ids, meta, mask):
            tokens, trained = ids[row, start:end], labels[row, start:end]
            entry: dict[str, Any] = {"row": row, "start": start, "end": end}
            if k is None or sample_ids[k] < 0:
                entry.update(sample_id=None, padding=True)
                out.append(entry)
                continue
            s = 0 if sources is None else int(sources[k])
            sample = int(sample_ids[k])
            cache = self.cache(s)
            where = cache.lookup(sample)
            offset = 0 if offsets is None else int(offsets[k])
            stored = np.asarray(cache.read(sample))[offset : offset + len(tokens)]
            entry.update(
                sample_id=sample,
                source=spec["sources"][s].get("name", spec["sources"][s]["path"]),
                file=where.source,
                record=where.record,
                line=where.line,
                piece=where.piece,
                offset=offset,
                split=spec.get("split"),
                transform=names,
                transformed=not np.array_equal(stored, tokens),
                trainable=int((trained != -100).sum()),
                ids=tokens.tolist(),
                labels=trained.tolist(),
            )
            out.append(entry)
        return out

    def to_json(self, rewound: Rewound, tokens: bool = True) -> dict[str, Any]:
        """One rewound batch as JSON: where it is, its shape, its rows with provenance.

        Args:
            rewound: the batch.
            tokens: keep each row's ids and labels (False: provenance only).

        Returns:
            ``step``, ``rank``, ``micro``, ``epoch``, ``global_batch``, ``shape``,
            ``num_tokens`` and ``rows``.
        """
        rows = self.rows(rewound)
        if not tokens:
            for row in rows:
                row.pop("ids", None)
                row.pop("labels", None)
        return {
            "step": rewound.step,
            "rank": rewound.rank,
            "micro": rewound.micro,
            "epoch": rewound.epoch,
            "global_batch": rewound.index,
            "shape": list(_numpy(rewound.batch["input_ids"]).shape),
            "num_tokens": int(rewound.batch["meta"]["num_tokens"]),
            "rows": rows,
        }

    def steps(self, first: int, end: int) -> Iterator[Rewound]:
        """Every batch of some steps (all ranks, all micro-batches), in order.

        Args:
            first: the first step.
            end: the step after the last.

        Yields:
            The batches, as ``step`` gives them.

        Raises:
            ConfigError: ``end <= first``.
        """
        check_step("first", first)
        if end <= first:
            raise ConfigError(f"steps: got {first}:{end}, expected FIRST < END")
        for step in range(first, end):
            yield from self.step(step)

    def find_document(
        self, file: str, record: int, *, from_step: int | None = None, epochs: int = 1
    ) -> list[dict[str, Any]]:
        """The steps at which a document (every piece of it) is read.

        Scans the plan of ``epochs`` epochs from the one ``from_step`` reads in (None: the
        epoch of the run's last segment), not the data. A read at or after the position of an
        exclusion of the run that holds the document is not one: the run left it out there.

        Args:
            file: the document's input file, relative to the build's input root (as
                ``shardcache show --source`` names it).
            record: its 0-based record index in that file.
            from_step: a step whose epoch starts the search.
            epochs: how many epochs to search (>= 1).

        Returns:
            One dict per read: ``step``, ``rank``, ``micro``, ``epoch``, ``global_batch``,
            ``source`` and ``sample_id``.

        Raises:
            ConfigError: no source holds that document, or ``epochs`` < 1.
        """
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
            raise ConfigError(f"epochs: got {epochs!r}, expected an integer >= 1")
        wanted = self._document_ids(file, record)
        if from_step is None:
            segment = self.record.segments[-1]
            first_epoch = segment.epoch
        else:
            segment = self.record.segment_of(from_step)
            first_epoch = self.locate(from_step, 0, max(segment.micro, 0) if
                                      segment.step == from_step else 0)[0]  # fmt: skip
        excluded = [(e.epoch, e.consumed, set(self._units_of(e.documents).tolist()))
                    for e in self.record.exclusions]  # fmt: skip
        found = []
        for epoch in range(first_epoch, first_epoch + epochs):
            plan = self.ds.plan(epoch)
            for index in range(len(plan)):
                ids = np.asarray(plan.batch(index))
                hit = np.isin(ids, wanted)
                if not hit.any():
                    continue
                for read in self._reads(segment, epoch, index, len(plan)):
                    at = (epoch, read.pop("virtual"))
                    for unit in np.unique(ids[hit]).tolist():
                        if any(at >= (e, c) and unit in units for e, c, units in excluded):
                            continue  # (left out there)
                        s, local = self._split_id(unit)
                        found.append({**read, "source": s, "sample_id": local})
        return sorted(found, key=lambda f: (f["step"], f["rank"], f["micro"], f["sample_id"]))

    def _document_ids(self, file: str, record: int) -> np.ndarray:
        """The plan's unit ids of every piece of a document, over all sources."""
        ids = []
        sources = self.record.dataset["sources"]
        offset = 0
        for s in range(len(sources)):
            cache = self.cache(s)
            try:
                pieces = document_pieces(cache, file, record)
            except ConfigError:
                pieces = np.zeros(0, dtype=np.int64)
            ids.append(np.asarray(pieces, dtype=np.int64) + offset)
            offset += cache.num_sequences
        wanted = np.concatenate(ids)
        if len(wanted) == 0:
            names = [s.get("name", s["path"]) for s in sources]
            raise ConfigError(
                f"--document {file}:{record}: no source ({names}) holds record {record} of "
                f"{file!r}; name the file as `shardcache show --source` does (relative to the "
                "build's input root) and a 0-based record index"
            )
        return wanted

    def _units_of(self, documents: tuple[Document, ...]) -> np.ndarray:
        """The plan's unit ids of excluded documents (their sources' ids, offset)."""
        sizes = [self.cache(s).num_sequences for s in range(len(self.record.dataset["sources"]))]
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        return plan_units(documents, offsets, pairs=False)

    def _split_id(self, unit: int) -> tuple[str, int]:
        sources = self.record.dataset["sources"]
        for s in range(len(sources)):
            n = self.cache(s).num_sequences
            if unit < n:
                return sources[s].get("name", sources[s]["path"]), unit
            unit -= n
        raise ConfigError(f"sample id {unit} is past every source")  # (not reached)

    def _reads(
        self, segment: Segment, epoch: int, index: int, total: int
    ) -> Iterator[dict[str, Any]]:
        """The (step, rank, micro) reads of global batch ``index`` of ``epoch`` in a segment."""
        tail = self.record.tail
        start = segment.consumed if epoch == segment.epoch else 0
        split = split_epoch(total, segment.world_size, start, tail)
        virtuals = [index] + ([index + total] if tail == "wrap" else [])
        before = micro_of_cursor(segment, epoch, start, self.batches_of, tail)
        for virtual in virtuals:
            k, rank = divmod(virtual - start, segment.world_size)
            if virtual < start or k >= split.batches_per_rank:
                continue
            micro = before + k + segment.micro
            yield {
                "step": segment.step + micro // segment.grad_accum,
                "rank": rank,
                "micro": micro % segment.grad_accum,
                "epoch": epoch,
                "global_batch": index,
                "virtual": virtual,
            }


def rewind(run: Run, step: int, *, rank: int | None = None, micro: int | None = None,
           transform: Any = None) -> list[dict[str, Any]]:  # fmt: skip
    """The exact batches of optimizer step ``step`` of a run, as JSON with provenance.

    Reads only the shards those batches use; no earlier batch is read.

    Args:
        run: a [`RunRecord`][shardcache.RunRecord], its file or checkpoint folder, or a
            reader state.
        step: the optimizer step, as the trainer counted it.
        rank: one rank (None: every rank of the step).
        micro: one micro-batch of the step (None: all of them).
        transform: the run's transform(s), when the record cannot rebuild them.

    Returns:
        One dict per batch (``Rewinder.to_json``): step, rank, micro, epoch, global batch,
        shape and rows (sample id, source, file, record, piece, split side, transform,
        trainable tokens, ids, labels).

    Raises:
        StateError: no readable record, or the data changed since the run.
        ConfigError: a step, rank or micro-batch out of range.
    """
    with Rewinder(run, transform) as rewinder:
        return [rewinder.to_json(r) for r in rewinder.step(step, rank, micro)]


def write_run_record(
    path: str | os.PathLike[str], ds: ShardDataset, *, grad_accum: int | None = None
) -> str:
    """Write the run record of a reader beside the checkpoints (small, human-readable JSON).

    Call it once when training starts (on rank 0; every rank's is the same) and again after a
    resume that changed the world size, the accumulation or skipped steps. Every
    ``ds.state_dict()`` holds the same record, so a checkpoint's state is enough too.

    Args:
        path: a checkpoint folder (the record goes to ``shardcache-run.json`` in it) or a
            ``.json`` file.
        ds: the training reader.
        grad_accum: micro-batches per rank and optimizer step (sets ``ds.grad_accum``;
            None: ``ds.grad_accum``).

    Returns:
        The file written.

    Raises:
        ConfigError: ``grad_accum`` is not an integer >= 1.
    """
    if grad_accum is not None:
        ds.grad_accum = grad_accum
    return write_record_file(path, ds.run_record())


def skip_state(
    run_state: dict[str, Any],
    skip_steps: list[tuple[int, int]],
    *,
    world_size: int | None = None,
    grad_accum: int | None = None,
    transform: Any = None,
) -> dict[str, Any]:
    """A reader state that continues as if the steps of ``skip_steps`` had been read.

    The offline form of ``ShardDataset.load_state_dict(state, skip_steps=...)``: the state
    returned, loaded by the resumed run, reads step ``end``'s batches next.

    Args:
        run_state: a reader state holding its run record.
        skip_steps: ``(first, end)`` ranges, as ``load_state_dict`` takes them.
        world_size: the resumed run's world size (None: the state's).
        grad_accum: the resumed run's accumulation (None: the state's).
        transform: the run's transform(s), when the record cannot rebuild them.

    Returns:
        The new state (JSON-able).

    Raises:
        StateError: the state holds no run record, or is of other data.
        ConfigError: a skip range is malformed or starts after the state's step.
    """
    return _reloaded(
        run_state, world_size, grad_accum, transform,
        skip_steps=skip_steps, exclude=recorded_documents(run_state),
    )  # fmt: skip


def _reloaded(
    run_state: dict[str, Any],
    world_size: int | None,
    grad_accum: int | None,
    transform: Any,
    **load: Any,
) -> dict[str, Any]:
    """The state of the run's reader (rank 0) once it loaded ``run_state`` with ``load``."""
    record = as_record(run_state)
    arguments = dataset_arguments(record.dataset, transform)
    path = arguments.pop("path")
    world = record.world_size if world_size is None else world_size
    with ShardDataset(path, options=PlanOptions.from_json(record.plan), seed=record.seed,
                      rank=0, world_size=world, **arguments) as ds:  # fmt: skip
        if grad_accum is not None:
            ds.grad_accum = grad_accum
        ds.load_state_dict(run_state, **load)
        return ds.state_dict()


def exclude_state(
    run_state: dict[str, Any],
    documents: list[Any],
    *,
    world_size: int | None = None,
    grad_accum: int | None = None,
    transform: Any = None,
) -> dict[str, Any]:
    """A reader state that leaves ``documents`` out from its position on.

    The offline form of ``ShardDataset.load_state_dict(state, exclude=...)``: the state
    returned, loaded by the resumed run (which passes the same documents, and any the run left
    out before, to ``load_state_dict``), reads every batch from the position without them; the
    batches before it are unchanged.

    Args:
        run_state: a reader state holding its run record.
        documents: ``"FILE:RECORD"`` or ``(file, record)`` each; the ones the state's run
            already leaves out are kept, and need not be named again.
        world_size: the resumed run's world size (None: the state's).
        grad_accum: the resumed run's accumulation (None: the state's).
        transform: the run's transform(s), when the record cannot rebuild them.

    Returns:
        The new state (JSON-able).

    Raises:
        StateError: the state holds no run record, or is of other data.
        ConfigError: a document is malformed or in no source, or the state is one DataLoader
            worker's.
    """
    documents = [*recorded_documents(run_state), *documents]
    return _reloaded(run_state, world_size, grad_accum, transform, exclude=documents)


def _numpy(value: Any) -> np.ndarray:
    return value.numpy() if hasattr(value, "numpy") else np.asarray(value)


def _segments(
    ids: np.ndarray, meta: dict[str, Any], mask: Any
) -> Iterator[tuple[int, int, int, int | None]]:
    """``(row, start, end, k)`` of a batch's segments, ``k`` its entry in ``meta`` (None: padding).

    Pad mode (a 2-D ``attention_mask``): a row is one sequence then padding; pack mode: the
    segments of ``meta["cu_seqlens"]`` over the flattened rows.
    """
    rows, width = ids.shape
    if mask is not None and _numpy(mask).ndim == 2:
        real = _numpy(mask).sum(axis=1).tolist()
        for row in range(rows):
            yield row, 0, int(real[row]), row
            if real[row] < width:
                yield row, int(real[row]), width, None
        return
    cu = _numpy(meta["cu_seqlens"]).astype(np.int64).tolist()
    for k in range(len(cu) - 1):
        row, start = divmod(cu[k], width)
        yield row, start, start + cu[k + 1] - cu[k], k
