"""The run record: what recomputes a training run's stream, and where each step read in it.

A record holds how the reader was opened (sources with their key digests, split, transforms),
the batch options and seed, and the run's **segments**: from optimizer step ``step`` on (and
``micro`` micro-batches into it) the run read with ``world_size`` ranks and ``grad_accum``
micro-batches per rank and step, starting at global cursor ``consumed`` of ``epoch``. A run
that never changed shape has one segment; a resume at another world size or accumulation, or
a skip, starts another. Steps are the trainer's optimizer steps, counted on across resumes.

Within a segment, step ``N`` is micro-batches ``(N - step) * A - micro .. + A - 1`` of every
rank's stream, and a rank's stream runs through the epochs in order: epoch ``e``'s batches of
that rank (``split_epoch``: ``c + r + kW`` from the cursor ``c``), then epoch ``e + 1``'s from
cursor 0. The arithmetic here is pure: it asks a callable for an epoch's global batch count,
which the record also keeps for the epochs the run planned (``epoch_batches``), so locating a
step never plans the epochs before it twice and never reads a shard.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from shardcache.errors import ConfigError, StateError
from shardcache.read.exclusion import Exclusion
from shardcache.read.plan.epoch_plan import EpochPlan, split_epoch
from shardcache.read.plan.streams import StreamPlan
from shardcache.read.samples.transforms import FIM, SpanMask
from shardcache.read.selection.mixture import Source, as_sources
from shardcache.read.selection.schedule import Schedule
from shardcache.read.selection.splits import Split
from shardcache.store.files import write_json_atomic
from shardcache.store.remote import is_url

#: The version of the run record's JSON.
RUN_RECORD_FORMAT = 1
#: The file name of a run record inside a checkpoint folder.
RUN_RECORD_NAME = "shardcache-run.json"

#: ``epoch -> global batches of that epoch``.
BatchCounts = Callable[[int], int]


@dataclass(frozen=True)
class Segment:
    """A stretch of a run with one world size and accumulation, from a step and a cursor.

    Attributes:
        step: the optimizer step the segment starts in.
        micro: micro-batches of that step every rank had read before the segment (0: the
            segment starts at a step boundary).
        epoch: the epoch of the cursor the segment starts at.
        consumed: the global cursor (global batches of that epoch consumed).
        world_size: ranks.
        grad_accum: micro-batches per rank and optimizer step.
    """

    step: int
    micro: int
    epoch: int
    consumed: int
    world_size: int
    grad_accum: int

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            low = 1 if f.name in ("world_size", "grad_accum") else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise StateError(
                    f"run record: segment {f.name}={value!r}, expected an integer >= {low}; "
                    "pass a record that ShardDataset.run_record() or a state wrote"
                )


@dataclass(frozen=True)
class SkippedSteps:
    """Steps ``[first, end)`` a resumed run did not read.

    From step ``at_step`` on it read step ``end``'s batches: the cursor moved from
    ``(epoch, consumed)`` to ``(to_epoch, to_consumed)``.
    """

    first: int
    end: int
    at_step: int
    epoch: int
    consumed: int
    to_epoch: int
    to_consumed: int


@dataclass(frozen=True)
class RunRecord:
    """What recomputes a run's stream, and its steps' place in it (JSON: ``to_json``).

    Made by ``ShardDataset.run_record()`` and written by
    [`write_run_record`][shardcache.write_run_record]; every reader state holds one under
    ``"run"``.

    Attributes:
        dataset: how the reader was opened: ``sources`` (path, name, key digest, weight,
            repetitions, splits), ``mixture``, ``split``, ``splits``, ``eval``,
            ``tokens_per_epoch``, ``schedule``, ``ids_dtype``, ``attention`` and
            ``transform`` (each transform's class and fields).
        cache_digest: the digest the reader state checks.
        seed: the plan's seed.
        plan: the batch options (``PlanOptions.to_json()``, streams resolved).
        segments: the run's segments, by step.
        skipped: the step ranges a resume skipped.
        epoch_batches: the global batch count of each epoch the run planned.
        epoch_rounds: of those, the epochs of canonical streams that are whole rounds (every
            stream as long as the longest): each one's stream length ``M``, so that global
            batch ``j`` is batch ``j // C`` of stream ``j % C`` and one batch is found by
            planning its stream alone (``ShardDataset.locate_batch``).
        exclusions: documents left out from a position on (``load_state_dict(state,
            exclude=...)``), by position.
    """

    dataset: dict[str, Any]
    cache_digest: str
    seed: int
    plan: dict[str, Any]
    segments: tuple[Segment, ...]
    skipped: tuple[SkippedSteps, ...] = ()
    epoch_batches: Mapping[int, int] = field(default_factory=dict)
    epoch_rounds: Mapping[int, int] = field(default_factory=dict)
    exclusions: tuple[Exclusion, ...] = ()

    def __post_init__(self) -> None:
        if not self.segments:
            raise StateError("run record: no segments; pass what ShardDataset.run_record() gave")
        steps = [(s.step, s.micro) for s in self.segments]
        if steps != sorted(steps):
            raise StateError(f"run record: segments out of order (steps {steps})")

    @property
    def world_size(self) -> int:
        """The world size of the last segment."""
        return self.segments[-1].world_size

    @property
    def grad_accum(self) -> int:
        """The gradient accumulation of the last segment."""
        return self.segments[-1].grad_accum

    @property
    def tail(self) -> str:
        """How epochs even ranks out (``PlanOptions.tail``; ``"wrap"`` for an evaluation pass)."""
        return "wrap" if self.dataset.get("eval") else str(self.plan.get("tail", "drop"))

    def segment_of(self, step: int) -> Segment:
        """The segment a step is read in.

        Args:
            step: the optimizer step.

        Returns:
            The last segment starting at or before it.

        Raises:
            ConfigError: a step before the first segment.
        """
        check_step("step", step)
        chosen = None
        for segment in self.segments:
            if segment.step <= step:
                chosen = segment
        if chosen is None:
            raise ConfigError(
                f"step {step}: the run record starts at step {self.segments[0].step}; "
                "ask for a step at or after it"
            )
        return chosen

    def step_at(self, epoch: int, consumed: int) -> int:
        """The optimizer steps read once every rank reached cursor ``(epoch, consumed)``.

        A recipe's last step is ``step_at(*cursor) - 1``: what ``shardcache rewind --step``
        takes for the step where it stopped.

        Args:
            epoch: the cursor's epoch (a state's ``epoch``).
            consumed: the global batches of it consumed (a state's ``consumed``).

        Returns:
            The steps from the run's start (a step begun but unfinished not counted).

        Raises:
            StateError: the cursor is not one of the run's last segment, or an epoch before
                it has no recorded batch count (call ``len`` of the reader each epoch).
        """
        segment = self.segments[-1]

        def batches_of(e: int) -> int:
            if e not in self.epoch_batches:
                raise StateError(
                    f"run record: no batch count for epoch {e}; the record knows epochs "
                    f"{sorted(self.epoch_batches)}. Take the record from the reader that "
                    "read them (ShardDataset.run_record() after len() each epoch)"
                )
            return self.epoch_batches[e]

        micro = micro_of_cursor(segment, epoch, consumed, batches_of, self.tail) + segment.micro
        return segment.step + micro // segment.grad_accum

    def to_json(self) -> dict[str, Any]:
        """The record as a JSON-able dict (``from_json`` reads it back).

        Returns:
            ``format``, the fields, ``world_size`` and ``grad_accum`` (of the last segment),
            and ``steps``: the batch-to-step mapping in words.
        """
        return {
            "format": RUN_RECORD_FORMAT,
            "steps": (
                "optimizer step N of a segment covers, on every rank r, micro-batches "
                "(N - step) * grad_accum - micro .. + grad_accum - 1 of rank r's stream from "
                "the segment's cursor, through the epochs in order; a rank's k-th batch of "
                "an epoch from cursor c is global batch c + r + k * world_size"
            ),
            "world_size": self.world_size,
            "grad_accum": self.grad_accum,
            "dataset": self.dataset,
            "cache_digest": self.cache_digest,
            "seed": self.seed,
            "plan": self.plan,
            "segments": [asdict(s) for s in self.segments],
            "skipped": [asdict(s) for s in self.skipped],
            "epoch_batches": {str(e): int(n) for e, n in sorted(self.epoch_batches.items())},
            "epoch_rounds": {str(e): int(n) for e, n in sorted(self.epoch_rounds.items())},
            "exclusions": [e.to_json() for e in self.exclusions],
        }

    @classmethod
    def from_json(cls, data: Any) -> RunRecord:
        """The record ``to_json`` gave, checked.

        Args:
            data: the dict (or a reader state holding one under ``"run"``).

        Returns:
            The record.

        Raises:
            StateError: not a run record of this format, or a damaged one.
        """
        if isinstance(data, dict) and "format" not in data and isinstance(data.get("run"), dict):
            data = data["run"]
        if not isinstance(data, dict) or data.get("format") != RUN_RECORD_FORMAT:
            got = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise StateError(
                f"run record: expected a dict with format {RUN_RECORD_FORMAT}, got {got!r}; "
                "pass the file write_run_record() wrote, or a reader state"
            )
        try:
            return cls(
                dict(data["dataset"]),
                str(data["cache_digest"]),
                int(data["seed"]),
                dict(data["plan"]),
                tuple(Segment(**s) for s in data["segments"]),
                tuple(SkippedSteps(**s) for s in data.get("skipped") or ()),
                {int(e): int(n) for e, n in (data.get("epoch_batches") or {}).items()},
                {int(e): int(n) for e, n in (data.get("epoch_rounds") or {}).items()},
                tuple(Exclusion.from_json(e) for e in data.get("exclusions") or ()),
            )
        except (KeyError, TypeError, ValueError) as err:
            if isinstance(err, StateError):
                raise
            raise StateError(
                f"run record: a field is missing or malformed ({err!r}); pass the file "
                "write_run_record() wrote, or a reader state"
            ) from err


def check_step(name: str, value: Any) -> int:
    """``value`` as a step (an int >= 0), else ConfigError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name}: got {value!r}, expected an integer >= 0")
    return value


def read_run_record(path: str | os.PathLike[str]) -> RunRecord:
    """Read a run record: its file, a folder holding ``shardcache-run.json``, or a state file.

    Args:
        path: the record, a checkpoint folder with one, or a JSON reader state.

    Returns:
        The record.

    Raises:
        StateError: no record there, or not a readable one.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, RUN_RECORD_NAME)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError as err:
        raise StateError(
            f"run record: no file at {path!r}; pass the run record write_run_record() wrote "
            f"(a checkpoint folder holding {RUN_RECORD_NAME}), or a saved reader state"
        ) from err
    except (OSError, ValueError) as err:
        raise StateError(f"run record: cannot read {path!r} as JSON ({err})") from err
    return RunRecord.from_json(data)


def write_record_file(path: str | os.PathLike[str], record: RunRecord) -> str:
    """Write ``record`` (atomically) to ``path``, or into it when it is a folder; the file."""
    path = os.fspath(path)
    if os.path.isdir(path) or not path.endswith(".json"):
        os.makedirs(path, exist_ok=True)
        path = os.path.join(path, RUN_RECORD_NAME)
    write_json_atomic(path, record.to_json())
    return path


# --------------------------------------------------------------------------------------------
# Steps <-> positions (pure)
# --------------------------------------------------------------------------------------------


def micro_index(segment: Segment, step: int, micro: int = 0) -> int:
    """A rank's micro-batch of ``step`` (``micro`` within it), counted from the segment's start."""
    return (step - segment.step) * segment.grad_accum + micro - segment.micro


def _per_rank(segment: Segment, epoch: int, start: int, batches_of: BatchCounts, tail: str) -> int:
    return split_epoch(batches_of(epoch), segment.world_size, start, tail).batches_per_rank


def _walk(segment: Segment, micro: int, batches_of: BatchCounts, tail: str) -> tuple[int, int, int]:
    """``(epoch, epoch's start cursor, micro-batches into it)`` of a segment's micro-batch."""
    epoch, start = segment.epoch, segment.consumed
    while True:
        per_rank = _per_rank(segment, epoch, start, batches_of, tail)
        if micro < per_rank:
            return epoch, start, micro
        if per_rank == 0 and start == 0:
            raise ConfigError(
                f"run record: epoch {epoch} has {batches_of(epoch)} global batches, none for "
                f"each of {segment.world_size} ranks; no step past it can be located"
            )
        micro -= per_rank
        epoch, start = epoch + 1, 0


def batch_of_micro(
    segment: Segment, micro: int, rank: int, batches_of: BatchCounts, tail: str
) -> tuple[int, int, int]:
    """``(epoch, global batch, virtual index)`` rank ``rank`` reads as micro-batch ``micro``.

    The virtual index is the position in the rank's deal (past the plan's end under
    ``tail="wrap"``: a batch read again); the global batch is its place in the plan.
    """
    if not 0 <= rank < segment.world_size:
        raise ConfigError(f"rank: got {rank}, expected 0 <= rank < world_size={segment.world_size}")
    epoch, start, k = _walk(segment, micro, batches_of, tail)
    virtual = start + rank + segment.world_size * k
    total = batches_of(epoch)
    index = virtual if virtual < total else (virtual - total) % max(total, 1)
    return epoch, index, virtual


def cursor_of_micro(
    segment: Segment, micro: int, batches_of: BatchCounts, tail: str
) -> tuple[int, int]:
    """The global cursor ``(epoch, consumed)`` once every rank read ``micro`` micro-batches."""
    epoch, start, k = _walk(segment, micro, batches_of, tail)
    return epoch, start + segment.world_size * k


def check_on_segment(segment: Segment, epoch: int, consumed: int) -> None:
    """Refuse (StateError) a cursor before the segment or off its ranks' grid (no counting)."""
    start = segment.consumed if epoch == segment.epoch else 0
    if (epoch, consumed) < (segment.epoch, segment.consumed) or (consumed - start) % (
        segment.world_size
    ):
        raise StateError(
            f"reader state: cursor {consumed} of epoch {epoch} is not a position of the run's "
            f"segment from cursor {segment.consumed} of epoch {segment.epoch} at world size "
            f"{segment.world_size}; pass a state of this run"
        )


def micro_of_cursor(
    segment: Segment, epoch: int, consumed: int, batches_of: BatchCounts, tail: str
) -> int:
    """Micro-batches every rank read from the segment's start to cursor ``(epoch, consumed)``.

    Raises StateError for a cursor before the segment or off its ranks' grid.
    """
    check_on_segment(segment, epoch, consumed)
    micro, at, start = 0, segment.epoch, segment.consumed
    while at < epoch:
        micro += _per_rank(segment, at, start, batches_of, tail)
        at, start = at + 1, 0
    return micro + (consumed - start) // segment.world_size


def parse_steps(text: str, name: str) -> tuple[int, int]:
    """``"a:b"`` as the half-open step range ``(a, b)`` (ConfigError naming ``name``)."""
    first, sep, end = text.partition(":")
    try:
        a, b = int(first), int(end)
    except ValueError:
        a = b = -1
    if not sep or a < 0 or b <= a:
        raise ConfigError(
            f"{name}: got {text!r}, expected FIRST:END, two integers 0 <= FIRST < END "
            "(steps FIRST .. END - 1)"
        )
    return a, b


def check_ranges(ranges: Any, name: str) -> list[tuple[int, int]]:
    """Step ranges ``[(a, b), ...]`` checked: half-open, ascending, disjoint."""
    out: list[tuple[int, int]] = []
    for item in ranges:
        if isinstance(item, str):
            out.append(parse_steps(item, name))
            continue
        try:
            a, b = item
        except (TypeError, ValueError):
            a = b = None
        ok = all(isinstance(v, int) and not isinstance(v, bool) for v in (a, b))
        if not ok or a < 0 or b <= a:  # type: ignore[operator]
            raise ConfigError(
                f"{name}: got {item!r}, expected a pair (first, end) of integers with "
                "0 <= first < end: steps first .. end - 1"
            )
        out.append((int(a), int(b)))  # type: ignore[arg-type]
    out.sort()
    for (a0, b0), (a1, b1) in itertools.pairwise(out):
        if a1 < b0:
            raise ConfigError(f"{name}: ranges ({a0}, {b0}) and ({a1}, {b1}) overlap")
    return out


def merge_counts(
    known: Mapping[int, int], more: Mapping[int, int], what: str = "global batches"
) -> dict[int, int]:
    """Epoch batch counts of two records together (StateError where they disagree)."""
    out = dict(known)
    for epoch, count in more.items():
        if out.setdefault(epoch, count) != count:
            raise StateError(
                f"run record: epoch {epoch} has {out[epoch]} {what} here but "
                f"{count} in the state; the state is of another run or plan"
            )
    return out


# --------------------------------------------------------------------------------------------
# How the reader was opened
# --------------------------------------------------------------------------------------------

#: The transforms a record can rebuild from their fields (others are named, and passed again).
KNOWN_TRANSFORMS: dict[str, type] = {"FIM": FIM, "SpanMask": SpanMask}


def _transform_json(step: Any) -> dict[str, Any]:
    name = type(step).__name__
    if KNOWN_TRANSFORMS.get(name) is type(step):
        return {"class": name, "fields": asdict(step)}
    return {"class": f"{type(step).__module__}.{type(step).__qualname__}", "repr": repr(step)}


def _where(path: str | os.PathLike[str]) -> str:
    """A source's path as recorded: URLs as given, local folders absolute (any cwd reopens)."""
    return os.fspath(path) if is_url(path) else os.path.abspath(path)


def dataset_spec(
    path: Any,
    digests: list[str],
    *,
    split: str | None,
    splits: Split | None,
    eval: bool,
    tokens_per_epoch: int | None,
    schedule: Schedule | None,
    ids_dtype: str,
    attention: str | None,
    transform: Any,
) -> dict[str, Any]:
    """The ``dataset`` part of a run record: what reopens the reader (JSON-able)."""
    mixture = not isinstance(path, (str, os.PathLike))
    sources: list[dict[str, Any]] = []
    if mixture:
        for source, digest in zip(as_sources(path), digests):
            sources.append({
                "path": _where(source.path), "name": source.label, "digest": digest,
                "weight": source.weight, "max_repetitions": source.max_repetitions,
                "splits": None if source.splits is None else source.splits.to_json(),
            })  # fmt: skip
    else:
        sources.append({"path": _where(path), "digest": digests[0]})
    steps = None
    if transform is not None:
        chain = transform if isinstance(transform, (list, tuple)) else [transform]
        steps = [_transform_json(step) for step in chain]
    return {
        "mixture": mixture,
        "sources": sources,
        "split": split,
        "splits": None if splits is None else splits.to_json(),
        "eval": eval,
        "tokens_per_epoch": tokens_per_epoch,
        "schedule": None if schedule is None else schedule.to_json(),
        "ids_dtype": ids_dtype,
        "attention": attention,
        "transform": steps,
    }


def dataset_arguments(spec: dict[str, Any], transform: Any = None) -> dict[str, Any]:
    """``ShardDataset`` keywords (``path`` among them) that reopen a recorded reader.

    ``transform``: the transform(s) to use in place of the recorded ones (required when a
    recorded one is not a built-in: a user's callable cannot be rebuilt from JSON).
    """
    sources = spec["sources"]
    if spec.get("mixture"):
        path: Any = [
            Source(s["path"], s["weight"], s["max_repetitions"], s["name"],
                   splits=None if s.get("splits") is None else Split(**s["splits"]))
            for s in sources
        ]  # fmt: skip
    else:
        path = sources[0]["path"]
    recorded = spec.get("transform")
    if transform is None and recorded:
        unknown = [t["class"] for t in recorded if "fields" not in t]
        if unknown:
            raise ConfigError(
                f"run record: the run used the transform(s) {unknown}, which a record cannot "
                "rebuild; pass transform= (Python) with the same transform(s), in order"
            )
        steps = [KNOWN_TRANSFORMS[t["class"]](**t["fields"]) for t in recorded]
        transform = steps[0] if len(steps) == 1 else steps
    splits = spec.get("splits")
    schedule = spec.get("schedule")
    return {
        "path": path,
        "split": spec.get("split"),
        "splits": None if splits is None else Split(**splits),
        "eval": bool(spec.get("eval")),
        "tokens_per_epoch": spec.get("tokens_per_epoch"),
        "schedule": None if schedule is None else Schedule.from_json(schedule),
        "ids_dtype": spec.get("ids_dtype", "int32"),
        "attention": spec.get("attention"),
        "transform": transform,
    }


# --------------------------------------------------------------------------------------------
# A reader's run: what it loaded, how it resumed, what it skipped
# --------------------------------------------------------------------------------------------


class RunLog:
    """A reader's side of its run record: the history a loaded state brought, and skips.

    ``ShardDataset`` holds one; ``record`` composes the record for its state and files.
    """

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        #: micro-batches per rank and step (None: the loaded run's, else 1)
        self.grad_accum: int | None = None
        self.segments: tuple[Segment, ...] = ()  # the loaded run's
        self.resumed: tuple[int, int, int, int] | None = None  # (step, micro, epoch, consumed)
        #: the loaded state's segment, cursor and tail, for ``resumed`` (None: nothing loaded)
        self._pending: tuple[Segment, int, int, str] | None = None
        self.skipped: tuple[SkippedSteps, ...] = ()
        self.counts: dict[int, int] = {}
        self.rounds: dict[int, int] = {}  # epochs of whole stream rounds: their stream length
        self.exclusions: tuple[Exclusion, ...] = ()  # by position

    def planned(self, epoch: int, plan: EpochPlan | StreamPlan) -> int:
        """Note an epoch's plan: its global batch count, and its stream length if whole rounds."""
        total = len(plan)
        self.counts[epoch] = total
        if isinstance(plan, StreamPlan) and total and total == plan.full:
            self.rounds[epoch] = total // plan.layout.streams
        return total

    def accumulation(self) -> int:
        """The gradient accumulation in force."""
        if self.grad_accum is not None:
            return self.grad_accum
        return self.segments[-1].grad_accum if self.segments else 1

    def record(
        self,
        cache_digest: str,
        seed: int,
        plan: dict[str, Any],
        world_size: int,
        batches_of: BatchCounts,
    ) -> RunRecord:
        """The run record of a reader with these values (``batches_of``: an epoch's count)."""
        accum = self.accumulation()
        segments = self.segments
        if not segments:  # a run from its start
            segments = (Segment(0, 0, 0, 0, world_size, accum),)
        elif self._pending is not None and (
            segments[-1].world_size,
            segments[-1].grad_accum,
        ) != (world_size, accum):  # resumed in another shape: a segment from the resume on
            step, micro, epoch, consumed = self._resolve(batches_of)
            if (segments[-1].step, segments[-1].micro) == (step, micro):
                segments = segments[:-1]  # (it starts where the last one does: replaces it)
            segments = (*segments, Segment(step, micro, epoch, consumed, world_size, accum))
        return RunRecord(
            self.spec, cache_digest, seed, plan, segments, self.skipped, dict(self.counts),
            dict(self.rounds), self.exclusions,
        )  # fmt: skip

    def resume(
        self,
        state: dict[str, Any],
        cursor: tuple[int, int],
        batches_of: BatchCounts,
        tail: str,
        skip_steps: Any,
        remixed: bool = False,
    ) -> tuple[int, int] | None:
        """Take a loaded state's run; with ``skip_steps``, the cursor to continue from.

        A state without a run record (taken before records) starts one at its cursor, its
        steps counted from there; a ``remixed`` state's epoch batch counts are of its own
        mixture (not taken). Returns None when the cursor stays.
        """
        epoch, consumed = cursor
        theirs = state.get("run")
        if isinstance(theirs, dict):
            history = RunRecord.from_json(theirs)
            if not remixed:
                self.counts = merge_counts(self.counts, history.epoch_batches)
                self.rounds = merge_counts(self.rounds, history.epoch_rounds, "batches a stream")
            segment = history.segments[-1]
            self.segments, self.skipped = history.segments, history.skipped
            self.exclusions = history.exclusions
        else:
            world = state.get("world_size")
            world = world if isinstance(world, int) and world >= 1 else 1
            segment = Segment(0, 0, epoch, consumed, world, self.grad_accum or 1)
            self.segments, self.skipped, self.exclusions = (segment,), (), ()
        counted = self._counted(batches_of)
        check_on_segment(segment, epoch, consumed)
        # the step of the cursor needs the batch counts of every epoch since the segment's
        # start (planning the ones the record lacks): only a skip, or a record of a run that
        # changed shape, asks for it, so a plain resume never plans past epochs
        self.resumed, self._pending = None, (segment, epoch, consumed, tail)
        ranges = check_ranges(skip_steps or (), "skip_steps")
        if not ranges:
            return None
        step, within, _, _ = self._resolve(batches_of)
        moved = None
        for first, end in ranges:
            if end <= step:
                continue  # read (or skipped) before this state
            if first > step:
                raise ConfigError(
                    f"skip_steps: ({first}, {end}) starts after the state's step {step}; a "
                    "skip moves the cursor when a state is loaded, so load a checkpoint taken "
                    f"at a step in [{first}, {end}), or skip ({step}, {end})"
                )
            if moved is not None:
                raise ConfigError(f"skip_steps: several ranges contain the state's step {step}")
            if within:
                raise ConfigError(
                    f"skip_steps: the state was taken {within} micro-batches into step {step} "
                    f"(grad_accum {segment.grad_accum}); skip from a state taken between steps"
                )
            target = micro_index(segment, end)
            moved = cursor_of_micro(segment, target, counted, tail)
            skip = SkippedSteps(first, end, step, epoch, consumed, *moved)
            self.skipped = (*self.skipped, skip)
            self.resumed = (step, 0, *moved)
            # the trainer counts on from ``step``, reading ``end``'s batches: a segment of its own
            self.segments = tuple(s for s in self.segments if (s.step, s.micro) < (step, 0))
            self.segments = (*self.segments, Segment(step, 0, *moved, segment.world_size,
                                                     segment.grad_accum))  # fmt: skip
        return moved

    def _resolve(self, batches_of: BatchCounts) -> tuple[int, int, int, int]:
        """``resumed`` of the loaded state: its step and micro-batch, and its cursor."""
        if self.resumed is None:
            assert self._pending is not None  # (resume() took a state)
            segment, epoch, consumed, tail = self._pending
            counted = self._counted(batches_of)
            micro = micro_of_cursor(segment, epoch, consumed, counted, tail) + segment.micro
            step, within = segment.step + micro // segment.grad_accum, micro % segment.grad_accum
            self.resumed = (step, within, epoch, consumed)
        return self.resumed

    def _counted(self, batches_of: BatchCounts) -> BatchCounts:
        def count(epoch: int) -> int:
            if epoch not in self.counts:
                self.counts[epoch] = batches_of(epoch)
            return self.counts[epoch]

        return count

    def stats(self) -> list[dict[str, Any]]:
        """The skipped step ranges, for ``ShardDataset.stats()``."""
        return [asdict(s) for s in self.skipped]
