"""The build: plan -> map(partition) -> commit, parallel, resumable and crash-safe.

* **plan** lists the inputs in a deterministic order and cuts them into partitions with
  stable ids ``p00000``, ``p00001`` ... in (file, position) order: one per input file, or
  several for an uncompressed jsonl / parquet file larger than ``partition_size_bytes``
  (byte ranges cut at line boundaries / runs of row groups, see
  :func:`~shardcache.sources.split_input`; compressed files stay whole). The plan, the sha256
  of every split file and an options fingerprint are written to ``parts/build.json``.
* **map** turns one partition into shard files: stream records -> encode (ahead, in a
  thread) -> EOS/truncation -> bucket -> :class:`~shardcache.format.BucketWriter`. Its
  output is a pure function of the partition's bytes and the options: the same bytes
  however the work is scheduled. It ends by writing ``parts/<id>.quarantine.jsonl``,
  ``parts/<id>.lengths.npy`` and, last, ``parts/<id>.json`` (its completion record: shards,
  counts, bad records, the file's sha256 for a whole-file partition).
* **commit** gathers the completion records, in partition-id order, into
  ``index/lengths.npy``, ``quarantine.jsonl`` and ``manifest.json``, written last and
  atomically: a reader sees a whole cache or none. Commit reads only ``parts/`` (never worker
  memory), which is what makes resume work.

Processes. ``workers == 1`` (or a single pending partition) runs in this process, where the
tokenizer's Rayon pool uses every core. Otherwise a ``spawn`` process pool (fork after Rayon
started deadlocks or silently serializes the tokenizer) runs partitions, largest first so no
big partition is left for the end; each worker builds its encoder once from
:meth:`~shardcache.tokenize.TextEncoder.spec` (no transformers import) and gets
``RAYON_NUM_THREADS = cores // workers``, so N workers use N cores instead of N x cores
threads. Results travel back as the persisted part records. Workers die with the parent
(``PR_SET_PDEATHSIG`` on Linux, plus a parent-pid check per batch), so a killed build leaves
no orphan writing into the folder. Progress events go through one queue to one bar.

Resume. A build holds ``<output>/.lock`` (:mod:`shardcache.buildlock`). When the output has
``parts/build.json`` with the same fingerprint (options except output/force/workers, and
every input's path, size and mtime) and no manifest, the build keeps every partition whose
completion record exists and whose shards have the recorded sizes, deletes everything else
(half-written shards, ``*.tmp``), and runs the rest. Since a partition's bytes do not depend
on scheduling, the result is byte-identical to an uninterrupted build. A different
fingerprint is refused (it names what changed) unless ``--force`` starts over.

Test hook: ``SHARDCACHE_TEST_KILL="<event>:<n>"`` makes the build SIGKILL itself (and, from a
worker, its parent) at the n-th ``batch`` (encode batch written by this process; shards are
open then), ``part`` (completion record written by this process) or ``commit`` (1: after the
length index, 2: after the quarantine file, before the manifest). Tests use it to kill a
build at deterministic points; it costs one environment lookup per batch. With
``SHARDCACHE_TEST_KILL_ONCE=<path>`` the kill happens only if ``path`` does not exist yet (it
is created first): a retried task (Ray) then runs through.

Memory is bounded by the options, not the corpus: per process one encode batch being
converted plus two encoded ahead (each at most ``batch_docs`` documents or
:data:`~shardcache.sources.MAX_BATCH_CHARS` characters), one record batch (4 MiB of tokens)
buffered per bucket, and 4 bytes per sequence of the partition for its length index. Commit
streams the length index and the quarantine file part by part.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import os
import shutil
import signal
import time
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardcache.bucket import assign_buckets, bucket_ranges, effective_edges
from shardcache.buildlock import BuildLock
from shardcache.chat import encoder_from_spec, encoder_spec, make_encoder, take_lint
from shardcache.config import BuildOptions, default_workers
from shardcache.errors import BadRecordError, CacheError, ShardcacheError
from shardcache.format import (
    FORMAT_VERSION,
    INDEX_DIR,
    LENGTHS_FILE,
    MANIFEST,
    PARTS_DIR,
    SHARD_DIR,
    BucketWriter,
    ShardInfo,
    fsync_dir,
    sha256_file,
    write_json_atomic,
    write_npy_atomic,
    write_npy_concat_atomic,
)
from shardcache.key import compute_key, data_component_from_files, data_component_from_version
from shardcache.sources import (
    FileDigest,
    InputFile,
    InputSlice,
    iter_text_batches,
    list_inputs,
    split_input,
)
from shardcache.tokenize import TextEncoder, TruncationStats, encode_ahead
from shardcache.version import __version__

QUARANTINE = "quarantine.jsonl"
BUILD_STATE = "build.json"  # in parts/: plan + fingerprint
KILL_ENV = "SHARDCACHE_TEST_KILL"
KILL_ONCE_ENV = "SHARDCACHE_TEST_KILL_ONCE"
_PROGRESS_INTERVAL_S = 0.2


class Progress:
    """Receives build progress; the CLI subclasses it with a progress bar. No-op by default.

    In a parallel build the workers' events are forwarded to this object in the parent, so
    one bar covers the whole build.
    """

    def start(self, total_bytes: int, files: int) -> None:
        """Called once before any partition runs (bytes still to read, input files)."""

    def advance(self, n_bytes: int) -> None:
        """Raw input bytes consumed."""

    def update(self, documents: int, tokens: int) -> None:
        """Documents and tokens just written."""

    def close(self) -> None:
        """Called once at the end (also on failure)."""


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
        )


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
    partitions: int = 0
    resumed_partitions: int = 0  # taken from an interrupted earlier run
    workers: int = 1
    corrupt_files: list[dict[str, Any]] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


# ---------------------------------------------------------------------------------- plan


def _options_json(options: BuildOptions) -> dict[str, Any]:
    """Options as recorded in the manifest (plain JSON: lists, not tuples): without what
    cannot change the bytes (``strict_lint`` only decides whether to commit)."""
    data = options.to_json()
    for key in ("force", "workers", "output", "strict_lint"):
        data.pop(key, None)
    return json.loads(json.dumps(data))


def _inputs_json(inputs: list[InputFile]) -> list[dict[str, Any]]:
    return [
        {"relpath": f.relpath, "size": f.size, "format": f.format,
         "mtime_ns": os.stat(f.path).st_mtime_ns}
        for f in inputs
    ]  # fmt: skip


def _fingerprint(options_json: dict[str, Any], inputs_json: list[dict[str, Any]]) -> str:
    blob = json.dumps({"options": options_json, "inputs": inputs_json}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def plan_build(options: BuildOptions, inputs: list[InputFile] | None = None) -> BuildPlan:
    """List and split the inputs (reads every file that is split once, to hash and cut it)."""
    inputs = inputs if inputs is not None else list_inputs(options.source.inputs)
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
    fingerprint = _fingerprint(_options_json(options), _inputs_json(inputs))
    return BuildPlan(options, inputs, partitions, edges, hashes, fingerprint)


def _plan_to_json(plan: BuildPlan) -> dict[str, Any]:
    return {
        "fingerprint": plan.fingerprint,
        "options": _options_json(plan.options),
        "inputs": _inputs_json(plan.inputs),
        "partitions": [p.to_json() for p in plan.partitions],
        "sha256": dict(sorted(plan.file_sha256.items())),
    }


def _plan_from_json(
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


def _read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _differences(old: Any, new: Any, path: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for key in sorted(set(old) | set(new)):
            out += _differences(old.get(key), new.get(key), f"{path}.{key}" if path else key)
        return out
    return [] if old == new else [f"{path}: {old!r} -> {new!r}"]


def _input_differences(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[str]:
    a = {f["relpath"]: f for f in old}
    b = {f["relpath"]: f for f in new}
    out = [f"input {p}: removed" for p in sorted(set(a) - set(b))]
    out += [f"input {p}: added" for p in sorted(set(b) - set(a))]
    out += [f"input {p}: changed (size/mtime)" for p in sorted(set(a) & set(b)) if a[p] != b[p]]
    return out


def _wipe(out: str) -> None:
    for sub in (SHARD_DIR, PARTS_DIR, INDEX_DIR):
        shutil.rmtree(os.path.join(out, sub), ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(out, QUARANTINE))
    for sub in (SHARD_DIR, PARTS_DIR, INDEX_DIR):
        os.makedirs(os.path.join(out, sub), exist_ok=True)


def _completed(
    out: str, partition: Partition, shard_sizes: Mapping[str, int] | None = None
) -> PartitionResult | None:
    """The partition's completion record, if it and every file it lists are intact
    (``shard_sizes``: the shard folder listed once, for callers checking many partitions)."""
    data = _read_json(os.path.join(out, PARTS_DIR, f"{partition.id}.json"))
    if data is None:
        return None
    try:
        result = PartitionResult.from_json(data)
    except (KeyError, TypeError, ValueError):
        return None
    if result.partition != partition.id or result.source != partition.file.relpath:
        return None
    for name in (f"{partition.id}.lengths.npy", f"{partition.id}.quarantine.jsonl"):
        if not os.path.isfile(os.path.join(out, PARTS_DIR, name)):
            return None
    for shard in result.shards:
        if shard_sizes is not None:
            if shard_sizes.get(shard.name) != shard.bytes:
                return None
            continue
        path = os.path.join(out, SHARD_DIR, shard.name)
        if not os.path.isfile(path) or os.path.getsize(path) != shard.bytes:
            return None
    return result


def _prepare_output(
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
    state = _read_json(os.path.join(out, PARTS_DIR, BUILD_STATE))
    options_json, inputs_json = _options_json(options), _inputs_json(inputs)
    fingerprint = _fingerprint(options_json, inputs_json)
    if state is not None and state.get("fingerprint") != fingerprint and not options.force:
        changes = _differences(state.get("options"), options_json)
        changes += _input_differences(state.get("inputs") or [], inputs_json)
        raise CacheError(
            f"{out!r} holds an interrupted build with other options or inputs "
            f"({'; '.join(changes[:8]) or 'fingerprint differs'}); its partitions cannot be "
            "reused: rerun with the original options to resume it, pass --force to discard it "
            "and start over, or choose another --output"
        )
    if state is None or options.force:
        _wipe(out)
        plan = plan_build(options, inputs)
        write_json_atomic(os.path.join(out, PARTS_DIR, BUILD_STATE), _plan_to_json(plan))
        return plan, {}
    plan = _plan_from_json(state, options, inputs)
    done: dict[str, PartitionResult] = {}
    for partition in plan.partitions:
        result = _completed(out, partition)
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


# ----------------------------------------------------------------------------------- map

_KILL_COUNTS: Counter[str] = Counter()
_PARENT_PID: int | None = None  # set in worker processes


def _test_kill_point(event: str) -> None:
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


def _check_parent() -> None:
    if _PARENT_PID is not None and os.getppid() != _PARENT_PID:
        os._exit(1)  # the build that started this worker is gone: stop writing


def build_partition(
    plan: BuildPlan, partition: Partition, encoder: TextEncoder, progress: Progress
) -> PartitionResult:
    """Map one partition to shard files and its completion record."""
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
            _check_parent()
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
            _test_kill_point("batch")
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
    _test_kill_point("part")
    return result


# ------------------------------------------------------------------------ process pool

_WORKER: dict[str, Any] = {}


class _QueueProgress(Progress):
    """Progress in a worker: sums events and sends them to the parent every 0.2 s."""

    def __init__(self, queue: Any):
        self.queue = queue
        self.pending = [0, 0, 0]  # bytes, documents, tokens
        self.last = time.monotonic()

    def advance(self, n_bytes: int) -> None:
        self.pending[0] += n_bytes
        self._maybe_send()

    def update(self, documents: int, tokens: int) -> None:
        self.pending[1] += documents
        self.pending[2] += tokens
        self._maybe_send()

    def _maybe_send(self) -> None:
        if time.monotonic() - self.last >= _PROGRESS_INTERVAL_S:
            self.flush()

    def flush(self) -> None:
        if any(self.pending):
            self.queue.put(tuple(self.pending))
            self.pending = [0, 0, 0]
        self.last = time.monotonic()


def _die_with_parent() -> None:
    """Linux: the kernel SIGKILLs this process when its parent dies."""
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _worker_init(
    spec: dict[str, Any], plan: BuildPlan, queue: Any, rayon_threads: int, parent: int
) -> None:
    global _PARENT_PID
    _PARENT_PID = parent
    _die_with_parent()
    _check_parent()  # the parent may have died before prctl
    # before the tokenizer's Rayon pool starts (on the first encode_batch)
    os.environ["RAYON_NUM_THREADS"] = str(rayon_threads)
    queue.cancel_join_thread()  # progress is best-effort; never block a worker's exit on it
    _WORKER.update(encoder=encoder_from_spec(spec), plan=plan, queue=queue)


def _worker_run(index: int) -> dict[str, Any]:
    plan: BuildPlan = _WORKER["plan"]
    progress = _QueueProgress(_WORKER["queue"])
    result = build_partition(plan, plan.partitions[index], _WORKER["encoder"], progress)
    progress.flush()
    return result.to_json()


def _drain(queue: Any, progress: Progress) -> None:
    import queue as queue_module

    while True:
        try:
            n_bytes, documents, tokens = queue.get_nowait()
        except queue_module.Empty:
            return
        if n_bytes:
            progress.advance(n_bytes)
        if documents or tokens:
            progress.update(documents, tokens)


def _run_pool(
    plan: BuildPlan,
    pending: list[Partition],
    encoder: TextEncoder,
    progress: Progress,
    workers: int,
) -> dict[str, PartitionResult]:
    from concurrent.futures.process import BrokenProcessPool

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    rayon_threads = max(1, default_workers() // workers)
    executor = ProcessPoolExecutor(
        max_workers=workers,
        mp_context=ctx,
        initializer=_worker_init,
        initargs=(encoder_spec(encoder), plan, queue, rayon_threads, os.getpid()),
    )
    index = {p.id: i for i, p in enumerate(plan.partitions)}
    futures: dict[Future[dict[str, Any]], Partition] = {}
    results: dict[str, PartitionResult] = {}
    try:
        for p in sorted(pending, key=lambda p: (-p.nbytes, p.id)):  # largest first: no tail
            futures[executor.submit(_worker_run, index[p.id])] = p
        not_done = set(futures)
        while not_done:
            done, not_done = wait(not_done, timeout=0.1, return_when=FIRST_COMPLETED)
            _drain(queue, progress)
            for future in done:
                try:
                    data = future.result()
                except BrokenProcessPool as err:
                    raise ShardcacheError(
                        f"a worker process died while building partition {futures[future].id} "
                        f"({futures[future].file.relpath}): killed (e.g. by the OS for lack of "
                        "memory) or failed to start (a script calling build_cache with workers "
                        "> 1 needs an `if __name__ == '__main__':` guard); completed partitions "
                        "are kept: rerun the same command to resume (with fewer --workers or a "
                        "smaller --batch-docs if memory is short)"
                    ) from err
                results[data["partition"]] = PartitionResult.from_json(data)
        _drain(queue, progress)
    except BaseException:
        for future in futures:
            future.cancel()
        processes = list((getattr(executor, "_processes", None) or {}).values())
        for process in processes:  # fail fast: do not wait for running partitions
            with contextlib.suppress(Exception):
                process.terminate()
        executor.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            with contextlib.suppress(Exception):
                process.join(5)
        raise
    executor.shutdown(wait=True)
    queue.close()
    return results


# -------------------------------------------------------------------------------- commit


def _stream_concat_atomic(path: str, sources: list[str]) -> tuple[int, str, int]:
    """Concatenate files into ``path`` (tmp + fsync + rename); returns bytes, sha256, lines."""
    digest = hashlib.sha256()
    size = lines = 0
    tmp = path + ".tmp"
    with open(tmp, "wb") as out:
        for source in sources:
            with open(source, "rb") as f:
                while chunk := f.read(1 << 20):
                    out.write(chunk)
                    digest.update(chunk)
                    size += len(chunk)
                    lines += chunk.count(b"\n")
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))
    return size, digest.hexdigest(), lines


def commit(plan: BuildPlan, results: list[PartitionResult], encoder: TextEncoder) -> dict:
    """Write the length index, the quarantine file and, last, the manifest.

    ``results`` must be in partition-id order; everything is read from ``parts/``.
    """
    options = plan.options
    out = options.output
    lint: Counter[str] = Counter()
    for r in results:
        lint.update(r.lint)
    problems = {k: v for k, v in sorted(lint.items()) if v and k != "template_checked"}
    if options.strict_lint and problems:
        raise ShardcacheError(
            f"chat lint found problems with --strict-lint: {problems}; the cache was not "
            "committed (the partitions are kept). Fix the template/data, or rerun without "
            "--strict-lint to commit anyway (see `shardcache info` for the counts)"
        )
    parts = os.path.join(out, PARTS_DIR)
    lengths_path = os.path.join(out, LENGTHS_FILE)
    write_npy_concat_atomic(
        lengths_path, [os.path.join(parts, f"{r.partition}.lengths.npy") for r in results]
    )
    _test_kill_point("commit")
    q_bytes, q_sha, q_lines = _stream_concat_atomic(
        os.path.join(out, QUARANTINE),
        [os.path.join(parts, f"{r.partition}.quarantine.jsonl") for r in results],
    )
    _test_kill_point("commit")

    stats = TruncationStats()
    bad: Counter[str] = Counter()
    per_file: dict[str, dict[str, Any]] = {}
    for r in results:
        stats.add(r.stats)
        bad.update(r.bad_records)
        entry = per_file.setdefault(r.source, {"sha256": "", "documents": 0, "bad_records": 0})
        entry["sha256"] = entry["sha256"] or r.sha256
        entry["documents"] += r.stats.documents
        entry["bad_records"] += sum(r.bad_records.values())
    shards = [s.to_json() for r in results for s in r.shards]
    inputs = [
        {
            "relpath": f.relpath,
            "size": f.size,
            "format": f.format,
            "sha256": plan.file_sha256.get(f.relpath) or per_file[f.relpath]["sha256"],
            "documents": per_file[f.relpath]["documents"],
            "bad_records": per_file[f.relpath]["bad_records"],
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
        "kind": "text" if options.chat is None else "chat",
        "options": _options_json(options),
        "tokenizer": encoder.describe(),
        "dtype": encoder.dtype.name,
        "buckets": {
            "edges": list(plan.edges),
            "ranges": [list(r) for r in bucket_ranges(plan.edges, options.tokenize.max_length)],
        },
        "key": compute_key(encoder, data).to_json(),
        "inputs": inputs,
        "partitions": len(results),
        "shards": shards,
        "index": {
            "lengths": {
                "name": LENGTHS_FILE,
                "bytes": os.path.getsize(lengths_path),
                "sha256": sha256_file(lengths_path),
            }
        },
        "quarantine": {"name": QUARANTINE, "bytes": q_bytes, "sha256": q_sha, "records": q_lines},
        "stats": {
            **stats.to_json(),
            "bad_records": dict(sorted(bad.items())),
            "corrupt_files": [c for r in results for c in r.corrupt],
            "lint": dict(sorted(lint.items())),
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


# --------------------------------------------------------------------------------- build


def build_cache(
    options: BuildOptions,
    progress: Progress | None = None,
    encoder_factory: Callable[[BuildOptions], TextEncoder] | None = None,
    *,
    engine: Callable[..., dict[str, PartitionResult]] | None = None,
    inputs: list[InputFile] | None = None,
) -> BuildReport:
    """Build (or resume building) a cache from ``options``; returns the report.

    Holds ``<output>/.lock`` while it runs (:class:`~shardcache.errors.BuildLockedError` if
    another live build holds it). The manifest is written last. ``engine(plan, pending,
    encoder, progress, workers)`` replaces the local pool (shardcache.engines: Ray);
    ``inputs`` replaces listing ``options.source.inputs`` (shardcache.remote: staged URLs).
    """
    progress = progress or Progress()
    started = time.perf_counter()
    inputs = inputs if inputs is not None else list_inputs(options.source.inputs)
    encoder = (
        encoder_factory(options)
        if encoder_factory is not None
        else make_encoder(options.tokenize, options.chat)
    )
    workers = options.num_workers
    if os.path.exists(options.output) and not os.path.isdir(options.output):
        raise CacheError(
            f"--output {options.output!r} exists and is not a folder; choose another path"
        )
    with BuildLock(options.output):
        plan, done = _prepare_output(options, inputs)
        pending = [p for p in plan.partitions if p.id not in done]
        try:
            progress.start(sum(p.nbytes for p in pending), len(plan.inputs))
            results = dict(done)
            if engine is not None:
                results.update(engine(plan, pending, encoder, progress, workers) if pending else {})
            elif workers == 1 or len(pending) <= 1:
                for p in pending:
                    results[p.id] = build_partition(plan, p, encoder, progress)
            else:
                results.update(
                    _run_pool(plan, pending, encoder, progress, min(workers, len(pending)))
                )
            manifest = commit(plan, [results[p.id] for p in plan.partitions], encoder)
        finally:
            progress.close()
    totals = manifest["totals"]
    stats = dict(manifest["stats"])
    bad = stats.pop("bad_records")
    corrupt = stats.pop("corrupt_files")
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
        partitions=len(plan.partitions),
        resumed_partitions=len(done),
        workers=1 if workers == 1 or len(pending) <= 1 else min(workers, len(pending)),
        corrupt_files=corrupt,
    )
