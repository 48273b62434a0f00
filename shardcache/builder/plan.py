"""Partition planning and resume records: what a build will do, and what it already did.

* **plan** lists the inputs in a deterministic order and cuts them into partitions with
  stable ids ``p00000``, ``p00001`` ... in (file, position) order: one per input file, or
  several for an uncompressed jsonl / parquet file larger than ``partition_size_bytes``
  (byte ranges cut at line boundaries / runs of row groups, see
  :func:`~shardcache.builder.sources.split_input`; compressed files stay whole). The plan, the
  sha256 of every split file and an options fingerprint are written to ``parts/build.json``.
* **resume**: when the output has ``parts/build.json`` with the same fingerprint (options
  except output/force/workers, and every input's path, size and mtime) and no manifest,
  :func:`prepare_output` keeps every partition whose completion record exists and whose
  shards have the recorded sizes (:func:`completed_result`), deletes everything else, and
  the build runs the rest. A different fingerprint is refused, naming what changed, unless
  ``--force`` starts over. Job-array shares use :func:`share_plan` and
  :func:`clean_partitions`, which touch only the share's own partitions.
* **URL outputs** keep the same files in the store and resume from them on any machine:
  :func:`prepare_store_output` / :func:`share_plan_in_store` read or write the plan there,
  :func:`completed_in_store` checks the records found in one listing of ``parts/`` and one of
  ``shards/`` with the same rule as local outputs (:func:`check_record`). Nothing is deleted
  on resume: a partition rebuilt rewrites its own object names, and the commit deletes
  objects no record lists.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from shardcache.builder.bucket import effective_edges
from shardcache.builder.remote import OutputStore
from shardcache.builder.sources import (
    InputFile,
    InputSlice,
    list_inputs,
    split_input,
)
from shardcache.builder.tokenize import TruncationStats
from shardcache.config import BuildOptions
from shardcache.errors import (
    CacheError,
)
from shardcache.store.files import (
    read_json_or_none,
    write_json_atomic,
)
from shardcache.store.layout import (
    BUILD_STATE,
    INDEX_DIR,
    LENGTHS_FILE,
    MANIFEST,
    PARTS_DIR,
    QUARANTINE,
    SHARD_DIR,
    SHARES_DIR,
)
from shardcache.store.shards import ShardInfo


@dataclass(frozen=True)
class Partition:
    """A unit of map work with a stable id: one input file or a slice of one."""

    id: str
    file: InputFile
    span: InputSlice = field(default_factory=InputSlice)
    nbytes: int = 0  # input bytes it reads (progress, scheduling)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "source": self.file.relpath, "nbytes": self.nbytes,
                **self.span.to_json()}  # fmt: skip


@dataclass
class BuildPlan:
    options: BuildOptions
    inputs: list[InputFile]
    partitions: list[Partition]
    edges: tuple[int, ...]
    #: sha256 of the input files that were split (hashed by the plan pass)
    file_sha256: dict[str, str] = field(default_factory=dict)
    fingerprint: str = ""


@dataclass
class PartitionResult:
    """What one partition produced (also persisted as ``parts/<id>.json``)."""

    partition: str
    source: str
    sha256: str  # of the whole input file for a whole-file partition, else ""
    shards: list[ShardInfo]
    stats: TruncationStats
    bad_records: dict[str, int]
    corrupt: list[dict[str, Any]] = field(default_factory=list)
    lint: dict[str, int] = field(default_factory=dict)  # chat lint counts of this partition
    #: The encoder backend of this partition and its in-build verification (backends.py):
    #: backend, version, verified (documents re-encoded with HF), mismatches, reencoded.
    encoding: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
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

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PartitionResult:
        return cls(
            partition=data["partition"],
            source=data["source"],
            sha256=data["sha256"],
            shards=[ShardInfo(**s) for s in data["shards"]],
            stats=TruncationStats(**data["stats"]),
            bad_records=dict(data["bad_records"]),
            corrupt=list(data.get("corrupt", [])),
            lint=dict(data.get("lint", {})),
            encoding=dict(data.get("encoding", {})),
        )


def options_json(options: BuildOptions) -> dict[str, Any]:
    """Options as recorded in the manifest (plain JSON: lists, not tuples): without what
    cannot change the bytes (``strict_lint`` and ``max_bad_fraction`` only decide whether to
    commit; ``encoding`` picks a backend whose ids are proven equal to the reference's)."""
    data = options.to_json()
    for key in ("force", "workers", "output", "strict_lint", "max_bad_fraction", "encoding"):
        data.pop(key, None)
    return json.loads(json.dumps(data))


def inputs_json(inputs: list[InputFile]) -> list[dict[str, Any]]:
    return [
        {"relpath": f.relpath, "size": f.size, "format": f.format,
         "mtime_ns": f.mtime_ns if f.mtime_ns is not None else os.stat(f.path).st_mtime_ns}
        for f in inputs
    ]  # fmt: skip


def fingerprint_of(options: dict[str, Any], inputs: list[dict[str, Any]]) -> str:
    blob = json.dumps({"options": options, "inputs": inputs}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def plan_build(options: BuildOptions, inputs: list[InputFile] | None = None) -> BuildPlan:
    """List and split the inputs (reads every file that is split once, to hash and cut it)."""
    inputs = (
        inputs
        if inputs is not None
        else list_inputs(options.source.inputs, exclude=[options.output])
    )
    partitions: list[Partition] = []
    hashes: dict[str, str] = {}
    for f in inputs:
        spans, sha = split_input(f, options.partition_size_bytes)
        if sha:
            hashes[f.relpath] = sha
        for k, span in enumerate(spans):
            if span.row_groups is not None:  # parquet: an even share of the file
                nbytes = f.size // len(spans) + (f.size % len(spans) if k == 0 else 0)
            else:
                nbytes = (span.end if span.end is not None else f.size) - span.start
            partitions.append(Partition(f"p{len(partitions):05d}", f, span, nbytes))
    edges = effective_edges(options.layout.bucket_edges, options.tokenize.max_length)
    fingerprint = fingerprint_of(options_json(options), inputs_json(inputs))
    return BuildPlan(options, inputs, partitions, edges, hashes, fingerprint)


def plan_to_json(plan: BuildPlan) -> dict[str, Any]:
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
    by_path = {f.relpath: f for f in inputs}
    partitions = [
        Partition(p["id"], by_path[p["source"]], InputSlice.from_json(p), int(p["nbytes"]))
        for p in state["partitions"]
    ]
    edges = effective_edges(options.layout.bucket_edges, options.tokenize.max_length)
    hashes = dict(state["sha256"])
    return BuildPlan(options, inputs, partitions, edges, hashes, state["fingerprint"])


def differences(old: Any, new: Any, path: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for key in sorted(set(old) | set(new)):
            out += differences(old.get(key), new.get(key), f"{path}.{key}" if path else key)
        return out
    return [] if old == new else [f"{path}: {old!r} -> {new!r}"]


def input_differences(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[str]:
    a = {f["relpath"]: f for f in old}
    b = {f["relpath"]: f for f in new}
    out = [f"input {p}: removed" for p in sorted(set(a) - set(b))]
    out += [f"input {p}: added" for p in sorted(set(b) - set(a))]
    out += [f"input {p}: changed (size/mtime)" for p in sorted(set(a) & set(b)) if a[p] != b[p]]
    return out


def wipe_output(out: str) -> None:
    for sub in (SHARD_DIR, PARTS_DIR, INDEX_DIR):
        shutil.rmtree(os.path.join(out, sub), ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(out, QUARANTINE))
    for sub in (SHARD_DIR, PARTS_DIR, INDEX_DIR):
        os.makedirs(os.path.join(out, sub), exist_ok=True)


def completed_result(
    out: str, partition: Partition, shard_sizes: Mapping[str, int] | None = None
) -> PartitionResult | None:
    """The partition's completion record, if it and every file it lists are intact
    (``shard_sizes``: the shard folder listed once, for callers checking many partitions)."""
    data = read_json_or_none(os.path.join(out, PARTS_DIR, f"{partition.id}.json"))

    def shard_size(name: str) -> int | None:
        if shard_sizes is not None:
            return shard_sizes.get(name)
        path = os.path.join(out, SHARD_DIR, name)
        return os.path.getsize(path) if os.path.isfile(path) else None

    return check_record(
        data, partition, lambda name: os.path.isfile(os.path.join(out, PARTS_DIR, name)), shard_size
    )


def check_record(
    data: dict[str, Any] | None,
    partition: Partition,
    has_part_file: Callable[[str], bool],
    shard_size: Callable[[str], int | None],
) -> PartitionResult | None:
    """A completion record, if it is whole, belongs to ``partition`` and its files are all
    there (``parts/<id>.lengths.npy`` and ``.quarantine.jsonl``, every shard at its size)."""
    if data is None:
        return None
    try:
        result = PartitionResult.from_json(data)
    except (KeyError, TypeError, ValueError):
        return None
    if result.partition != partition.id or result.source != partition.file.relpath:
        return None
    for name in (f"{partition.id}.lengths.npy", f"{partition.id}.quarantine.jsonl"):
        if not has_part_file(name):
            return None
    for shard in result.shards:
        if shard_size(shard.name) != shard.bytes:
            return None
    return result


def completed_in_store(
    store: OutputStore, partitions: list[Partition]
) -> dict[str, PartitionResult]:
    """The partitions of a URL output whose completion records check out (one listing of
    ``parts/`` and one of ``shards/``, the records read concurrently)."""
    parts = store.sizes(PARTS_DIR)
    shards = store.sizes(SHARD_DIR)
    names = [f"{PARTS_DIR}/{p.id}.json" for p in partitions if f"{p.id}.json" in parts]
    records = store.read_many(names)
    done: dict[str, PartitionResult] = {}
    for p in partitions:
        raw = records.get(f"{PARTS_DIR}/{p.id}.json")
        try:
            data = json.loads(raw) if raw is not None else None
        except (ValueError, RecursionError):
            data = None
        result = check_record(data if isinstance(data, dict) else None, p, parts.__contains__,
                              shards.get)  # fmt: skip
        if result is not None:
            done[p.id] = result
    return done


def _fingerprint_refused(out: str, state: dict[str, Any], options: BuildOptions,
                         inputs: list[InputFile]) -> CacheError:  # fmt: skip
    changes = differences(state.get("options"), options_json(options))
    changes += input_differences(state.get("inputs") or [], inputs_json(inputs))
    return CacheError(
        f"{out!r} holds an interrupted build with other options or inputs "
        f"({'; '.join(changes[:8]) or 'fingerprint differs'}); its partitions cannot be "
        "reused: rerun with the original options to resume it, pass --force to discard it "
        "and start over, or choose another --output"
    )


def prepare_store_output(
    options: BuildOptions, inputs: list[InputFile], store: OutputStore
) -> tuple[BuildPlan, dict[str, PartitionResult]]:
    """:func:`prepare_output` for a URL output, from what the store holds (any machine).

    The manifest must be gone already (the caller removes it first for ``--force``). A
    matching plan in the store is resumed with the partitions whose records check out; none
    (or ``--force``) deletes the build's objects and writes a new plan first.
    """
    state = store.read_json(f"{PARTS_DIR}/{BUILD_STATE}")
    fingerprint = fingerprint_of(options_json(options), inputs_json(inputs))
    if state is not None and state.get("fingerprint") != fingerprint and not options.force:
        raise _fingerprint_refused(options.output, state, options, inputs)
    if state is None or options.force:
        store.remove([QUARANTINE, LENGTHS_FILE])
        store.remove_folders([SHARD_DIR, PARTS_DIR, INDEX_DIR, SHARES_DIR])
        plan = plan_build(options, inputs)
        store.write_json(f"{PARTS_DIR}/{BUILD_STATE}", plan_to_json(plan))
        return plan, {}
    plan = plan_from_json(state, options, inputs)
    return plan, completed_in_store(store, plan.partitions)


def share_plan_in_store(
    options: BuildOptions, inputs: list[InputFile], store: OutputStore
) -> BuildPlan:
    """:func:`share_plan` for a URL output: the plan in the store, or a new one written."""
    state = store.read_json(f"{PARTS_DIR}/{BUILD_STATE}")
    if state is None:
        plan = plan_build(options, inputs)
        store.write_json(f"{PARTS_DIR}/{BUILD_STATE}", plan_to_json(plan))  # all shares: same
        return plan
    _check_share_fingerprint(options, inputs, state)
    return plan_from_json(state, options, inputs)


def prepare_output(
    options: BuildOptions, inputs: list[InputFile]
) -> tuple[BuildPlan, dict[str, PartitionResult]]:
    """Start a new build or resume an interrupted one; returns the plan and completed parts.

    Called with the build lock held.
    """
    out = options.output
    if os.path.exists(os.path.join(out, MANIFEST)):
        if not options.force:
            raise CacheError(
                f"{out!r} already holds a committed cache; pass --force to rebuild it, or "
                "choose another --output"
            )
        os.remove(os.path.join(out, MANIFEST))  # first: readers stop seeing the old cache
    if os.path.exists(out) and not os.path.isdir(out):
        raise CacheError(f"--output {out!r} exists and is not a folder; choose another path")
    state = read_json_or_none(os.path.join(out, PARTS_DIR, BUILD_STATE))
    options_now, inputs_now = options_json(options), inputs_json(inputs)
    fingerprint = fingerprint_of(options_now, inputs_now)
    if state is not None and state.get("fingerprint") != fingerprint and not options.force:
        raise _fingerprint_refused(out, state, options, inputs)
    if state is None or options.force:
        wipe_output(out)
        plan = plan_build(options, inputs)
        write_json_atomic(os.path.join(out, PARTS_DIR, BUILD_STATE), plan_to_json(plan))
        return plan, {}
    plan = plan_from_json(state, options, inputs)
    done: dict[str, PartitionResult] = {}
    for partition in plan.partitions:
        result = completed_result(out, partition)
        if result is not None:
            done[partition.id] = result
    # delete everything that is not a completed partition's: half-written shards, *.tmp
    keep = {s.name for r in done.values() for s in r.shards}
    for name in os.listdir(os.path.join(out, SHARD_DIR)):
        if name not in keep:
            os.remove(os.path.join(out, SHARD_DIR, name))
    for name in os.listdir(os.path.join(out, PARTS_DIR)):
        stray = name != BUILD_STATE and name.split(".", 1)[0] not in done
        if stray or name.endswith(".tmp"):
            os.remove(os.path.join(out, PARTS_DIR, name))
    shutil.rmtree(os.path.join(out, INDEX_DIR), ignore_errors=True)
    os.makedirs(os.path.join(out, INDEX_DIR), exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(out, QUARANTINE))
    return plan, done


def share_plan(options: BuildOptions, inputs: list[InputFile]) -> BuildPlan:
    path = os.path.join(options.output, PARTS_DIR, BUILD_STATE)
    state = read_json_or_none(path)
    if state is None:
        plan = plan_build(options, inputs)
        write_json_atomic(
            path, plan_to_json(plan), private=True
        )  # every share computes the same plan
        return plan
    _check_share_fingerprint(options, inputs, state)
    return plan_from_json(state, options, inputs)


def _check_share_fingerprint(
    options: BuildOptions, inputs: list[InputFile], state: dict[str, Any]
) -> None:
    fingerprint = fingerprint_of(options_json(options), inputs_json(inputs))
    if state.get("fingerprint") != fingerprint:
        raise CacheError(
            f"{options.output!r} holds a build with other options or inputs (fingerprint "
            f"{str(state.get('fingerprint'))[:12]} vs. {fingerprint[:12]}); every share of a "
            "job array must use the same options and inputs: fix the command, or delete the "
            "output to start over"
        )


def clean_partitions(out: str, ids: list[str]) -> None:
    """Remove the leftovers of the partitions ``ids`` (this share's, about to be (re)built),
    and nothing else.

    Shares of a job array run at once in one folder: another share's in-flight files
    (``*.arrow.tmp``, ``*.quarantine.jsonl.tmp``, ``*.lengths.npy.tmp``, a private
    ``build.json.<pid>.<random>.tmp``) belong to partitions it owns, or to no partition, and
    are never touched here. Leftovers of a killed share are removed when that share reruns
    (they are its pending partitions'); stray shards at commit (:mod:`.commit`).
    """
    pending = set(ids)
    for sub in (SHARD_DIR, PARTS_DIR):
        folder = os.path.join(out, sub)
        for name in os.listdir(folder):
            owner = name.split("-", 1)[0] if sub == SHARD_DIR else name.split(".", 1)[0]
            if owner in pending:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(folder, name))


def options_from_json(data: Mapping[str, Any], output: str) -> BuildOptions:
    """Rebuild :class:`BuildOptions` from the options recorded in ``parts/build.json``."""

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
