"""Map one partition: stream records -> encode -> EOS/truncation -> bucket -> shard files.

A partition's output is a pure function of its bytes and the options. Its completion record
``parts/<id>.json`` is published last. Memory is bounded by the options (a few batches in
flight, one record batch per bucket), not by the corpus.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import json
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from shardcache.builder.bucket import assign_buckets
from shardcache.builder.build_plan import BuildPlan, Partition, PartitionResult
from shardcache.builder.content_keys import content_keys
from shardcache.builder.encoders import Encoder, reference_only, take_lint
from shardcache.builder.fault_points import fault_point
from shardcache.builder.inputs import reader_of
from shardcache.builder.preference import pair_bucket_lengths
from shardcache.builder.report import Progress
from shardcache.builder.sources import (
    FileDigest,
    InputFile,
    InputSlice,
    TextBatch,
    check_unchanged,
    input_changed,
    iter_text_batches,
    join_batches,
    position_fields,
    record_position,
)
from shardcache.builder.stage_times import StageTimes
from shardcache.builder.tokenize import (
    Encoded,
    EncodingMismatch,
    TruncationStats,
    drop_failures,
    encode_ahead,
)
from shardcache.errors import (
    BadRecordError,
    EncoderError,
)
from shardcache.store.columns import built_columns
from shardcache.store.files import (
    write_json_atomic,
    write_npy_atomic,
)
from shardcache.store.layout import (
    PARTS_DIR,
    SHARD_DIR,
)
from shardcache.store.shards import BucketWriter
from shardcache.store.storage import open_storage

_PARENT_PID: int | None = None  # set in worker processes


def set_parent_pid(pid: int) -> None:
    """In a worker process: set the build process to die with (see ``check_parent``)."""
    global _PARENT_PID
    _PARENT_PID = pid


def build_pid() -> int:
    """The build process's pid: this process's, or in a pool worker its parent's."""
    return _PARENT_PID if _PARENT_PID is not None else os.getpid()


def check_parent() -> None:
    """In a pool worker: exit at once when the build process that started it is gone."""
    if _PARENT_PID is not None and os.getppid() != _PARENT_PID:
        os._exit(1)  # the build that started this worker is gone: stop writing


class _BadLog:
    """The bad records one thread reports, in its (record) order: a file and the counts."""

    def __init__(self, path: str):
        self.path = path
        self.file = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed by close()
        self.counts: Counter[str] = Counter()
        self.per_source: Counter[str] = Counter()
        self.corrupt: list[dict[str, Any]] = []

    def add(self, entry: dict[str, Any]) -> None:
        self.counts[entry["reason"]] += 1
        self.per_source[entry["source"]] += 1
        if entry["reason"] == "corrupt_file":
            self.corrupt.append({k: v for k, v in entry.items() if k != "reason"})
        self.file.write(json.dumps(entry, ensure_ascii=False) + "\n")

    def close(self) -> None:
        self.file.close()


def merge_bad_logs(path: str, logs: list[str], sources: list[str] | None = None) -> None:
    """Merge record-ordered quarantine logs into ``path``, streaming; the logs are removed.

    Entries are ordered by (file position in ``sources``, record); a record is in at most one
    log, so the order is total.
    """
    order = {source: k for k, source in enumerate(sources or [])}

    def lines(log: str) -> Iterator[tuple[tuple[int, int], str]]:
        with open(log, encoding="utf-8") as f:
            for line in f:
                entry = json.loads(line)
                yield (order.get(entry["source"], 0), entry["record"]), line

    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as out:
        for _, line in heapq.merge(*map(lines, logs), key=lambda item: item[0]):
            out.write(line)
    os.replace(tmp, path)
    for log in logs:
        os.remove(log)


def check_read(plan: BuildPlan, file: InputFile, span: InputSlice, digest: FileDigest) -> None:
    """Raise ``SourceError`` unless a partition read the bytes the plan described.

    Compares ``file``'s size and mtime, the length of ``span`` and, where the plan hashed them,
    the sha256.
    """
    check_unchanged(file, "while this partition read it")
    if reader_of(file.format).hashes_while_reading:  # its byte range was read and hashed
        expected = (file.size if span.end is None else span.end) - span.start
        if digest.bytes_read != expected:
            raise input_changed(
                file, "while this partition read it",
                f"read {digest.bytes_read} bytes of its range {span.start}..{span.end}, "
                f"expected {expected}",
            )  # fmt: skip
    if span.sha256 and digest.read_sha256 and digest.read_sha256 != span.sha256:
        raise input_changed(
            file, "after the plan hashed it", f"sha256 {digest.read_sha256[:16]}... of bytes "
            f"{span.start}..{span.end} read, {span.sha256[:16]}... planned"
        )  # fmt: skip
    planned = plan.file_sha256.get(file.relpath)
    if span.whole and planned and digest.sha256 and digest.sha256 != planned:
        raise input_changed(
            file, "after the plan hashed it", f"sha256 {digest.sha256[:16]}... of the bytes "
            f"read, {planned[:16]}... planned"
        )  # fmt: skip


def build_partition(
    plan: BuildPlan, partition: Partition, encoder: Encoder, progress: Progress
) -> PartitionResult:
    """Map one partition to shard files and its completion record, published to the output.

    Files are written in the output's staging folder and published, the completion record last.
    A fast-encoder difference from HF re-encodes the partition with HF (``EncoderError`` under
    ``--encoder fast``).
    """
    storage = open_storage(plan.options.output)
    # the pid in the name lets a later run sweep what a killed one left (a URL's scratch)
    with storage.staging(f"part-{os.getpid()}-{partition.id}") as staged:
        if staged != plan.options.output:
            options = dataclasses.replace(plan.options, output=staged)
            plan = dataclasses.replace(plan, options=options)
        result = _map_verified(plan, partition, encoder, progress)
        record = f"{PARTS_DIR}/{partition.id}.json"
        write_json_atomic(os.path.join(staged, record), result.to_json())
        fault_point("part")
        files = [f"{SHARD_DIR}/{s.name}" for s in result.shards]
        files += [
            f"{PARTS_DIR}/{partition.id}.{ext}" for ext in ("lengths.npy", "content_keys.npy")
        ]
        files += [f"{PARTS_DIR}/{partition.id}.quarantine.jsonl", record]  # the record last
        storage.publish(staged, files)
    return result


def _map_verified(
    plan: BuildPlan, partition: Partition, encoder: Encoder, progress: Progress
) -> PartitionResult:
    """``map_partition``, redone with the HF reference alone on a fast-encoder difference.

    Under ``--encoder fast`` the difference raises ``EncoderError`` instead.
    """
    text = getattr(encoder, "text", encoder)  # a ChatEncoder wraps a TextEncoder
    text.take_verify()  # counts are per partition (whatever ran before in this process)
    times = StageTimes()
    text.stage_times = times
    started = time.process_time()
    used = encoder
    try:
        result = map_partition(plan, partition, encoder, progress, times)
        text.check_verified()  # the sample is verified in the background: a difference raises
        counts = text.take_verify()
    except EncodingMismatch as err:
        counts = text.take_verify()
        if plan.options.encoding.encoder == "fast":
            raise EncoderError(
                f"partition {partition.id} ({partition.file.relpath}): {err}; the fast encoder "
                "is not exact on this corpus, and --encoder fast forbids falling back: build "
                "with --encoder auto (that partition is then re-encoded with HF) or hf"
            ) from err
        remove_partition_files(plan.options.output, partition.id)
        used = reference_only(encoder)
        result = map_partition(plan, partition, used, progress, times)
    used_text = getattr(used, "text", used)
    backend = used_text.fast or used_text.reference
    result.encoding = {
        "requested": text.selection.requested,
        "gate": f"{text.selection.backend}: {text.selection.reason}",
        "backend": backend.name,
        "version": backend.version,
        "verified": counts.documents,
        "verified_tokens": counts.tokens,
        "verify_fraction": text.verify_fraction if text.fast is not None else 0.0,
        "mismatches": counts.mismatches,
        "reencoded": used is not encoder,
        "detail": counts.detail[:3],
    }
    text.stage_times = None
    result.timings = partition_timings(times, time.process_time() - started)
    return result


def partition_timings(times: StageTimes, process_cpu: float) -> dict[str, float]:
    """A partition's stage times, with ``parse``, ``tokenizer`` and ``process`` added.

    ``parse`` is the reading thread beyond ``read``; ``tokenizer`` the process CPU beyond the
    Python-side stages.
    """
    seconds = dict(times.to_json())
    reader = seconds.pop("reader", 0.0)
    seconds["parse"] = max(0.0, reader - seconds.get("read", 0.0))
    python_side = reader + seconds.get("bucket", 0.0) + seconds.get("write", 0.0)
    seconds["tokenizer"] = max(0.0, process_cpu - python_side)
    seconds["process"] = process_cpu
    total = StageTimes()
    total.merge(seconds)
    return total.to_json()


@dataclasses.dataclass
class BucketRows:
    """The sequences of one bucket of a batch, in input order.

    ``tokens``, ``mask`` (None: text) and ``columns`` (per-token columns by name) are flat; the
    other arrays hold one entry per sequence (``doc_index``: its document's position in the batch).
    """

    tokens: np.ndarray
    lengths: np.ndarray
    records: np.ndarray
    piece: np.ndarray
    doc_index: np.ndarray
    mask: np.ndarray | None
    columns: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)


def by_bucket(
    encoded: Encoded, records: np.ndarray, edges: tuple[int, ...], pairs: bool = False
) -> list[tuple[int, BucketRows]]:
    """``(bucket, rows)`` for every non-empty length bucket of a batch, rows in input order.

    One stable sort of the rows by bucket; each bucket's tokens are copied into an array of its
    own, a run of rows adjacent in the batch as one slice. With ``pairs`` (preference rows:
    chosen, rejected, ...) a pair goes to the bucket of its longer side, so it stays adjacent.
    """
    n = len(encoded.lengths)
    if not n:
        return []
    bucket_lengths = pair_bucket_lengths(encoded.lengths) if pairs else encoded.lengths
    buckets = assign_buckets(bucket_lengths, edges)
    order = np.argsort(buckets, kind="stable")
    row_bounds = np.concatenate([[0], np.cumsum(np.bincount(buckets, minlength=len(edges) + 1))])
    starts_run = np.zeros(n + 1, dtype=bool)  # sorted rows that start a run, then the end
    starts_run[1:n] = np.diff(order) != 1
    starts_run[row_bounds] = True  # a run never crosses buckets
    run_rows = np.flatnonzero(starts_run)
    ends = np.cumsum(encoded.lengths)
    run_starts = (ends - encoded.lengths)[order[run_rows[:-1]]].tolist()
    run_ends = ends[order[run_rows[1:] - 1]].tolist()
    first_run = np.searchsorted(run_rows, row_bounds).tolist()

    def gather(flat: np.ndarray, b: int) -> np.ndarray:
        runs = range(first_run[b], first_run[b + 1])
        return np.concatenate([flat[run_starts[k] : run_ends[k]] for k in runs])

    lengths, doc_index = encoded.lengths[order], encoded.doc_index[order]
    piece, rows_records = encoded.piece[order], records[doc_index]
    groups = []
    for b in np.flatnonzero(np.diff(row_bounds)).tolist():
        rows = slice(int(row_bounds[b]), int(row_bounds[b + 1]))
        mask = None if encoded.mask is None else gather(encoded.mask, b)
        columns = {name: gather(values, b) for name, values in encoded.columns.items()}
        groups.append((b, BucketRows(gather(encoded.tokens, b), lengths[rows], rows_records[rows],
                                     piece[rows], doc_index[rows], mask, columns)))  # fmt: skip
    return groups


def add_rows(
    writer: BucketWriter,
    runs: list[tuple[str, int, int]],
    tokens: np.ndarray,
    lengths: np.ndarray,
    records: np.ndarray,
    pieces: np.ndarray,
    mask: np.ndarray | None,
    columns: dict[str, np.ndarray] | None = None,
) -> None:
    """Append rows to a bucket's writer, each run ``(file, start, end)`` under its file."""
    ends = np.concatenate([[0], np.cumsum(lengths)]) if len(runs) > 1 else None
    columns = columns or {}
    for source, start, end in runs:
        writer.source = source
        if ends is None:
            writer.add(tokens, lengths, records, pieces, mask, columns)
            continue
        t0, t1 = int(ends[start]), int(ends[end])
        writer.add(tokens[t0:t1], lengths[start:end], records[start:end], pieces[start:end],
                   None if mask is None else mask[t0:t1],
                   {name: values[t0:t1] for name, values in columns.items()})  # fmt: skip


def remove_partition_files(out: str, partition_id: str) -> None:
    """Remove what a failed attempt at a partition wrote into ``out``."""
    for sub, prefix in ((SHARD_DIR, f"{partition_id}-"), (PARTS_DIR, f"{partition_id}.")):
        folder = os.path.join(out, sub)
        for name in os.listdir(folder):
            if name.startswith(prefix):
                os.remove(os.path.join(folder, name))


class _PartitionBad:
    """A partition's bad records: the reader thread's and this thread's, each in record order.

    Each thread owns a file written in record order, merged at the end so the quarantine never
    depends on thread timing. ``formats`` holds each file's format, ``"json-array"`` once a
    file turns out to hold one array (records are its items).
    """

    def __init__(self, plan: BuildPlan, partition: Partition):
        self.on_error = plan.options.source.on_error
        self.path = os.path.join(plan.options.output, PARTS_DIR,
                                 f"{partition.id}.quarantine.jsonl")  # fmt: skip
        self.reader = _BadLog(self.path + ".reader.tmp")
        self.template = _BadLog(self.path + ".template.tmp")
        self.failures: list[dict[str, Any]] = []
        self.formats = {f.relpath: f.format for f in partition.files}
        self.order = {f.relpath: k for k, f in enumerate(partition.files)}

    def batch_bad(self, batch: Any, doc: int, reason: str, detail: str) -> None:
        """Record a document of a batch that cannot be used (or raise with ``fail``)."""
        record, relpath = int(batch.records[doc]), batch.source_of(doc)
        if self.on_error == "fail":
            raise BadRecordError(
                f"{relpath}: {record_position(self.formats[relpath], record)} cannot be used "
                f"({reason}: {detail}); fix the input or the chat template, or build with "
                "--on-error skip to quarantine such records"
            )
        self.failures.append({"source": relpath, "record": record,
                              **position_fields(self.formats[relpath], record),
                              "reason": reason, "excerpt": detail})  # fmt: skip

    def write_batch_failures(self) -> None:
        """Write one batch's failures, in record order (this thread)."""
        for entry in sorted(self.failures, key=lambda e: (self.order[e["source"]], e["record"])):
            self.template.add(entry)
        self.failures.clear()

    def close(self) -> None:
        """Close both logs."""
        self.reader.close()
        self.template.close()


def _read_batches(
    plan: BuildPlan,
    partition: Partition,
    bad: _PartitionBad,
    digests: dict[str, FileDigest],
    on_bytes: Callable[[int], None],
    times: StageTimes,
) -> Iterator[TextBatch]:
    """The partition's text batches, file after file (run in the read-ahead thread)."""
    options = plan.options

    def read(file: InputFile, span: InputSlice) -> Iterator[TextBatch]:
        relpath = file.relpath

        def on_layout(layout: str) -> None:
            bad.formats[relpath] = layout

        def on_bad(record: int, reason: str, excerpt: str) -> None:
            bad.reader.add({"source": relpath, "record": record,
                            **position_fields(bad.formats[relpath], record),
                            "reason": reason, "excerpt": excerpt})  # fmt: skip

        def on_corrupt(record: int, offset: int, message: str) -> None:
            position = position_fields(file.format, record)
            bad.reader.add({"source": relpath, "record": record, **position,
                            "reason": "corrupt_file", "offset": offset,
                            "excerpt": message})  # fmt: skip

        yield from iter_text_batches(
            file,
            text_field=options.source.text_field,
            batch_docs=options.batch_docs,
            on_error=options.source.on_error,
            on_bad=on_bad,
            on_bytes=on_bytes,
            digest=digests[relpath],
            part=span,
            on_corrupt=on_corrupt,
            kind=options.kind,
            on_layout=on_layout,
            times=times,
        )

    batches: Iterator[TextBatch] = itertools.chain.from_iterable(
        read(file, partition.span if k == 0 else InputSlice())
        for k, file in enumerate(partition.files)
    )
    if partition.more:  # a group of small files: their batches joined into full ones
        batches = join_batches(batches, options.batch_docs)
    return batches


def _open_writers(plan: BuildPlan, partition: Partition, encoder: Encoder) -> list[BucketWriter]:
    """One shard writer per length bucket."""
    options = plan.options
    return [
        BucketWriter(
            options.output,
            partition.id,
            partition.file.relpath,
            bucket,
            encoder.dtype,
            options.layout.shard_size_bytes,
            options.layout.compression,
            with_mask=options.chat is not None,
            row_multiple=2 if options.kind == "preference" else 1,
            columns=built_columns(options.chat),
        )
        for bucket in range(len(plan.edges) + 1)
    ]


def _write_batch(
    writers: list[BucketWriter],
    keys: list[list[np.ndarray]],
    batch: TextBatch,
    encoded: Encoded,
    edges: tuple[int, ...],
    documents: Counter[str],
    times: StageTimes,
    pairs: bool = False,
) -> None:
    """Bucket a batch's sequences, append them to the writers and count its documents.

    ``keys[b]`` gets the content key of every row added to ``writers[b]``, in the same order.
    """
    with times.cpu("bucket"):
        groups = by_bucket(encoded, batch.records, edges, pairs)
        doc_keys = content_keys(batch.texts)  # of whole records: every piece shares its key
    with times.cpu("write"):
        for b, group in groups:
            add_rows(writers[b], batch.runs(group.doc_index), group.tokens,
                     group.lengths, group.records, group.piece, group.mask,
                     group.columns)  # fmt: skip
            keys[b].append(doc_keys[group.doc_index])
    kept = np.ones(len(batch.texts), dtype=np.int64)  # documents: all but failed ones
    kept[[doc for doc, *_ in encoded.failed]] = 0
    for source, start, end in batch.runs(np.arange(len(batch.texts))):
        documents[source] += int(kept[start:end].sum())


def _encode_and_write(
    plan: BuildPlan,
    encoder: Encoder,
    batches: Iterator[TextBatch],
    writers: list[BucketWriter],
    keys: list[list[np.ndarray]],
    bad: _PartitionBad,
    stats: TruncationStats,
    documents: Counter[str],
    progress: Progress,
    times: StageTimes,
) -> None:
    """Encode the batches (read ahead), finish their ids and write them; close the writers."""
    for batch, ids in encode_ahead(encoder, batches, times=times):
        check_parent()
        original = batch
        batch, ids, failures = drop_failures(batch, ids)
        for doc, detail in failures:  # records the tokenizer failed on alone
            bad.batch_bad(original, doc, "encode_error", detail)
        if not len(ids):
            bad.write_batch_failures()
            continue  # every record of the batch failed (quarantined above)
        with times.cpu("bucket"):
            encoded = encoder.finish(ids, stats)
            del ids
        for doc, reason, detail in encoded.failed:  # conversations the template refused
            bad.batch_bad(batch, doc, reason, detail)
        bad.write_batch_failures()
        _write_batch(writers, keys, batch, encoded, plan.edges, documents, times,
                     plan.options.kind == "preference")  # fmt: skip
        progress.update(len(batch.texts), int(encoded.lengths.sum()))
        fault_point("batch")
    with times.cpu("write"):
        for writer in writers:
            writer.close()


def _partition_result(
    plan: BuildPlan,
    partition: Partition,
    encoder: Encoder,
    writers: list[BucketWriter],
    keys: list[list[np.ndarray]],
    bad: _PartitionBad,
    digests: dict[str, FileDigest],
    documents: Counter[str],
    stats: TruncationStats,
) -> PartitionResult:
    """Merge the quarantine, write the lengths and content keys, gather the partition's result.

    Both files list the partition's rows writer by writer, each writer's in the order it got
    them: the order of its shards' rows.
    """
    counts = bad.reader.counts + bad.template.counts
    bad_per_file = bad.reader.per_source + bad.template.per_source
    sources = [f.relpath for f in partition.files]
    per_file = [{"source": s, "sha256": digests[s].sha256, "documents": documents[s],
                 "bad_records": bad_per_file[s]} for s in sources]  # fmt: skip
    merge_bad_logs(bad.path, [bad.reader.path, bad.template.path], sources)
    shards = [s for w in writers for s in w.shards]
    lengths = [arr for w in writers for arr in w.lengths]
    row_keys = [arr for arrays in keys for arr in arrays]
    lengths_array = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.uint32)
    keys_array = np.concatenate(row_keys) if row_keys else np.zeros(0, dtype=np.uint64)
    if len(keys_array) != len(lengths_array):  # a bug, never the input's fault
        raise RuntimeError(
            f"partition {partition.id}: {len(keys_array)} content keys for "
            f"{len(lengths_array)} rows written"
        )
    parts = os.path.join(plan.options.output, PARTS_DIR)
    write_npy_atomic(os.path.join(parts, f"{partition.id}.lengths.npy"), lengths_array)
    write_npy_atomic(os.path.join(parts, f"{partition.id}.content_keys.npy"), keys_array)
    return PartitionResult(
        partition=partition.id,
        source=partition.file.relpath,
        sha256=digests[partition.file.relpath].sha256,
        shards=shards,
        stats=stats,
        bad_records=dict(counts),
        corrupt=bad.reader.corrupt,
        lint=take_lint(encoder),
        files=[] if not partition.more else per_file,
    )


def map_partition(
    plan: BuildPlan,
    partition: Partition,
    encoder: Encoder,
    progress: Progress,
    times: StageTimes | None = None,
) -> PartitionResult:
    """Read, encode and write a partition's files into the output, not its completion record.

    The stages: read ahead (``_read_batches``), encode, bucket and write
    (``_encode_and_write``), then the checks of what was read and the result
    (``_partition_result``). The result's ``encoding`` is left empty for the caller.
    """
    for file in partition.files:
        check_unchanged(file, "between the plan and this partition's read")
    stats = TruncationStats()
    bad = _PartitionBad(plan, partition)
    writers = _open_writers(plan, partition, encoder)
    keys: list[list[np.ndarray]] = [[] for _ in writers]  # per writer: its rows' content keys
    times = times or StageTimes()
    take_lint(encoder)  # lint counts are per partition (whatever ran before in this process)
    digests = {f.relpath: FileDigest() for f in partition.files}
    documents = Counter({f.relpath: 0 for f in partition.files})
    read_bytes = 0

    def on_bytes(n: int) -> None:
        nonlocal read_bytes
        read_bytes += n
        progress.advance(n)

    batches = _read_batches(plan, partition, bad, digests, on_bytes, times)
    try:
        _encode_and_write(plan, encoder, batches, writers, keys, bad, stats, documents,
                          progress, times)  # fmt: skip
    finally:
        bad.close()
    for k, file in enumerate(partition.files):  # before anything of this partition is final
        check_read(plan, file, partition.span if k == 0 else InputSlice(), digests[file.relpath])
    if read_bytes < partition.nbytes:  # compressed/columnar readers report approximately
        progress.advance(partition.nbytes - read_bytes)
    return _partition_result(plan, partition, encoder, writers, keys, bad, digests, documents,
                             stats)  # fmt: skip
