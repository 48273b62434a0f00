"""Documents left out of the stream from a position on (``load_state_dict(state, exclude=...)``).

An exclusion is the global position it starts at (an epoch and a cursor: global batches of that
epoch consumed) and the documents it leaves out, each resolved from its provenance
(``FILE:RECORD``) to the sample ids of every piece of it in the sources that hold it. A batch
read at or after that position (its place in the rank's deal: the epoch, then the virtual
index ``cursor + rank + k * world_size``) has those documents' segments taken out when it is
collated; the other segments are read as they would have been (their tokens, and their
transforms, which are seeded per sample, not per batch). The plan is not changed, so the
batch count of every epoch, the step of every batch, every rank's evenness, and every batch
before the position stay as they were: the past is unchanged by construction.

A pad batch loses the rows of the excluded documents; a packed batch keeps its rows, their
excluded segments become padding. A batch left with no segment is read as padding: every id
the pad id, every label -100, ``meta["filler"]`` True and its sample ids -1 (no trainable
token; a training loop skips it as it skips an evaluation pass's fillers).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardcache.errors import ConfigError, StateError
from shardcache.read.plan.plan_arrays import EpochPlan
from shardcache.store.cache import Cache
from shardcache.store.show import document_pieces

logger = logging.getLogger("shardcache")


@dataclass(frozen=True)
class Document:
    """One excluded document: its provenance and its pieces in one source.

    Attributes:
        file: its input file, relative to the build's input root (as ``shardcache show
            --source`` names it).
        record: its 0-based record index in that file.
        source: the source that holds it (its index in the reader's sources; 0 for one cache).
        sample_ids: the sample ids of its pieces in that source.
    """

    file: str
    record: int
    source: int
    sample_ids: tuple[int, ...]

    @property
    def name(self) -> str:
        """``FILE:RECORD``."""
        return f"{self.file}:{self.record}"


@dataclass(frozen=True)
class Exclusion:
    """Documents left out from global position ``(epoch, consumed)`` on.

    Attributes:
        epoch: the epoch of the position.
        consumed: the global cursor in it (the first batch without the documents).
        documents: the documents (one entry per source holding one).
    """

    epoch: int
    consumed: int
    documents: tuple[Document, ...]

    def names(self) -> list[str]:
        """The documents as ``FILE:RECORD``, each once, in order."""
        return list(dict.fromkeys(d.name for d in self.documents))

    def to_json(self) -> dict[str, Any]:
        """As JSON (``from_json`` reads it back)."""
        return {
            "epoch": self.epoch,
            "consumed": self.consumed,
            "documents": [
                {"file": d.file, "record": d.record, "source": d.source,
                 "sample_ids": list(d.sample_ids)}
                for d in self.documents
            ],
        }  # fmt: skip

    @classmethod
    def from_json(cls, data: Any) -> Exclusion:
        """The exclusion ``to_json`` gave (StateError when damaged)."""
        try:
            documents = tuple(
                Document(str(d["file"]), int(d["record"]), int(d["source"]),
                         tuple(int(i) for i in d["sample_ids"]))
                for d in data["documents"]
            )  # fmt: skip
            return cls(int(data["epoch"]), int(data["consumed"]), documents)
        except (KeyError, TypeError, ValueError) as err:
            raise StateError(
                f"run record: an exclusion is missing a field or malformed ({err!r}); pass the "
                "state or record the reader wrote"
            ) from err


def parse_document(item: Any) -> tuple[str, int]:
    """A document as ``(file, record)``: from ``"FILE:RECORD"`` or a pair (ConfigError)."""
    if isinstance(item, Document):
        return item.file, item.record
    if isinstance(item, str):
        file, sep, number = item.strip().rpartition(":")
        if sep and file and number.isdigit():
            return file, int(number)
    elif isinstance(item, (tuple, list)) and len(item) == 2:
        file, record = item
        integer = isinstance(record, int) and not isinstance(record, bool)
        if isinstance(file, str) and integer and record >= 0:
            return file, record
    raise ConfigError(
        f"exclude: got {item!r}, expected a document as 'FILE:RECORD' (its input file as "
        "`shardcache show --source` names it, and its 0-based record index) or (file, record)"
    )


def parse_documents(items: Iterable[Any]) -> list[tuple[str, int]]:
    """Documents as ``(file, record)``, each once, in order (ConfigError for a malformed one)."""
    if isinstance(items, (str, bytes, os.PathLike)):
        raise ConfigError(
            f"exclude: got {items!r}, expected a list of documents ('FILE:RECORD' each); "
            "a file of them: read_documents(path)"
        )
    return list(dict.fromkeys(parse_document(item) for item in items))


def read_documents(path: str | os.PathLike[str]) -> list[tuple[str, int]]:
    """The documents a file lists: one ``FILE:RECORD`` a line (blank lines, ``#`` comments skipped).

    Args:
        path: the file.

    Returns:
        The documents as ``(file, record)``, each once, in order.

    Raises:
        ConfigError: the file cannot be read, or a line is not ``FILE:RECORD``.
    """
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.split("#", 1)[0].strip() for line in f]
    except OSError as err:
        raise ConfigError(
            f"exclude: cannot read the document list {os.fspath(path)!r} ({err}); pass a text "
            "file of FILE:RECORD lines"
        ) from err
    return parse_documents(line for line in lines if line)


def resolve(caches: Sequence[Cache], documents: Iterable[tuple[str, int]]) -> tuple[Document, ...]:
    """Every piece of each document in every source holding it (ConfigError: none does)."""
    out = []
    for file, record in documents:
        found = []
        for s, cache in enumerate(caches):
            try:
                pieces = document_pieces(cache, file, record)
            except ConfigError:
                continue
            if len(pieces):
                found.append(Document(file, record, s, tuple(int(i) for i in pieces)))
        if not found:
            paths = [c.path for c in caches]
            raise ConfigError(
                f"exclude: no source ({paths}) holds record {record} of {file!r}; name the file "
                "as `shardcache show --source` does (relative to the build's input root) and a "
                "0-based record index"
            )
        out.extend(found)
    return tuple(out)


def plan_units(documents: Iterable[Document], offsets: np.ndarray, pairs: bool) -> np.ndarray:
    """The plan's unit ids of ``documents``: sorted, unique (a pair's unit: both sides)."""
    ids = [offsets[d.source] + np.asarray(d.sample_ids, dtype=np.int64) for d in documents]
    units = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
    return np.unique(units // 2 if pairs else units)


def is_excluded(ids: np.ndarray, units: np.ndarray) -> np.ndarray:
    """Which of ``ids`` are in ``units`` (sorted, unique): a binary search, not a sort per batch."""
    ids = np.asarray(ids, dtype=np.int64)
    if not len(units):
        return np.zeros(len(ids), dtype=bool)
    at = np.minimum(np.searchsorted(units, ids), len(units) - 1)
    return units[at] == ids


def without_units(plan: EpochPlan, index: int, units: np.ndarray) -> EpochPlan | None:
    """Batch ``index`` of ``plan`` without the segments of ``units``, as a plan of one batch.

    ``units`` are sorted and unique. None when the batch holds none of them. Rows keep their
    place (a packed row emptied stays, as padding; a pad batch, one segment a row, loses the
    rows). The kept segments keep their starts, lengths and repetitions, so they read as in
    the whole batch.
    """
    ids, starts, lengths, bounds = plan.packed_segments(index)
    keep = ~is_excluded(ids, units)
    if keep.all():
        return None
    cum = np.zeros(len(keep) + 1, dtype=np.int64)
    np.cumsum(keep, out=cum[1:])
    repeats = plan.repeats_of(index)
    return EpochPlan(
        batch_offsets=np.array([0, int(cum[-1])], dtype=np.int64),
        sample_ids=np.ascontiguousarray(ids[keep]),
        row_offsets=None if plan.row_offsets is None else cum[bounds],
        seg_starts=None if plan.seg_starts is None else np.ascontiguousarray(starts[keep]),
        seg_lengths=None if lengths is None else np.ascontiguousarray(lengths[keep]),
        repeats=None if plan.repeats is None else np.ascontiguousarray(repeats[keep]),
    )


def check_recorded(
    theirs: Sequence[Exclusion], passed: Sequence[tuple[str, int]], where: str
) -> list[tuple[str, int]]:
    """The documents of ``passed`` no recorded exclusion holds; StateError if one is not passed.

    A state whose run left documents out reads other batches than the same position without
    them: a reader continuing it must leave them out too, and says so by passing them.
    """
    given = set(passed)
    for exclusion in theirs:
        missing = [n for n in exclusion.names() if parse_document(n) not in given]
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            shown = ", ".join(missing[:5]) + more
            raise StateError(
                f"{where}: the state's run leaves {len(exclusion.names())} documents out from "
                f"global batch {exclusion.consumed} of epoch {exclusion.epoch} on, and "
                f"exclude= does not name {len(missing)} of them ({shown}); read without them "
                "the stream would not be the run's. Pass every excluded document again: "
                "load_state_dict(state, exclude=[...]) with those of "
                "state['run']['exclusions'] (shardcache.read.exclusion.recorded_documents(state))"
            )
    held = {parse_document(n) for exclusion in theirs for n in exclusion.names()}
    return [doc for doc in passed if doc not in held]


def recorded_documents(state: dict[str, Any]) -> list[str]:
    """The documents a state's run leaves out (``FILE:RECORD``), in order, each once.

    Args:
        state: a reader state (or a run record as JSON).

    Returns:
        What ``load_state_dict(state, exclude=...)`` must be given at least.
    """
    run = state.get("run", state) if isinstance(state, dict) else None
    recorded = run.get("exclusions") if isinstance(run, dict) else None
    names = [n for e in recorded or () for n in Exclusion.from_json(e).names()]
    return list(dict.fromkeys(names))


class ExclusionFilter:
    """A reader's exclusions at work: which units a batch at a position leaves out, taken out.

    ``run`` holds the run's exclusions (``RunLog.exclusions``, sorted by position: the run
    record keeps them); ``selection`` resolves documents to its sources' sample ids. The units
    the first ``k`` exclusions leave out are found when first needed, once per ``k``.
    """

    def __init__(self, run: Any, selection: Any, path: str) -> None:
        self.run, self.selection, self.path = run, selection, path
        self._units: dict[int, np.ndarray] = {}
        self.segments = 0  # segments this process took out of batches

    def resolve(self, documents: list[tuple[str, int]]) -> tuple[Document, ...]:
        """Documents by provenance, resolved in the selection's sources (ConfigError: none)."""
        caches, _ = self.selection.sources()
        return resolve(caches, documents)

    def add(self, exclusion: Exclusion) -> None:
        """Record an exclusion in the run (in position order), and log it."""
        run = self.run
        run.exclusions = tuple(sorted((*run.exclusions, exclusion),
                                      key=lambda e: (e.epoch, e.consumed)))  # fmt: skip
        self._units = {}
        logger.info(
            "shardcache: %s: leaving %d documents out from global batch %d of epoch %d on "
            "(%d source entries); the batches before are unchanged",
            self.path, len(exclusion.names()), exclusion.consumed, exclusion.epoch,
            len(exclusion.documents),
        )  # fmt: skip

    def loaded(
        self, exclude: Sequence[Any] | None, worker: dict[str, Any] | None, where: str
    ) -> list[tuple[str, int]]:
        """The new documents of ``load_state_dict(exclude=...)``, checked against the state's.

        Raises:
            StateError: the state's run leaves out documents ``exclude`` does not name.
            ConfigError: new documents with one DataLoader worker's state (``worker``).
        """
        passed = [] if exclude is None else parse_documents(exclude)
        new = check_recorded(self.run.exclusions, passed, where)
        if new and worker is not None:
            raise ConfigError(
                f"{where}: exclude= with one DataLoader worker's state (worker "
                f"{worker.get('id')}): the other workers may have read past its "
                "cursor, and an exclusion must not change a batch already read. Exclude from "
                "a state of the whole reader: ds.state_dict(steps=k) in the main process, "
                "or a StatefulDataLoader's state"
            )
        self._units = {}
        return new

    def starting(self, here: tuple[int, int], at: Any, documents: Sequence[Any]) -> Exclusion:
        """``ShardDataset.exclude``'s exclusion, from ``at`` (None: ``here``), added.

        Raises:
            ConfigError: ``at`` is malformed or before ``here``, or a document is unknown.
        """
        if at is not None and not (
            isinstance(at, tuple) and len(at) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in at)
        ):  # fmt: skip
            raise ConfigError(
                f"exclude: at={at!r}, expected (epoch, consumed): two integers >= 0, a global "
                "position as a state records it, or None (the reader's)"
            )
        epoch, consumed = here if at is None else at
        if (epoch, consumed) < here:
            raise ConfigError(
                f"exclude: at=({epoch}, {consumed}) is before the reader's position (epoch "
                f"{here[0]}, global batch {here[1]}): the batches between were read with those "
                "documents, and an exclusion never changes a batch already read. Exclude from "
                "the reader's position or later (at=None)"
            )
        exclusion = Exclusion(epoch, consumed, self.resolve(parse_documents(documents)))
        self.add(exclusion)
        return exclusion

    def units(self, epoch: int, position: int) -> np.ndarray | None:
        """The plan units left out of ``epoch``'s batch at virtual index ``position`` (or None)."""
        exclusions = self.run.exclusions
        if not exclusions:
            return None
        live = sum((e.epoch, e.consumed) <= (epoch, position) for e in exclusions)
        if not live:
            return None
        if live not in self._units:  # (exclusions are sorted by position)
            _, index = self.selection.sources()
            offsets = np.zeros(1, dtype=np.int64) if index is None else index.offsets
            documents = [d for e in exclusions[:live] for d in e.documents]
            self._units[live] = plan_units(documents, offsets, self.selection.pairs)
        return self._units[live]

    def cut(
        self, part: EpochPlan, index: int, units: np.ndarray | None
    ) -> tuple[EpochPlan, int, bool]:
        """Batch ``index`` of ``part`` without ``units``: ``(part, index, emptied)``."""
        cut = None if units is None else without_units(part, index, units)
        if cut is None:
            return part, index, False
        kept = len(cut.sample_ids)
        self.segments += len(part.batch(index)) - kept
        return (cut, 0, False) if kept else (part, index, True)

    def stats(self) -> dict[str, Any]:
        """``ShardDataset.stats``' ``exclusions`` and ``excluded_segments`` (empty: none)."""
        if not self.run.exclusions:
            return {}
        return {
            "exclusions": [
                {"epoch": e.epoch, "consumed": e.consumed, "documents": e.names()}
                for e in self.run.exclusions
            ],
            "excluded_segments": self.segments,
        }
