"""The build's front door: plan -> map(partition) -> commit, parallel, resumable, crash-safe.

:func:`build_cache` builds into a local folder holding ``<output>/.lock``
(:mod:`shardcache.builder.lock`): it plans or resumes (:mod:`shardcache.builder.plan`), runs the
pending partitions with an engine (:mod:`shardcache.builder.pool` by default,
:mod:`shardcache.builder.engines` for Ray), and commits (:mod:`shardcache.builder.commit`).
:func:`build_share` runs one share of a job array without committing; :func:`build` picks
between them; URL inputs are streamed and URL outputs written straight to the store
(:func:`build_into_store`, :mod:`shardcache.builder.remote`).
Since a partition's bytes do not depend on scheduling, a resumed or parallel build is
byte-identical to an uninterrupted single-process one.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from shardcache.builder.commit import commit, commit_into_store, remove_unlisted_shards
from shardcache.builder.encoders import EncoderFactory, encoder_for
from shardcache.builder.engines import ENGINES, EngineOptions, RunPartitions
from shardcache.builder.gate import gate_encoder, start_loading
from shardcache.builder.keying import precompute_tokenizer_component
from shardcache.builder.lock import BuildLock
from shardcache.builder.plan import (
    BuildPlan,
    Partition,
    PartitionResult,
    clean_partitions,
    completed_in_store,
    completed_result,
    differences,
    fingerprint_of,
    input_differences,
    inputs_json,
    options_json,
    prepare_output,
    prepare_store_output,
    share_plan,
    share_plan_in_store,
)
from shardcache.builder.pool import run_local
from shardcache.builder.remote import OutputStore, list_url_inputs
from shardcache.builder.report import BuildReport, Progress, report_from_manifest
from shardcache.builder.sources import (
    InputFile,
    list_inputs,
)
from shardcache.builder.tokenize import TextEncoder
from shardcache.config import BuildOptions
from shardcache.errors import (
    CacheError,
    ConfigError,
)
from shardcache.store.files import disk_error, read_json_or_none, write_json_atomic
from shardcache.store.layout import (
    BUILD_STATE,
    MANIFEST,
    PARTS_DIR,
    SHARD_DIR,
    SHARES_DIR,
)
from shardcache.store.manifest import read_manifest
from shardcache.store.remote import is_url, unreachable

F = TypeVar("F", bound=Callable[..., Any])


def disk_errors_explained(func: F) -> F:
    """Disk full, quota, file-size limit, read-only or permission errors while building
    ``options.output`` (the first argument) become a :class:`CacheError` naming the path and
    what to do (:func:`~shardcache.store.files.disk_error`), also from worker processes."""

    @functools.wraps(func)
    def wrapper(options: BuildOptions, *args: Any, **kwargs: Any) -> Any:
        try:
            return func(options, *args, **kwargs)
        except OSError as err:
            explained = disk_error(err, options.output)
            if explained is None:
                raise
            raise explained from err

    return wrapper  # type: ignore[return-value]


@disk_errors_explained
def build_cache(
    options: BuildOptions,
    progress: Progress | None = None,
    encoder_factory: Callable[[BuildOptions], TextEncoder] | None = None,
    *,
    engine: RunPartitions | None = None,
    inputs: list[InputFile] | None = None,
) -> BuildReport:
    """Build (or resume building) a cache from ``options``; returns the report.

    Holds ``<output>/.lock`` while it runs (:class:`~shardcache.errors.BuildLockedError` if
    another live build holds it). The manifest is written last. ``engine(plan, pending,
    encoder, progress, workers)`` replaces the local engine
    (:func:`~shardcache.builder.pool.run_local`; Ray: :mod:`shardcache.builder.engines`); ``inputs``
    replaces listing ``options.source.inputs`` (:mod:`shardcache.builder.remote`: staged URLs).
    """
    progress = progress or Progress()
    started = time.perf_counter()
    inputs = (
        inputs
        if inputs is not None
        else list_inputs(options.source.inputs, exclude=[options.output])
    )
    encoder = encoder_for(options, encoder_factory)
    loading = start_loading(encoder, options)
    # the key's tokenizer component: 0.7 CPU-s of json.dumps for a 151k vocabulary, one C
    # call holding the GIL, so a thread gains nothing (measured: it blocked this thread for
    # the same 0.7 s); computed here, while the fast backend may still be loading
    precompute_tokenizer_component(encoder)
    workers = options.num_workers
    if os.path.exists(options.output) and not os.path.isdir(options.output):
        raise CacheError(
            f"--output {options.output!r} exists and is not a folder; choose another path"
        )
    with BuildLock(options.output):
        if not options.force and os.path.isfile(os.path.join(options.output, MANIFEST)):
            check_up_to_date(options, inputs)  # raises, naming what differs
            manifest = read_manifest(options.output)
            remove_unlisted_shards(options.output, manifest)  # a commit killed after it
            return report_from_manifest(options.output, manifest, 0.0, up_to_date=True)
        plan, done = prepare_output(options, inputs)
        pending = [p for p in plan.partitions if p.id not in done]
        # which backend encodes (HF or the proven fast one); also when every partition is
        # resumed, so the manifest's encoder field does not depend on where a build stopped
        gate_encoder(encoder, plan, loading)
        loading = None  # the encoder holds the backend it uses (a pool's parent frees it)
        if options.workers is None and (engine or run_local) is run_local:
            workers = fast_workers(encoder, pending, workers)
        try:
            progress.start(sum(p.nbytes for p in pending), len(plan.inputs))
            results = dict(done)
            if pending:
                results.update((engine or run_local)(plan, pending, encoder, progress, workers))
            manifest = commit(plan, [results[p.id] for p in plan.partitions], encoder)
        finally:
            progress.close()
    return _build_report(options.output, manifest, started, len(plan.partitions), done, pending,
                         workers)  # fmt: skip


def _build_report(
    output: str,
    manifest: dict,
    started: float,
    partitions: int,
    done: Mapping[str, PartitionResult],
    pending: list[Partition],
    workers: int,
) -> BuildReport:
    totals = manifest["totals"]
    stats = dict(manifest["stats"])
    bad = stats.pop("bad_records")
    corrupt = stats.pop("corrupt_files")
    return BuildReport(
        output=output,
        documents=totals["documents"],
        sequences=totals["sequences"],
        tokens=totals["tokens"],
        shards=totals["shards"],
        bytes_in=totals["input_bytes"],
        bytes_out=totals["shard_bytes"],
        seconds=time.perf_counter() - started,
        stats=stats,
        bad_records=bad,
        partitions=partitions,
        resumed_partitions=len(done),
        workers=1 if workers == 1 or len(pending) <= 1 else min(workers, len(pending)),
        corrupt_files=corrupt,
        encoder=manifest.get("encoder") or {},
    )


def check_up_to_date(options: BuildOptions, inputs: list[InputFile]) -> None:
    """Raise :class:`CacheError` unless the committed cache at ``options.output`` was built
    with these options and inputs (its ``parts/build.json`` fingerprint), naming what
    differs: rerunning a finished build is then a no-op (idempotent pipelines)."""
    out = options.output
    state = read_json_or_none(os.path.join(out, PARTS_DIR, BUILD_STATE))
    options_now, inputs_now = options_json(options), inputs_json(inputs)
    if state is not None and state.get("fingerprint") == fingerprint_of(options_now, inputs_now):
        return
    changes = []
    if state is not None:
        changes = differences(state.get("options"), options_now)
        changes += input_differences(state.get("inputs") or [], inputs_now)
    what = "; ".join(changes[:8]) or "its build record is missing, so it cannot be compared"
    raise CacheError(
        f"{out!r} already holds a committed cache built with other options or inputs ({what}); "
        "pass --force to rebuild it, or choose another --output"
    )


#: Input bytes a worker process must have to itself before the default worker count uses it
#: with the fast backend: a worker costs ~1.6 CPU-s to start (interpreter, imports, HF and
#: fastokens loads), and the fast path processes ~45 MB of jsonl.zst per CPU-s (151k BPE),
#: so below this a worker slows the build down (10k documents, 2 cores: 1 process 3.5 CPU-s,
#: 2 workers 6.8 CPU-s and twice the wall time).
FAST_BYTES_PER_WORKER = 256 * 1024 * 1024


def fast_workers(encoder: Any, pending: list[Partition], workers: int) -> int:
    """The default worker count, reduced for the fast backend to one process per
    :data:`FAST_BYTES_PER_WORKER` of pending input (never below 1; HF: unchanged)."""
    if getattr(getattr(encoder, "text", encoder), "fast", None) is None:
        return workers
    nbytes = sum(p.nbytes for p in pending)
    return max(1, min(workers, -(-nbytes // FAST_BYTES_PER_WORKER)))


def build_into_store(
    options: BuildOptions,
    progress: Progress | None = None,
    encoder_factory: EncoderFactory | None = None,
    *,
    engine: RunPartitions | None = None,
    inputs: list[InputFile] | None = None,
) -> BuildReport:
    """:func:`build_cache` for a URL output: plan, records and manifest live in the store,
    each partition task uploads its own files (:mod:`shardcache.builder.remote`); rerunning on
    any machine resumes."""
    progress = progress or Progress()
    started = time.perf_counter()
    inputs = inputs if inputs is not None else list_inputs(options.source.inputs)
    encoder = encoder_for(options, encoder_factory)
    store = OutputStore(options.output)
    if store.exists(MANIFEST):
        if not options.force:
            raise CacheError(
                f"{store.url!r} already holds a committed cache; pass --force to rebuild it, "
                "or choose another --output"
            )
        store.remove([MANIFEST])  # first: readers stop seeing the old cache
    plan, done = prepare_store_output(options, inputs, store)
    pending = [p for p in plan.partitions if p.id not in done]
    gate_encoder(encoder, plan, start_loading(encoder, options))  # HF or the proven fast one
    try:
        progress.start(sum(p.nbytes for p in pending), len(plan.inputs))
        results = dict(done)
        if pending:
            run = engine or run_local
            results.update(run(plan, pending, encoder, progress, options.num_workers))
        manifest = commit_into_store(store, plan, [results[p.id] for p in plan.partitions],
                                     encoder)  # fmt: skip
    finally:
        progress.close()
    return _build_report(store.url, manifest, started, len(plan.partitions), done, pending,
                         options.num_workers)  # fmt: skip


def build(
    options: BuildOptions,
    engine: EngineOptions | None = None,
    progress: Progress | None = None,
    encoder_factory: EncoderFactory | None = None,
) -> BuildReport:
    """Build with any engine, a share of a job array, and local or URL inputs / output."""
    engine = engine or EngineOptions()
    if engine.share is not None and options.force:
        raise ConfigError(
            "force: --force cannot be combined with --partition (other shares write the same "
            "output); delete the output to start over"
        )

    urls = [u for u in (options.output, *options.source.inputs) if is_url(u)]
    try:
        inputs = (
            list_url_inputs(options.source.inputs)
            if any(map(is_url, options.source.inputs))
            else None
        )
        if engine.share is not None:
            return build_share(options, engine, progress, encoder_factory, inputs)
        run = ENGINES[engine.engine](engine)
        if is_url(options.output):
            return build_into_store(options, progress, encoder_factory, engine=run, inputs=inputs)
        return build_cache(options, progress, encoder_factory, engine=run, inputs=inputs)
    except Exception as err:
        explained = unreachable(err, ", ".join(urls)) if urls else None
        if explained is None:
            raise
        raise explained from err


@disk_errors_explained
def build_share(
    options: BuildOptions,
    engine: EngineOptions,
    progress: Progress | None = None,
    encoder_factory: EncoderFactory | None = None,
    inputs: list[InputFile] | None = None,
) -> BuildReport:
    """Build this share's partitions into ``options.output`` (no commit)."""
    assert engine.share is not None
    share = engine.share
    progress = progress or Progress()
    started = time.perf_counter()
    out = options.output
    inputs = (
        inputs
        if inputs is not None
        else list_inputs(options.source.inputs, exclude=[options.output])
    )
    encoder = encoder_for(options, encoder_factory)
    if is_url(out):
        return _build_share_into_store(options, engine, progress, encoder, inputs, started)
    loading = start_loading(encoder, options)
    if os.path.exists(os.path.join(out, MANIFEST)):
        raise CacheError(
            f"{out!r} already holds a committed cache; a share has nothing to add (delete the "
            "output to rebuild it)"
        )
    with BuildLock(os.path.join(out, SHARES_DIR, share.name)):
        for sub in (SHARD_DIR, PARTS_DIR, "index"):
            os.makedirs(os.path.join(out, sub), exist_ok=True)
        plan = share_plan(options, inputs)
        mine = share.select(plan.partitions)
        done: dict[str, PartitionResult] = {}

        for p in mine:
            result = completed_result(out, p)
            if result is not None:
                done[p.id] = result
        pending = [p for p in mine if p.id not in done]
        clean_partitions(out, [p.id for p in pending])
        if pending:
            gate_encoder(encoder, plan, loading)
        loading = None
        write_json_atomic(
            os.path.join(out, SHARES_DIR, f"{share.name}.json"),
            {"share": share.index, "shares": share.count, "partitions": [p.id for p in mine]},
            private=True,
        )
        results = _run_share(plan, done, pending, encoder, progress, engine, options)
    return _share_report(out, mine, done, results, started, options.num_workers)


def _build_share_into_store(
    options: BuildOptions,
    engine: EngineOptions,
    progress: Progress,
    encoder: TextEncoder,
    inputs: list[InputFile],
    started: float,
) -> BuildReport:
    """A share into a URL output: plan and records in the store, no local state (a share
    restarted on another host keeps every partition whose record checks out)."""
    assert engine.share is not None
    share = engine.share
    store = OutputStore(options.output)
    if store.exists(MANIFEST):
        raise CacheError(
            f"{store.url!r} already holds a committed cache; a share has nothing to add "
            "(delete the prefix to rebuild it)"
        )
    plan = share_plan_in_store(options, inputs, store)
    mine = share.select(plan.partitions)
    gate_encoder(encoder, plan, start_loading(encoder, options))  # as every share and build
    done = completed_in_store(store, mine)
    pending = [p for p in mine if p.id not in done]
    store.write_json(
        f"{SHARES_DIR}/{share.name}.json",
        {"share": share.index, "shares": share.count, "partitions": [p.id for p in mine]},
    )
    results = _run_share(plan, done, pending, encoder, progress, engine, options)
    return _share_report(store.url, mine, done, results, started, options.num_workers)


def _run_share(
    plan: BuildPlan,
    done: Mapping[str, PartitionResult],
    pending: list[Partition],
    encoder: TextEncoder,
    progress: Progress,
    engine: EngineOptions,
    options: BuildOptions,
) -> dict[str, PartitionResult]:
    """Run a share's pending partitions with its engine; the done and new results."""
    run = ENGINES[engine.engine](engine)
    try:
        progress.start(sum(p.nbytes for p in pending), len(plan.inputs))
        results = dict(done)
        if pending:
            results.update(run(plan, pending, encoder, progress, options.num_workers))
    finally:
        progress.close()
    return results


def _share_report(
    out: str,
    mine: list[Partition],
    done: Mapping[str, PartitionResult],
    results: Mapping[str, PartitionResult],
    started: float,
    workers: int,
) -> BuildReport:
    stats: dict[str, int] = {}
    for r in results.values():
        for k, v in r.stats.to_json().items():
            stats[k] = stats.get(k, 0) + int(v)
    return BuildReport(
        output=out,
        documents=stats.get("documents", 0),
        sequences=stats.get("sequences", 0),
        tokens=stats.get("tokens", 0),
        shards=sum(len(r.shards) for r in results.values()),
        bytes_in=sum(p.nbytes for p in mine),
        bytes_out=sum(s.bytes for r in results.values() for s in r.shards),
        seconds=time.perf_counter() - started,
        stats=stats,
        partitions=len(mine),
        resumed_partitions=len(done),
        workers=workers,
    )
