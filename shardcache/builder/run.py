"""The build's front door: one pipeline, plan -> map(partitions) -> commit.

A partition's bytes never depend on scheduling or storage, so every kind of build (resumed,
parallel, Ray, job-array shares) is byte-identical to an uninterrupted single-process one.
"""

from __future__ import annotations

import contextlib
import functools
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from shardcache.builder.backend_gate import gate_encoder, start_loading
from shardcache.builder.build_plan import (
    Partition,
    PartitionResult,
    Share,
    completed,
    fingerprint_of,
    plan_output,
    what_changed,
)
from shardcache.builder.commit import commit, committed_manifest, finish_committed
from shardcache.builder.encoders import Encoder, EncoderFactory, encoder_for, encodes_fast
from shardcache.builder.engines import ENGINES, EngineOptions
from shardcache.builder.key_computation import precompute_tokenizer_component
from shardcache.builder.report import BuildReport, Progress, report_from_manifest
from shardcache.builder.sources import InputFile, list_inputs
from shardcache.builder.stage_times import StageTimes
from shardcache.config import BuildOptions
from shardcache.errors import CacheError, ConfigError
from shardcache.store.build_lock import sweep_dead_scratch
from shardcache.store.files import cache_root, disk_error
from shardcache.store.layout import BUILD_STATE, MANIFEST, PARTS_DIR, SHARES_DIR
from shardcache.store.remote import is_url, unreachable
from shardcache.store.storage import Storage, open_storage

F = TypeVar("F", bound=Callable[..., Any])


def errors_explained(func: F) -> F:
    """Wrap a build function (options first) so store and disk errors explain themselves.

    An unreachable store or a write error on ``options.output`` (full disk, quota, read-only,
    permissions) becomes a CacheError naming the place and what to do.
    """

    @functools.wraps(func)
    def wrapper(options: BuildOptions, *args: Any, **kwargs: Any) -> Any:
        try:
            return func(options, *args, **kwargs)
        except Exception as err:
            urls = [u for u in (options.output, *options.source.inputs) if is_url(u)]
            explained = unreachable(err, ", ".join(urls)) if urls else None
            if explained is None and isinstance(err, OSError) and not is_url(options.output):
                explained = disk_error(err, options.output)
            if explained is None:
                raise
            raise explained from err

    return wrapper  # type: ignore[return-value]


@errors_explained
def build(
    options: BuildOptions,
    engine: EngineOptions | None = None,
    progress: Progress | None = None,
    encoder_factory: EncoderFactory | None = None,
) -> BuildReport:
    """Build (or resume) a cache, or one job-array share of it (not committed), from ``options``.

    Everything from the "already committed" check to the commit runs under the output's lock (a
    share's own lock for a share).
    """
    engine = engine or EngineOptions()
    share = engine.share
    if share is not None and options.force:
        raise ConfigError(
            "force: --force cannot be combined with --partition (other shares write the same "
            "output); delete the output to start over"
        )
    progress = progress or Progress()
    started, cpu_started = time.perf_counter(), time.process_time()
    times = StageTimes()  # the partitions' stages (this run's, not resumed ones) and commit
    # scratch files and folders of builds, commits and verifies killed on this host
    sweep_dead_scratch(tempfile.gettempdir())
    with contextlib.suppress(OSError):  # a build never needs the cache folder
        sweep_dead_scratch(cache_root())
    storage = open_storage(options.output)
    inputs = list_inputs(
        options.source.inputs, exclude=[options.output], exclude_globs=options.source.exclude
    )
    encoder = encoder_for(options, encoder_factory)
    loading = start_loading(encoder, options)
    # the key's tokenizer component: computed while the fast backend may still be loading
    precompute_tokenizer_component(encoder)
    with storage.lock(f"{SHARES_DIR}/{share.name}" if share is not None else ""):
        manifest = _already_committed(storage, options, inputs, share)
        if manifest is not None:
            return report_from_manifest(storage.location, manifest, 0.0, up_to_date=True)
        plan = plan_output(storage, options, inputs, share)
        mine = share.select(plan.partitions) if share is not None else plan.partitions
        done = completed(storage, mine)
        pending = [p for p in mine if p.id not in done]
        # also when every partition is resumed, so the manifest never depends on where a
        # build stopped
        gate_encoder(encoder, plan, loading)
        loading = None  # the encoder holds the backend it uses (a pool's parent frees it)
        workers = options.num_workers
        if options.workers is None and engine.engine == "local":
            workers = fast_workers(encoder, pending, workers)
        if share is not None:
            note = {"share": share.index, "shares": share.count, "partitions": [p.id for p in mine]}
            storage.write_json(f"{SHARES_DIR}/{share.name}.json", note, private=True)
        try:
            progress.start(sum(p.nbytes for p in pending), len(plan.inputs))
            results = dict(done)
            times.add("startup", time.process_time() - cpu_started)
            if pending:
                run = ENGINES[engine.engine](engine)
                results.update(run(plan, pending, encoder, progress, workers))
            if share is None:
                commit_started = time.process_time()
                manifest = commit(storage, plan, [results[p.id] for p in mine], encoder)
                times.add("commit", time.process_time() - commit_started)
        finally:
            progress.close()
    for p in pending:
        times.merge(results[p.id].timings)
    if manifest is None:
        report = _share_report(storage.location, mine, results, started)
        report.workers = workers
    else:
        report = report_from_manifest(storage.location, manifest, time.perf_counter() - started)
        report.workers = 1 if workers == 1 or len(pending) <= 1 else min(workers, len(pending))
    report.partitions, report.resumed_partitions = len(mine), len(done)
    report.stages = times.to_json()
    return report


def build_cache(
    options: BuildOptions,
    progress: Progress | None = None,
    encoder_factory: EncoderFactory | None = None,
) -> BuildReport:
    """Build (or resume building) a cache from ``options``, every partition on this machine.

    Rerunning an interrupted build resumes from its completed partitions, with the same bytes as
    an uninterrupted build; an output already committed with these options and inputs is
    reported as up to date.

    Args:
        options: what to build and where (a folder or a URL).
        progress: a ``shardcache.builder.report.Progress`` receiving events (default: none).
        encoder_factory: builds the encoder from the options (for tests).

    Returns:
        The [`BuildReport`][shardcache.BuildReport].

    Raises:
        BuildLockedError: another live build holds the output.
        CacheError: the output holds a committed cache, or an interrupted build that kept
            shards, with other options or inputs, or cannot be written or reached.
        SourceError: unreadable inputs, or too many bad records to commit.
        ShardcacheError: ``strict_lint`` is set and the chat lint found problems.
    """
    return build(options, None, progress, encoder_factory)


def _already_committed(
    storage: Storage, options: BuildOptions, inputs: list[InputFile], share: Share | None
) -> dict[str, Any] | None:
    """This build's committed manifest, or None; CacheError if built with other options/inputs."""
    manifest = committed_manifest(storage)
    if manifest is None:
        return None
    if share is not None:
        raise CacheError(
            f"{storage.location!r} already holds a committed cache; a share has nothing to add "
            "(delete the output to rebuild it)"
        )
    if options.force:
        storage.remove([MANIFEST])
        return None
    state = storage.read_json(f"{PARTS_DIR}/{BUILD_STATE}")
    if state is None or state.get("fingerprint") != fingerprint_of(options, inputs):
        what = what_changed(state, options, inputs) if state is not None else ""
        what = what or "its build record is missing, so it cannot be compared"
        raise CacheError(
            f"{storage.location!r} already holds a committed cache built with other options or "
            f"inputs ({what}); pass --force to rebuild it, or choose another --output"
        )
    finish_committed(storage, manifest)
    return manifest


#: Pending input bytes per worker below which the fast backend's default uses fewer workers
#: (starting a worker would cost more than its share).
FAST_BYTES_PER_WORKER = 256 * 1024 * 1024


def fast_workers(encoder: Encoder, pending: list[Partition], workers: int) -> int:
    """``workers``, but for the fast backend one per ``FAST_BYTES_PER_WORKER`` of pending input."""
    if not encodes_fast(encoder):
        return workers
    nbytes = sum(p.nbytes for p in pending)
    return max(1, min(workers, -(-nbytes // FAST_BYTES_PER_WORKER)))


def _share_report(
    output: str, mine: list[Partition], results: Mapping[str, PartitionResult], started: float
) -> BuildReport:
    stats: Counter[str] = Counter()
    for r in results.values():
        stats.update({k: int(v) for k, v in r.stats.to_json().items()})
    return BuildReport(
        output=output,
        documents=stats.get("documents", 0),
        sequences=stats.get("sequences", 0),
        tokens=stats.get("tokens", 0),
        shards=sum(len(r.shards) for r in results.values()),
        bytes_in=sum(p.nbytes for p in mine),
        bytes_out=sum(s.bytes for r in results.values() for s in r.shards),
        seconds=time.perf_counter() - started,
        stats=dict(stats),
    )
