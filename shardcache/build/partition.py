"""Map one partition: stream records -> encode -> EOS/truncation -> bucket -> shard files.

A partition's output is a pure function of its bytes and the options: the same bytes however
the work is scheduled. :func:`build_partition` ends by writing
``parts/<id>.quarantine.jsonl``, ``parts/<id>.lengths.npy`` and, last, ``parts/<id>.json``
(its completion record: shards, counts, bad records, the file's sha256 for a whole-file
partition).

Test hook: ``SHARDCACHE_TEST_KILL="<event>:<n>"`` makes the build SIGKILL itself (and, from a
worker, its parent) at the n-th ``batch`` (encode batch written by this process; shards are
open then), ``part`` (completion record written by this process) or ``commit`` (1: after the
length index, 2: after the quarantine file, before the manifest). Tests use it to kill a
build at deterministic points; it costs one environment lookup per batch. With
``SHARDCACHE_TEST_KILL_ONCE=<path>`` the kill happens only if ``path`` does not exist yet (it
is created first): a retried task (Ray) then runs through.

Memory is bounded by the options, not the corpus: per process one encode batch being
converted plus two encoded ahead (each at most ``batch_docs`` documents or
:data:`~shardcache.build.sources.MAX_BATCH_CHARS` characters), one record batch (4 MiB of
tokens) buffered per bucket, and 4 bytes per sequence of the partition for its length index.
"""

from __future__ import annotations

import json
import os
import signal
from collections import Counter
from typing import Any

import numpy as np

from shardcache.build.bucket import assign_buckets
from shardcache.build.encoders import take_lint
from shardcache.build.plan import BuildPlan, Partition, PartitionResult
from shardcache.build.remote import build_partition_into_store
from shardcache.build.report import Progress
from shardcache.build.sources import (
    FileDigest,
    iter_text_batches,
)
from shardcache.build.tokenize import TextEncoder, TruncationStats, encode_ahead
from shardcache.errors import (
    BadRecordError,
)
from shardcache.store.files import (
    write_json_atomic,
    write_npy_atomic,
)
from shardcache.store.layout import (
    PARTS_DIR,
)
from shardcache.store.remote import is_url
from shardcache.store.shards import BucketWriter

KILL_ENV = "SHARDCACHE_TEST_KILL"
KILL_ONCE_ENV = "SHARDCACHE_TEST_KILL_ONCE"
_KILL_COUNTS: Counter[str] = Counter()
_PARENT_PID: int | None = None  # set in worker processes


def kill_point(event: str) -> None:
    """The ``SHARDCACHE_TEST_KILL`` hook (see the module docstring)."""
    spec = os.environ.get(KILL_ENV)
    if not spec:
        return
    _KILL_COUNTS[event] += 1
    if spec == f"{event}:{_KILL_COUNTS[event]}":
        once = os.environ.get(KILL_ONCE_ENV)
        if once:
            try:
                os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return  # killed once already
        if _PARENT_PID is not None:
            os.kill(_PARENT_PID, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)


def set_parent_pid(pid: int) -> None:
    """In a worker process: the build process to die with (see :func:`check_parent`)."""
    global _PARENT_PID
    _PARENT_PID = pid


def check_parent() -> None:
    if _PARENT_PID is not None and os.getppid() != _PARENT_PID:
        os._exit(1)  # the build that started this worker is gone: stop writing


def build_partition(
    plan: BuildPlan, partition: Partition, encoder: TextEncoder, progress: Progress
) -> PartitionResult:
    """Map one partition to shard files and its completion record (for a URL output: in a
    scratch folder of this task, then uploaded, record last; see build/remote.py)."""
    if is_url(plan.options.output):
        return build_partition_into_store(  # type: ignore[no-any-return]
            plan, partition, lambda local: build_partition(local, partition, encoder, progress)
        )
    options = plan.options
    out = options.output
    stats = TruncationStats()
    bad: Counter[str] = Counter()
    corrupt: list[dict[str, Any]] = []
    quarantine_path = os.path.join(out, PARTS_DIR, f"{partition.id}.quarantine.jsonl")
    quarantine = open(quarantine_path + ".tmp", "w", encoding="utf-8")  # noqa: SIM115
    relpath = partition.file.relpath

    def on_bad(record: int, reason: str, excerpt: str) -> None:
        bad[reason] += 1
        entry = {"source": relpath, "record": record, "reason": reason, "excerpt": excerpt}
        quarantine.write(json.dumps(entry, ensure_ascii=False) + "\n")

    def batch_bad(batch: Any, doc: int, reason: str, detail: str) -> None:
        record = int(batch.records[doc])
        if options.source.on_error == "fail":
            raise BadRecordError(
                f"{relpath}: record {record} cannot be used ({detail}); fix the input or the "
                "chat template, or build with --on-error skip to quarantine such records"
            )
        on_bad(record, reason, detail)

    def on_corrupt(record: int, offset: int, message: str) -> None:
        bad["corrupt_file"] += 1
        entry = {"source": relpath, "record": record, "reason": "corrupt_file",
                 "offset": offset, "excerpt": message}  # fmt: skip
        corrupt.append({k: entry[k] for k in ("source", "record", "offset", "excerpt")})
        quarantine.write(json.dumps(entry, ensure_ascii=False) + "\n")

    writers = [
        BucketWriter(
            out,
            partition.id,
            relpath,
            bucket,
            encoder.dtype,
            options.layout.shard_size_bytes,
            options.layout.compression,
            with_mask=options.chat is not None,
        )
        for bucket in range(len(plan.edges) + 1)
    ]
    take_lint(encoder)  # lint counts are per partition (whatever ran before in this process)
    digest = FileDigest()
    read_bytes = 0

    def on_bytes(n: int) -> None:
        nonlocal read_bytes
        read_bytes += n
        progress.advance(n)

    batches = iter_text_batches(
        partition.file,
        text_field=options.source.text_field,
        batch_docs=options.batch_docs,
        on_error=options.source.on_error,
        on_bad=on_bad,
        on_bytes=on_bytes,
        digest=digest,
        part=partition.span,
        on_corrupt=on_corrupt,
        kind="text" if options.chat is None else "chat",
    )
    try:
        for batch, ids in encode_ahead(encoder, batches):
            check_parent()
            encoded = encoder.finish(ids, stats)
            del ids
            for doc, reason, detail in encoded.failed:  # conversations the template refused
                batch_bad(batch, doc, reason, detail)
            records = batch.records[encoded.doc_index]
            buckets = assign_buckets(encoded.lengths, plan.edges)
            for b in np.unique(buckets):
                rows = buckets == b
                token_rows = np.repeat(rows, encoded.lengths)
                writers[int(b)].add(
                    encoded.tokens[token_rows],
                    encoded.lengths[rows],
                    records[rows],
                    encoded.piece[rows],
                    None if encoded.mask is None else encoded.mask[token_rows],
                )
            progress.update(len(batch.texts), int(encoded.lengths.sum()))
            kill_point("batch")
        for writer in writers:
            writer.close()
    finally:
        quarantine.close()
    if read_bytes < partition.nbytes:  # compressed/parquet readers report approximately
        progress.advance(partition.nbytes - read_bytes)
    os.replace(quarantine_path + ".tmp", quarantine_path)
    shards = [s for w in writers for s in w.shards]
    lengths = [arr for w in writers for arr in w.lengths]
    write_npy_atomic(
        os.path.join(out, PARTS_DIR, f"{partition.id}.lengths.npy"),
        np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.uint32),
    )
    result = PartitionResult(
        partition=partition.id,
        source=relpath,
        sha256=digest.sha256,
        shards=shards,
        stats=stats,
        bad_records=dict(bad),
        corrupt=corrupt,
        lint=take_lint(encoder),
    )
    write_json_atomic(os.path.join(out, PARTS_DIR, f"{partition.id}.json"), result.to_json())
    kill_point("part")
    return result
