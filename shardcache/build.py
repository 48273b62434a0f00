"""The build: plan -> map(partition) -> commit.

* **plan** lists the inputs in a deterministic order and cuts them into partitions with
  stable ids (``p00000`` ...: one per input file).
* **map** turns one partition into shard files: stream records -> encode (ahead, in a
  thread) -> EOS/truncation -> bucket -> :class:`~shardcache.format.BucketWriter`. Its
  output is a pure function of the partition's bytes and the options: the same bytes
  however the work is scheduled. It ends by writing ``parts/<id>.json`` (its completion
  record: shards, counts, the input file's sha256) and ``parts/<id>.lengths.npy``.
* **commit** gathers the completion records into ``index/lengths.npy``, the quarantine file
  and ``manifest.json``, written last and atomically: a reader sees a whole cache or none.

Memory is bounded by the options, not the corpus: one encode batch in flight plus one
record batch (4 MiB of tokens) buffered per bucket.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardcache.bucket import assign_buckets, bucket_ranges, effective_edges
from shardcache.config import BuildOptions
from shardcache.errors import CacheError
from shardcache.format import (
    FORMAT_VERSION,
    INDEX_DIR,
    LENGTHS_FILE,
    MANIFEST,
    PARTS_DIR,
    SHARD_DIR,
    BucketWriter,
    ShardInfo,
    sha256_file,
    write_bytes_atomic,
    write_json_atomic,
    write_npy_atomic,
)
from shardcache.key import compute_key, data_component_from_files, data_component_from_version
from shardcache.sources import FileDigest, InputFile, iter_text_batches, list_inputs
from shardcache.tokenize import TextEncoder, TruncationStats, encode_ahead
from shardcache.version import __version__

QUARANTINE = "quarantine.jsonl"


class Progress:
    """Receives build progress; the CLI subclasses it with a progress bar. No-op by default."""

    def start(self, total_bytes: int, files: int) -> None:
        """Called once before any partition runs."""

    def advance(self, n_bytes: int) -> None:
        """Raw input bytes consumed."""

    def update(self, documents: int, tokens: int) -> None:
        """Documents and tokens just written."""

    def close(self) -> None:
        """Called once at the end (also on failure)."""


@dataclass(frozen=True)
class Partition:
    """A unit of map work with a stable id."""

    id: str
    file: InputFile


@dataclass
class BuildPlan:
    options: BuildOptions
    inputs: list[InputFile]
    partitions: list[Partition]
    edges: tuple[int, ...]


@dataclass
class PartitionResult:
    """What one partition produced (also persisted as ``parts/<id>.json``)."""

    partition: str
    source: str
    sha256: str
    shards: list[ShardInfo]
    stats: TruncationStats
    bad_records: dict[str, int]

    def to_json(self) -> dict[str, Any]:
        return {
            "partition": self.partition,
            "source": self.source,
            "sha256": self.sha256,
            "shards": [s.to_json() for s in self.shards],
            "stats": self.stats.to_json(),
            "bad_records": dict(sorted(self.bad_records.items())),
        }


@dataclass
class BuildReport:
    """The summary a build prints and returns."""

    output: str
    documents: int
    sequences: int
    tokens: int
    shards: int
    bytes_in: int
    bytes_out: int
    seconds: float
    stats: dict[str, int]
    bad_records: dict[str, int] = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def plan_build(options: BuildOptions) -> BuildPlan:
    inputs = list_inputs(options.source.inputs)
    partitions = [Partition(f"p{i:05d}", f) for i, f in enumerate(inputs)]
    edges = effective_edges(options.layout.bucket_edges, options.tokenize.max_length)
    return BuildPlan(options, inputs, partitions, edges)


def _prepare_output(options: BuildOptions) -> None:
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
    for sub in (SHARD_DIR, PARTS_DIR, INDEX_DIR):
        shutil.rmtree(os.path.join(out, sub), ignore_errors=True)
    for leftover in (QUARANTINE,):
        if os.path.exists(os.path.join(out, leftover)):
            os.remove(os.path.join(out, leftover))
    for sub in (SHARD_DIR, PARTS_DIR, INDEX_DIR):
        os.makedirs(os.path.join(out, sub), exist_ok=True)


def build_partition(
    plan: BuildPlan, partition: Partition, encoder: TextEncoder, progress: Progress
) -> PartitionResult:
    """Map one partition to shard files and its completion record."""
    options = plan.options
    out = options.output
    stats = TruncationStats()
    bad: Counter[str] = Counter()
    quarantine_path = os.path.join(out, PARTS_DIR, f"{partition.id}.quarantine.jsonl")
    quarantine = open(quarantine_path + ".tmp", "w", encoding="utf-8")  # noqa: SIM115

    def on_bad(record: int, reason: str, excerpt: str) -> None:
        bad[reason] += 1
        entry = {"source": partition.file.relpath, "record": record, "reason": reason}
        entry["excerpt"] = excerpt
        quarantine.write(json.dumps(entry, ensure_ascii=False) + "\n")

    writers = [
        BucketWriter(
            out,
            partition.id,
            partition.file.relpath,
            bucket,
            encoder.dtype,
            options.layout.shard_size_bytes,
            options.layout.compression,
        )
        for bucket in range(len(plan.edges) + 1)
    ]
    digest = FileDigest()
    batches = iter_text_batches(
        partition.file,
        text_field=options.source.text_field,
        batch_docs=options.batch_docs,
        on_error=options.source.on_error,
        on_bad=on_bad,
        on_bytes=progress.advance,
        digest=digest,
    )
    try:
        for batch, ids in encode_ahead(encoder, batches):
            encoded = encoder.finish(ids, stats)
            records = batch.records[encoded.doc_index]
            buckets = assign_buckets(encoded.lengths, plan.edges)
            for b in np.unique(buckets):
                rows = buckets == b
                writers[int(b)].add(
                    encoded.tokens[np.repeat(rows, encoded.lengths)],
                    encoded.lengths[rows],
                    records[rows],
                    encoded.piece[rows],
                )
            progress.update(len(batch.texts), int(encoded.lengths.sum()))
        for writer in writers:
            writer.close()
    finally:
        quarantine.close()
    os.replace(quarantine_path + ".tmp", quarantine_path)
    shards = [s for w in writers for s in w.shards]
    lengths = [arr for w in writers for arr in w.lengths]
    write_npy_atomic(
        os.path.join(out, PARTS_DIR, f"{partition.id}.lengths.npy"),
        np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.uint32),
    )
    result = PartitionResult(
        partition=partition.id,
        source=partition.file.relpath,
        sha256=digest.sha256,
        shards=shards,
        stats=stats,
        bad_records=dict(bad),
    )
    write_json_atomic(os.path.join(out, PARTS_DIR, f"{partition.id}.json"), result.to_json())
    return result


def commit(plan: BuildPlan, results: list[PartitionResult], encoder: TextEncoder) -> dict:
    """Write the length index, the quarantine file and, last, the manifest."""
    options = plan.options
    out = options.output
    lengths = [
        np.load(os.path.join(out, PARTS_DIR, f"{r.partition}.lengths.npy"), allow_pickle=False)
        for r in results
    ]
    all_lengths = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.uint32)
    lengths_path = os.path.join(out, LENGTHS_FILE)
    write_npy_atomic(lengths_path, all_lengths.astype(np.uint32))
    quarantine = b"".join(
        _read_bytes(os.path.join(out, PARTS_DIR, f"{r.partition}.quarantine.jsonl"))
        for r in results
    )
    write_bytes_atomic(os.path.join(out, QUARANTINE), quarantine)

    stats = TruncationStats()
    bad: Counter[str] = Counter()
    for r in results:
        stats.add(r.stats)
        bad.update(r.bad_records)
    shards = [s.to_json() for r in results for s in r.shards]
    by_source = {r.source: r for r in results}
    inputs = [
        {
            "relpath": f.relpath,
            "size": f.size,
            "format": f.format,
            "sha256": by_source[f.relpath].sha256,
            "documents": by_source[f.relpath].stats.documents,
            "bad_records": sum(by_source[f.relpath].bad_records.values()),
        }
        for f in plan.inputs
    ]
    data = (
        data_component_from_version(options.data_version)
        if options.data_version is not None
        else data_component_from_files(inputs)
    )
    manifest = {
        "format_version": FORMAT_VERSION,
        "shardcache_version": __version__,
        "options": _options_json(options),
        "tokenizer": encoder.describe(),
        "dtype": encoder.dtype.name,
        "buckets": {
            "edges": list(plan.edges),
            "ranges": [list(r) for r in bucket_ranges(plan.edges, options.tokenize.max_length)],
        },
        "key": compute_key(encoder, data).to_json(),
        "inputs": inputs,
        "shards": shards,
        "index": {
            "lengths": {
                "name": LENGTHS_FILE,
                "bytes": os.path.getsize(lengths_path),
                "sha256": sha256_file(lengths_path),
            }
        },
        "stats": {
            **stats.to_json(),
            "bad_records": dict(sorted(bad.items())),
        },
        "totals": {
            "documents": stats.documents,
            "sequences": stats.sequences,
            "tokens": stats.tokens,
            "shards": len(shards),
            "shard_bytes": sum(s["bytes"] for s in shards),
            "input_bytes": sum(f.size for f in plan.inputs),
        },
    }
    write_json_atomic(os.path.join(out, MANIFEST), manifest)
    return manifest


def _read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _options_json(options: BuildOptions) -> dict[str, Any]:
    data = options.to_json()
    data.pop("force", None)
    return data


def build_cache(
    options: BuildOptions,
    progress: Progress | None = None,
    encoder_factory: Callable[[BuildOptions], TextEncoder] | None = None,
) -> BuildReport:
    """Build a cache from ``options``; returns the report. The manifest is written last."""
    progress = progress or Progress()
    started = time.perf_counter()
    plan = plan_build(options)
    encoder = (
        encoder_factory(options) if encoder_factory is not None else TextEncoder(options.tokenize)
    )
    _prepare_output(options)
    try:
        progress.start(sum(f.size for f in plan.inputs), len(plan.inputs))
        results = [build_partition(plan, p, encoder, progress) for p in plan.partitions]
        manifest = commit(plan, results, encoder)
    finally:
        progress.close()
    totals = manifest["totals"]
    stats = dict(manifest["stats"])
    bad = stats.pop("bad_records")
    return BuildReport(
        output=options.output,
        documents=totals["documents"],
        sequences=totals["sequences"],
        tokens=totals["tokens"],
        shards=totals["shards"],
        bytes_in=totals["input_bytes"],
        bytes_out=totals["shard_bytes"],
        seconds=time.perf_counter() - started,
        stats=stats,
        bad_records=bad,
    )
