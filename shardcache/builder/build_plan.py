"""The build plan: what a build will do, which part of it a process runs, what it did.

Partitions have stable ids ``p00000``... in (file, position) order: a large file is cut into
slices, consecutive small files are gathered into one partition. The plan, split files'
sha256 and an options/inputs fingerprint are written to ``parts/build.json`` before any
partition runs. A recorded plan with the same fingerprint is resumed (completed partitions
are kept); another fingerprint is refused unless ``--force``, or unless that build kept no
shard (nothing to lose, so it is replaced). Resume deletes nothing: the
commit removes files no record lists.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shardcache.builder.bucket import effective_edges
from shardcache.builder.sources import (
    InputFile,
    InputSlice,
    check_corpus_files,
    list_inputs,
    split_input,
)
from shardcache.builder.tokenize import TruncationStats
from shardcache.config import BuildOptions
from shardcache.errors import CacheError, ConfigError
from shardcache.store.layout import (
    BUILD_STATE,
    INDEX_DIR,
    LENGTHS_FILE,
    PARTS_DIR,
    QUARANTINE,
    SHARD_DIR,
    SHARES_DIR,
    share_name,
)
from shardcache.store.shards import ShardInfo
from shardcache.store.storage import Storage

#: Files smaller than ``partition_size / GROUP_DIVISOR`` may be gathered into one partition: a
#: partition's fixed cost (threads, shard and record files, fsyncs) is then paid once per
#: group, not per tiny file, while files of mid size keep a partition each.
GROUP_DIVISOR = 16
#: Groups hold at most 1/GROUP_SPREAD of the small files' bytes: a corpus of small files
#: still gives about this many partitions (work for every core), and a few files stay apart.
GROUP_SPREAD = 64


def group_bytes(inputs: list[InputFile], partition_size_bytes: int) -> int:
    """The most bytes of consecutive small files one partition gathers.

    A file of at least this size is never grouped: ``partition_size_bytes // GROUP_DIVISOR``, or
    less so that the files under that size make about ``GROUP_SPREAD`` partitions.
    """
    cap = partition_size_bytes // GROUP_DIVISOR
    small = sum(f.size for f in inputs if f.size < cap)
    return min(cap, small // GROUP_SPREAD)


@dataclass(frozen=True)
class Partition:
    """A unit of map work with a stable id (``p00042``): a file, a slice of one, or a group.

    It reads ``file`` over ``span``, then the whole files ``more`` (a group of small files);
    ``nbytes`` is the input bytes it reads (progress, scheduling).
    """

    id: str
    file: InputFile
    span: InputSlice = field(default_factory=InputSlice)
    nbytes: int = 0
    more: tuple[InputFile, ...] = ()

    @property
    def files(self) -> tuple[InputFile, ...]:
        """The input files it reads, in order."""
        return (self.file, *self.more)

    def to_json(self) -> dict[str, Any]:
        """The partition as recorded in ``parts/build.json``."""
        data = {"id": self.id, "source": self.file.relpath, "nbytes": self.nbytes,
                **self.span.to_json()}  # fmt: skip
        if self.more:
            data["sources"] = [f.relpath for f in self.files]
        return data


@dataclass
class BuildPlan:
    """What a build does: its inputs, partitions in id order and bucket edges.

    ``file_sha256`` holds the files the plan pass split (and so hashed); ``fingerprint``
    identifies the options and inputs: resume refuses another one.
    """

    options: BuildOptions
    inputs: list[InputFile]
    partitions: list[Partition]
    edges: tuple[int, ...]
    file_sha256: dict[str, str] = field(default_factory=dict)
    fingerprint: str = ""


@dataclass(frozen=True)
class Share:
    """Share ``index`` of ``count`` in a job array: the partitions ``k % count == index``.

    Round-robin, so every share gets large and small files alike when sizes follow names. An
    ``index`` outside ``0 .. count - 1`` raises ``ConfigError``.
    """

    index: int
    count: int

    def __post_init__(self) -> None:
        if not (isinstance(self.count, int) and self.count >= 1 and 0 <= self.index < self.count):
            raise ConfigError(
                f"partition: got {self.index}/{self.count}, expected i/N with N >= 1 and "
                "0 <= i < N (e.g. --partition $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT)"
            )

    @classmethod
    def parse(cls, text: str) -> Share:
        """The share written ``i/N``; ``ConfigError`` when ``text`` is not that."""
        try:
            i, n = (int(v) for v in str(text).split("/"))
        except ValueError:
            raise ConfigError(
                f"partition: cannot read {text!r}; expected i/N, e.g. 0/4 (share 0 of 4)"
            ) from None
        return cls(i, n)

    @property
    def name(self) -> str:
        """``share-i-of-N``: its lock folder and note under ``.shares/``."""
        return share_name(self.index, self.count)

    def owns(self, position: int) -> bool:
        """Whether the partition at ``position`` in the plan is this share's."""
        return position % self.count == self.index

    def select(self, partitions: list[Partition]) -> list[Partition]:
        """This share's partitions, in plan order."""
        return [p for k, p in enumerate(partitions) if self.owns(k)]


@dataclass
class PartitionResult:
    """What one partition produced (also persisted as ``parts/<id>.json``).

    ``sha256`` is the whole input file's for a whole-file partition, else ``""``. ``timings``
    (CPU seconds per stage) are reported, never recorded: bytes never depend on timing. ``files``
    lists a group's files in order (empty for a one-file partition).
    """

    partition: str
    source: str
    sha256: str
    shards: list[ShardInfo]
    stats: TruncationStats
    bad_records: dict[str, int]
    corrupt: list[dict[str, Any]] = field(default_factory=list)
    lint: dict[str, int] = field(default_factory=dict)
    encoding: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    files: list[dict[str, Any]] = field(default_factory=list)

    def per_file(self) -> list[dict[str, Any]]:
        """``{"source", "sha256", "documents", "bad_records"}`` per input file, in order."""
        if self.files:
            return self.files
        return [{"source": self.source, "sha256": self.sha256, "documents": self.stats.documents,
                 "bad_records": sum(self.bad_records.values())}]  # fmt: skip

    def to_message(self) -> dict[str, Any]:
        """What a worker sends back to the build: the record and the timings."""
        return {**self.to_json(), "timings": self.timings}

    def to_json(self) -> dict[str, Any]:
        """The completion record ``parts/<id>.json`` (no timings)."""
        data = {
            "partition": self.partition,
            "source": self.source,
            "sha256": self.sha256,
            "shards": [s.to_json() for s in self.shards],
            "stats": self.stats.to_json(),
            "bad_records": dict(sorted(self.bad_records.items())),
            "corrupt": self.corrupt,
            "lint": dict(sorted(self.lint.items())),
            "encoding": self.encoding,
        }
        if self.files:
            data["files"] = self.files
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PartitionResult:
        """The result ``to_json`` or ``to_message`` recorded."""
        return cls(
            partition=data["partition"],
            source=data["source"],
            sha256=data["sha256"],
            # a shard of several files has ``sources`` instead of ``source`` (to_json drops None)
            shards=[ShardInfo(**{"source": None, **s}) for s in data["shards"]],
            stats=TruncationStats(**data["stats"]),
            bad_records=dict(data["bad_records"]),
            corrupt=list(data.get("corrupt", [])),
            lint=dict(data.get("lint", {})),
            encoding=dict(data.get("encoding", {})),
            timings=dict(data.get("timings", {})),
            files=[dict(f) for f in data.get("files", [])],
        )


def options_json(options: BuildOptions) -> dict[str, Any]:
    """Options as recorded in the manifest (plain JSON), less those that cannot change bytes."""
    data = options.to_json()
    for key in ("force", "workers", "output", "strict_lint", "max_bad_fraction", "encoding"):
        data.pop(key, None)
    if not data["source"]["exclude"]:  # so builds without it keep their fingerprints
        del data["source"]["exclude"]
    return json.loads(json.dumps(data))


def inputs_json(inputs: list[InputFile]) -> list[dict[str, Any]]:
    """``relpath``, ``size``, ``format`` and ``mtime_ns`` of each input, as the plan records."""
    return [
        {"relpath": f.relpath, "size": f.size, "format": f.format,
         "mtime_ns": f.mtime_ns if f.mtime_ns is not None else os.stat(f.path).st_mtime_ns}
        for f in inputs
    ]  # fmt: skip


def fingerprint_of(options: BuildOptions, inputs: list[InputFile]) -> str:
    """The hex sha256 of a build's recorded options and inputs: another cannot resume it."""
    blob = json.dumps({"options": options_json(options), "inputs": inputs_json(inputs)},
                      sort_keys=True)  # fmt: skip
    return hashlib.sha256(blob.encode()).hexdigest()


def what_changed(state: dict[str, Any], options: BuildOptions, inputs: list[InputFile]) -> str:
    """At most 8 differences between a recorded plan and this build, joined by ``"; "``."""
    changes = differences(state.get("options"), options_json(options))
    changes += input_differences(state.get("inputs") or [], inputs_json(inputs))
    return "; ".join(changes[:8])


def plan_build(options: BuildOptions, inputs: list[InputFile] | None = None) -> BuildPlan:
    """The plan of a build: its inputs listed (unless given) and split into partitions.

    Files over ``partition_size`` are cut into slices (each read once, to hash and cut it);
    consecutive files under ``group_bytes`` are gathered up to that many bytes; every other file
    is a partition of its own. A file none of whose first records is a corpus record, beside
    files that hold some, is a ``SourceError`` (``check_corpus_files``).
    """
    source = options.source
    inputs = (
        inputs
        if inputs is not None
        else list_inputs(source.inputs, exclude=[options.output], exclude_globs=source.exclude)
    )
    check_corpus_files(inputs, source.text_field, options.kind)
    partitions: list[Partition] = []
    hashes: dict[str, str] = {}
    most = group_bytes(inputs, options.partition_size_bytes)
    group: list[InputFile] = []  # consecutive small files not yet in a partition
    grouped = 0  # their bytes

    def add(file: InputFile, span: InputSlice, nbytes: int, more: list[InputFile]) -> None:
        partitions.append(Partition(f"p{len(partitions):05d}", file, span, nbytes, tuple(more)))

    def close_group() -> None:
        nonlocal grouped
        if group:
            add(group[0], InputSlice(), grouped, group[1:])
            group.clear()
            grouped = 0

    for f in inputs:
        if f.size < most:
            if grouped + f.size > most:
                close_group()
            group.append(f)
            grouped += f.size
            continue
        close_group()
        spans, sha = split_input(f, options.partition_size_bytes)
        if sha:
            hashes[f.relpath] = sha
        for k, span in enumerate(spans):
            if span.row_groups is not None:  # parquet: an even share of the file
                nbytes = f.size // len(spans) + (f.size % len(spans) if k == 0 else 0)
            else:
                nbytes = (span.end if span.end is not None else f.size) - span.start
            add(f, span, nbytes, [])
    close_group()
    edges = effective_edges(options.layout.bucket_edges, options.tokenize.max_length)
    fingerprint = fingerprint_of(options, inputs)
    return BuildPlan(options, inputs, partitions, edges, hashes, fingerprint)


def plan_to_json(plan: BuildPlan) -> dict[str, Any]:
    """The plan as recorded in ``parts/build.json``."""
    return {
        "fingerprint": plan.fingerprint,
        "options": options_json(plan.options),
        "inputs": inputs_json(plan.inputs),
        "partitions": [p.to_json() for p in plan.partitions],
        "sha256": dict(sorted(plan.file_sha256.items())),
    }


def plan_from_json(
    state: dict[str, Any], options: BuildOptions, inputs: list[InputFile]
) -> BuildPlan:
    """The plan ``plan_to_json`` recorded; KeyError if a source is not among ``inputs``."""
    by_path = {f.relpath: f for f in inputs}
    partitions = []
    for p in state["partitions"]:
        files = [by_path[s] for s in p.get("sources") or [p["source"]]]
        partitions.append(Partition(p["id"], files[0], InputSlice.from_json(p), int(p["nbytes"]),
                                    tuple(files[1:])))  # fmt: skip
    edges = effective_edges(options.layout.bucket_edges, options.tokenize.max_length)
    hashes = dict(state["sha256"])
    return BuildPlan(options, inputs, partitions, edges, hashes, state["fingerprint"])


def differences(old: Any, new: Any, path: str = "") -> list[str]:
    """``"field.path: old -> new"`` per leaf that differs between two JSON values."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for key in sorted(set(old) | set(new)):
            out += differences(old.get(key), new.get(key), f"{path}.{key}" if path else key)
        return out
    return [] if old == new else [f"{path}: {old!r} -> {new!r}"]


def input_differences(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[str]:
    """A line per input removed, added or changed (size/mtime)."""
    a = {f["relpath"]: f for f in old}
    b = {f["relpath"]: f for f in new}
    out = [f"input {p}: removed" for p in sorted(set(a) - set(b))]
    out += [f"input {p}: added" for p in sorted(set(b) - set(a))]
    out += [f"input {p}: changed (size/mtime)" for p in sorted(set(a) & set(b)) if a[p] != b[p]]
    return out


def completed(storage: Storage, partitions: list[Partition]) -> dict[str, PartitionResult]:
    """Partition id -> result for each partition that is complete in ``storage``.

    Complete: its record is whole and every file it lists is there at its recorded size. One
    listing of ``parts/`` and one of ``shards/``; the records are read at once.
    """
    parts = storage.sizes(PARTS_DIR)
    shards = storage.sizes(SHARD_DIR)
    names = [f"{PARTS_DIR}/{p.id}.json" for p in partitions if f"{p.id}.json" in parts]
    records = storage.read_many(names)
    done: dict[str, PartitionResult] = {}
    for p in partitions:
        try:
            result = PartitionResult.from_json(json.loads(records[f"{PARTS_DIR}/{p.id}.json"]))
        except (KeyError, TypeError, ValueError, RecursionError):  # absent or damaged
            continue
        if (
            result.partition == p.id
            and result.source == p.file.relpath
            and f"{p.id}.lengths.npy" in parts
            and f"{p.id}.content_keys.npy" in parts  # (a version before content keys: redone)
            and f"{p.id}.quarantine.jsonl" in parts
            and all(shards.get(shard.name) == shard.bytes for shard in result.shards)
        ):
            done[p.id] = result
    return done


def kept_documents(storage: Storage, state: dict[str, Any]) -> bool:
    """Whether a recorded build's completion records list a shard: work a restart would lose.

    A build whose partitions all failed, or stored nothing (every record bad), kept nothing.
    """
    ids = [p.get("id") for p in state.get("partitions") or [] if isinstance(p, dict)]
    records = storage.read_many([f"{PARTS_DIR}/{i}.json" for i in ids if isinstance(i, str)])
    for data in records.values():
        try:
            if data is not None and json.loads(data)["shards"]:
                return True
        except (KeyError, TypeError, ValueError, RecursionError):  # damaged: not reusable
            continue
    return False


def _refused(location: str, state: dict[str, Any], options: BuildOptions,
             inputs: list[InputFile], share: Share | None) -> CacheError:  # fmt: skip
    what = what_changed(state, options, inputs) or "fingerprint differs"
    if share is not None:
        return CacheError(
            f"{location!r} holds a build with other options or inputs ({what}); every share of "
            "a job array must use the same options and inputs: fix the command, or delete the "
            "output to start over"
        )
    return CacheError(
        f"{location!r} holds an interrupted build with other options or inputs ({what}); its "
        "partitions cannot be reused: rerun with the original options to resume it, pass "
        "--force to discard it and start over, or choose another --output"
    )


def plan_output(
    storage: Storage, options: BuildOptions, inputs: list[InputFile], share: Share | None = None
) -> BuildPlan:
    """The plan of a build into ``storage``: the one recorded there, or a new one written.

    With ``--force`` (never a share) or no plan, the build's files are deleted (a share deletes
    none) and a new plan is written; every share of a job array computes the same one. Call it
    with the committed manifest gone and, locally, the build lock held. ``CacheError``: the
    output holds a build with other options or inputs that kept shards (or, for a share, any).
    """
    state = storage.read_json(f"{PARTS_DIR}/{BUILD_STATE}")
    fingerprint = fingerprint_of(options, inputs)
    if state is not None and state.get("fingerprint") != fingerprint and not options.force:
        if share is not None or kept_documents(storage, state):
            raise _refused(storage.location, state, options, inputs, share)
        state = None  # it kept nothing (e.g. a wrong --text-field): nothing to force away
    if state is not None and not options.force:
        return plan_from_json(state, options, inputs)
    if share is None:
        storage.remove([QUARANTINE, LENGTHS_FILE])
        storage.remove_folders([SHARD_DIR, PARTS_DIR, INDEX_DIR, SHARES_DIR])
    plan = plan_build(options, inputs)
    storage.write_json(f"{PARTS_DIR}/{BUILD_STATE}", plan_to_json(plan), private=True)
    return plan


def options_from_json(data: Mapping[str, Any], output: str) -> BuildOptions:
    """``BuildOptions`` rebuilt from ``parts/build.json``; unrecorded ones default."""

    def make(cls: type, values: Mapping[str, Any]) -> Any:
        hints = typing.get_type_hints(cls)
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name not in values:
                continue
            value, hint = values[f.name], hints.get(f.name)
            for arg in typing.get_args(hint):  # Optional[SomeOptions]: the dataclass in it
                if isinstance(arg, type) and dataclasses.is_dataclass(arg):
                    hint = arg
            if isinstance(hint, type) and dataclasses.is_dataclass(hint) and value is not None:
                value = make(hint, value)
            elif isinstance(value, list):
                value = tuple(value)
            kwargs[f.name] = value
        return cls(**kwargs)

    return make(BuildOptions, {**data, "output": output})
