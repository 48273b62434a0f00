"""Where partitions run: the local process pool, Ray, or one share of a job array.

The map step is engine-agnostic (build.py): a partition's output is a pure function of its
bytes and the options, written as ``*.tmp`` + rename with its completion record
``parts/<id>.json`` last. So any scheduler that runs :func:`~shardcache.build.build_partition`
once per partition, in any order, on any machine seeing the output folder, produces the
same bytes; commit reads only ``parts/``. This module adds two schedulers on top of the
local pool and the front door that picks one:

* **ray** (``--engine ray``, extra ``shardcache[ray]``): one ``ray.remote`` task per pending
  partition, largest first, ``max_retries=3`` (a task whose worker dies is rerun; since it
  rewrites every file of its partition from scratch and writes the record last, a retry
  leaves nothing partial behind), results gathered with ``ray.wait``, the driver commits.
  ``--ray-address`` joins an existing cluster (``ray.init(address=...)``; the output must
  then be a folder every node sees, or a URL: see remote.py), else a local Ray with
  ``num_cpus = --workers``. A Ray worker builds its encoder once (per process) from the
  encoder spec and runs its tokenizer on one Rayon thread per task CPU. A killed driver
  resumes like a local build: rerun the command.
* **shares** (``--partition i/N``): share ``i`` builds the partitions whose *index* ``k``
  (``p{k:05d}``) has ``k % N == i`` (round-robin: every share gets large and small files
  alike when sizes correlate with names), with whatever engine, and does not commit.
  Shares run concurrently into one output, so a share does not take ``<output>/.lock`` or
  wipe the folder: it takes ``.shares/share-i-of-N/.lock`` (two runs of the *same* share are
  refused), reuses ``parts/build.json`` when its fingerprint matches (the first share writes
  it; all shares compute the same plan), cleans only its own partitions' leftovers, and
  records ``.shares/share-i-of-N.json``. ``shardcache commit OUTPUT`` takes the output lock,
  rebuilds the plan and options from ``parts/build.json`` (inputs are not read again; the
  tokenizer folder recorded there must exist for the cache key), and commits when every
  partition has its record and shards, else raises :class:`IncompleteBuildError` listing the
  missing ids and the share that owns each. It then removes ``.shares/`` and stray files, so
  the folder equals a local build's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import time
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from shardcache.build import (
    BUILD_STATE,
    BuildPlan,
    BuildReport,
    Partition,
    PartitionResult,
    Progress,
    _completed,
    _fingerprint,
    _inputs_json,
    _options_json,
    _plan_from_json,
    _plan_to_json,
    _read_json,
    build_cache,
    build_partition,
    commit,
    plan_build,
)
from shardcache.buildlock import BuildLock
from shardcache.chat import encoder_from_spec, encoder_spec, make_encoder
from shardcache.config import BuildOptions
from shardcache.errors import CacheError, ConfigError, IncompleteBuildError, MissingDependencyError
from shardcache.format import MANIFEST, PARTS_DIR, SHARD_DIR, read_manifest
from shardcache.sources import InputFile, list_inputs
from shardcache.tokenize import TextEncoder

SHARES_DIR = ".shares"
RAY_MAX_RETRIES = 3
EncoderFactory = Callable[[BuildOptions], TextEncoder]


@dataclass(frozen=True)
class Share:
    """Share ``index`` of ``count`` in a job array: partitions ``k`` with ``k % count == index``."""

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
        try:
            i, n = (int(v) for v in str(text).split("/"))
        except ValueError:
            raise ConfigError(
                f"partition: cannot read {text!r}; expected i/N, e.g. 0/4 (share 0 of 4)"
            ) from None
        return cls(i, n)

    @property
    def name(self) -> str:
        return f"share-{self.index}-of-{self.count}"

    def owns(self, position: int) -> bool:
        return position % self.count == self.index

    def select(self, partitions: list[Partition]) -> list[Partition]:
        return [p for k, p in enumerate(partitions) if self.owns(k)]


@dataclass(frozen=True)
class EngineOptions:
    """How partitions are scheduled (never changes the output bytes)."""

    engine: str = "local"
    ray_address: str | None = None
    share: Share | None = None

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError(f"engine: got {self.engine!r}, expected one of {sorted(ENGINES)}")
        if self.ray_address is not None and self.engine != "ray":
            raise ConfigError("ray_address: given without --engine ray; add --engine ray")


# ------------------------------------------------------------------------------- engines

RunPartitions = Callable[
    [BuildPlan, list[Partition], TextEncoder, Progress, int], dict[str, PartitionResult]
]


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as err:
        raise MissingDependencyError(
            f"--engine ray needs Ray, which is not installed ({err}); install it with "
            "`pip install 'shardcache[ray]'` (or `pip install ray`), or use the default "
            "--engine local"
        ) from err
    return ray


_RAY_ENCODERS: dict[str, TextEncoder] = {}


def _ray_partition(spec: dict[str, Any], plan: BuildPlan, index: int) -> dict[str, Any]:
    """A Ray task: build one partition (an importable, picklable module function)."""
    key = json.dumps(spec, sort_keys=True, default=str)
    encoder = _RAY_ENCODERS.get(key)
    if encoder is None:
        # one Rayon thread per task CPU, set before this process's tokenizer pool starts
        os.environ.setdefault("RAYON_NUM_THREADS", "1")
        encoder = _RAY_ENCODERS[key] = encoder_from_spec(spec)
    return build_partition(plan, plan.partitions[index], encoder, Progress()).to_json()


def run_ray(
    plan: BuildPlan,
    pending: list[Partition],
    encoder: TextEncoder,
    progress: Progress,
    workers: int,
    address: str | None = None,
) -> dict[str, PartitionResult]:
    """Run ``pending`` as Ray tasks; progress advances per finished partition."""
    ray = _import_ray()
    started = False
    if not ray.is_initialized():
        kwargs: dict[str, Any] = {"address": address} if address else {"num_cpus": workers}
        ray.init(**kwargs, include_dashboard=False, log_to_driver=False, logging_level="warning")
        started = True
    try:
        task = ray.remote(num_cpus=1, max_retries=RAY_MAX_RETRIES)(_ray_partition)
        plan_ref = ray.put(plan)
        spec = encoder_spec(encoder)
        index = {p.id: i for i, p in enumerate(plan.partitions)}
        refs = {task.remote(spec, plan_ref, index[p.id]): p
                for p in sorted(pending, key=lambda p: (-p.nbytes, p.id))}  # fmt: skip
        results: dict[str, PartitionResult] = {}
        waiting = list(refs)
        try:
            while waiting:
                done, waiting = ray.wait(waiting, num_returns=1)
                for ref in done:
                    try:
                        result = PartitionResult.from_json(ray.get(ref))
                    except ray.exceptions.RayError as err:
                        p = refs[ref]
                        raise CacheError(
                            f"Ray task for partition {p.id} ({p.file.relpath}) failed after "
                            f"{RAY_MAX_RETRIES} retries: {err}; completed partitions are kept: "
                            "rerun the same command to resume"
                        ) from err
                    results[result.partition] = result
                    progress.advance(refs[ref].nbytes)
                    progress.update(result.stats.documents, result.stats.tokens)
        except BaseException:
            for ref in waiting:
                with contextlib.suppress(Exception):
                    ray.cancel(ref, force=True)
            raise
        return results
    finally:
        if started:
            ray.shutdown()


def _ray_engine(address: str | None) -> RunPartitions:
    def run(plan, pending, encoder, progress, workers):  # type: ignore[no-untyped-def]
        return run_ray(plan, pending, encoder, progress, workers, address)

    return run


#: name -> factory of the map runner given to build_cache (None: build.py's own pool)
ENGINES: dict[str, Callable[[EngineOptions], RunPartitions | None]] = {
    "local": lambda _: None,
    "ray": lambda o: _ray_engine(o.ray_address),
}


def _run_inline(plan, pending, encoder, progress, workers):  # type: ignore[no-untyped-def]
    from shardcache.build import _run_pool

    if workers == 1 or len(pending) <= 1:
        return {p.id: build_partition(plan, p, encoder, progress) for p in pending}
    return _run_pool(plan, pending, encoder, progress, min(workers, len(pending)))


# ------------------------------------------------------------------------- front door


def build(
    options: BuildOptions,
    engine: EngineOptions | None = None,
    progress: Progress | None = None,
    encoder_factory: EncoderFactory | None = None,
) -> BuildReport:
    """Build with any engine, a share of a job array, and local or URL inputs / output."""
    from shardcache.remote import build_remote, is_url

    engine = engine or EngineOptions()
    if engine.share is not None and options.force:
        raise ConfigError(
            "force: --force cannot be combined with --partition (other shares write the same "
            "output); delete the output to start over"
        )

    def build_local(opts: BuildOptions, inputs: list[InputFile] | None) -> BuildReport:
        if engine.share is not None:
            return build_share(opts, engine, progress, encoder_factory, inputs)
        return build_cache(
            opts, progress, encoder_factory, engine=ENGINES[engine.engine](engine), inputs=inputs
        )

    if is_url(options.output) or any(map(is_url, options.source.inputs)):
        tag = engine.share.name if engine.share is not None else ""
        return build_remote(options, build_local, tag)
    return build_local(options, None)


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
    inputs = inputs if inputs is not None else list_inputs(options.source.inputs)
    encoder = (
        encoder_factory(options)
        if encoder_factory
        else make_encoder(options.tokenize, options.chat)
    )
    if os.path.exists(os.path.join(out, MANIFEST)):
        raise CacheError(
            f"{out!r} already holds a committed cache; a share has nothing to add (delete the "
            "output to rebuild it)"
        )
    with BuildLock(os.path.join(out, SHARES_DIR, share.name)):
        for sub in (SHARD_DIR, PARTS_DIR, "index"):
            os.makedirs(os.path.join(out, sub), exist_ok=True)
        plan = _share_plan(options, inputs)
        mine = share.select(plan.partitions)
        done: dict[str, PartitionResult] = {}

        for p in mine:
            result = _completed(out, p)
            if result is not None:
                done[p.id] = result
        pending = [p for p in mine if p.id not in done]
        _clean_partitions(out, [p.id for p in pending], done)
        _write_json(os.path.join(out, SHARES_DIR, f"{share.name}.json"),
                    {"share": share.index, "shares": share.count,
                     "partitions": [p.id for p in mine]})  # fmt: skip
        run = ENGINES[engine.engine](engine) or _run_inline
        try:
            progress.start(sum(p.nbytes for p in pending), len(plan.inputs))
            results = dict(done)
            if pending:
                results.update(run(plan, pending, encoder, progress, options.num_workers))
        finally:
            progress.close()
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
        workers=options.num_workers,
    )


def _write_json(path: str, obj: Any) -> None:
    """Atomic JSON with a private tmp name (several shares may write the same file)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(obj, indent=1, sort_keys=True) + "\n")  # as write_json_atomic
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _share_plan(options: BuildOptions, inputs: list[InputFile]) -> BuildPlan:
    path = os.path.join(options.output, PARTS_DIR, BUILD_STATE)
    state = _read_json(path)
    fingerprint = _fingerprint(_options_json(options), _inputs_json(inputs))
    if state is None:
        plan = plan_build(options, inputs)
        _write_json(path, _plan_to_json(plan))  # every share computes the same plan
        return plan
    if state.get("fingerprint") != fingerprint:
        raise CacheError(
            f"{options.output!r} holds a build with other options or inputs (fingerprint "
            f"{str(state.get('fingerprint'))[:12]} vs. {fingerprint[:12]}); every share of a "
            "job array must use the same options and inputs: fix the command, or delete the "
            "output to start over"
        )
    return _plan_from_json(state, options, inputs)


def _clean_partitions(out: str, ids: list[str], done: Mapping[str, PartitionResult]) -> None:
    """Remove the leftovers of partitions about to be (re)built, and nothing else."""
    pending = set(ids)
    for sub in (SHARD_DIR, PARTS_DIR):
        folder = os.path.join(out, sub)
        for name in os.listdir(folder):
            owner = name.split("-", 1)[0] if sub == SHARD_DIR else name.split(".", 1)[0]
            if owner in pending or (name.endswith(".tmp") and owner not in done):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(folder, name))


# -------------------------------------------------------------------------------- commit


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


def report_from_manifest(output: str, manifest: Mapping[str, Any], seconds: float) -> BuildReport:
    totals, stats = manifest["totals"], dict(manifest["stats"])
    bad, corrupt = stats.pop("bad_records"), stats.pop("corrupt_files")
    return BuildReport(
        output=output, documents=totals["documents"], sequences=totals["sequences"],
        tokens=totals["tokens"], shards=totals["shards"], bytes_in=totals["input_bytes"],
        bytes_out=totals["shard_bytes"], seconds=seconds, stats=stats, bad_records=bad,
        partitions=manifest["partitions"], resumed_partitions=manifest["partitions"],
        workers=0, corrupt_files=corrupt,
    )  # fmt: skip


def _owner_hint(out: str, positions: list[int]) -> str:
    counts = set()
    folder = os.path.join(out, SHARES_DIR)
    if os.path.isdir(folder):
        for name in os.listdir(folder):
            data = _read_json(os.path.join(folder, name)) if name.endswith(".json") else None
            if data and isinstance(data.get("shares"), int):
                counts.add(data["shares"])
    if len(counts) == 1:
        n = counts.pop()
        owners = sorted({k % n for k in positions})
        return f"; they belong to share(s) {', '.join(f'{i}/{n}' for i in owners)}: run those"
    return "; partition index k belongs to share k % N of `--partition i/N`: run the missing shares"


def commit_output(
    output: str,
    encoder_factory: EncoderFactory | None = None,
    shard_sizes: Mapping[str, int] | None = None,
    strict_lint: bool = False,
) -> BuildReport:
    """``shardcache commit OUTPUT``: write the manifest once every partition is present
    (``strict_lint``: refuse, as ``build --strict-lint`` does, when the chat lint found any
    problem in the shares' partitions).

    ``OUTPUT`` is a folder or a URL. Raises :class:`IncompleteBuildError` listing the
    missing partitions (and their shares) when some are not built yet. Idempotent: a
    committed output is reported as it is.
    """
    from shardcache.remote import commit_remote, is_url

    if is_url(output):
        return commit_remote(
            output, lambda stage, sizes: commit_output(stage, encoder_factory, sizes, strict_lint)
        )
    started = time.perf_counter()
    if os.path.isfile(os.path.join(output, MANIFEST)):
        return report_from_manifest(output, read_manifest(output), 0.0)
    state = _read_json(os.path.join(output, PARTS_DIR, BUILD_STATE))
    if state is None:
        raise CacheError(
            f"{output!r} holds no build to commit ({PARTS_DIR}/{BUILD_STATE} is missing); run "
            "`shardcache build ... --partition i/N` for every share first"
        )
    options = dataclasses.replace(
        options_from_json(state["options"], output), strict_lint=strict_lint
    )
    inputs = [InputFile("", f["relpath"], int(f["size"]), f["format"]) for f in state["inputs"]]
    plan = _plan_from_json(state, options, inputs)
    with BuildLock(output):
        if shard_sizes is None:
            folder = os.path.join(output, SHARD_DIR)
            names = os.listdir(folder) if os.path.isdir(folder) else []
            shard_sizes = {n: os.path.getsize(os.path.join(folder, n)) for n in names}
        results: list[PartitionResult] = []
        missing: list[tuple[int, str]] = []
        for k, p in enumerate(plan.partitions):
            result = _completed(output, p, shard_sizes)
            if result is None:
                missing.append((k, p.id))
            else:
                results.append(result)
        if missing:
            ids = [m[1] for m in missing]
            shown = ", ".join(ids[:20]) + (f" ... ({len(ids)} in all)" if len(ids) > 20 else "")
            raise IncompleteBuildError(
                f"{output!r}: cannot commit, {len(ids)} of {len(plan.partitions)} partitions "
                f"are not built: {shown}{_owner_hint(output, [m[0] for m in missing])}, then "
                "rerun `shardcache commit`",
                ids,
            )
        encoder = (
            encoder_factory(options)
            if encoder_factory
            else make_encoder(options.tokenize, options.chat)
        )
        listed = {s.name for r in results for s in r.shards}
        folder = os.path.join(output, SHARD_DIR)
        if os.path.isdir(folder):
            for name in os.listdir(folder):  # half-written leftovers of killed shares
                if name not in listed:
                    os.remove(os.path.join(folder, name))
        shutil.rmtree(os.path.join(output, SHARES_DIR), ignore_errors=True)
        os.makedirs(os.path.join(output, "index"), exist_ok=True)
        manifest = commit(plan, results, encoder)
    return report_from_manifest(output, manifest, time.perf_counter() - started)


__all__ = [
    "ENGINES",
    "EngineOptions",
    "Share",
    "build",
    "build_share",
    "commit_output",
    "options_from_json",
    "run_ray",
]
