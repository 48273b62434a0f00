"""Where partitions run: the local process pool, Ray, or one share of a job array.

The map step is engine-agnostic (build.py): a partition's output is a pure function of its
bytes and the options, written as ``*.tmp`` + rename with its completion record
``parts/<id>.json`` last. So any scheduler that runs :func:`~shardcache.builder.build_partition`
once per partition, in any order, on any machine seeing the output folder, produces the
same bytes; commit reads only ``parts/``. This module adds two schedulers on top of the
local pool and the front door that picks one:

* **ray** (``--engine ray``, extra ``shardcache[ray]``): one ``ray.remote`` task per pending
  partition, largest first, ``max_retries=3`` (a task whose worker dies is rerun; since it
  rewrites every file of its partition from scratch and writes the record last, a retry
  leaves nothing partial behind), results gathered with ``ray.wait``, the driver commits.
  ``--ray-address`` joins an existing cluster (``ray.init(address=...)``; the output must
  then be a folder every node sees, or a URL: each task then uploads its own partition to
  the store and no node's disk is shared, see remote.py), else a local Ray with
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
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shardcache.builder.encoders import encoder_from_spec, encoder_spec
from shardcache.builder.partition import build_partition
from shardcache.builder.plan import BuildPlan, Partition, PartitionResult
from shardcache.builder.pool import run_local
from shardcache.builder.report import Progress
from shardcache.builder.tokenize import TextEncoder
from shardcache.errors import (
    CacheError,
    ConfigError,
    MissingDependencyError,
)

RAY_MAX_RETRIES = 3


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


#: name -> factory of the partition runner given to build_cache / build_share
ENGINES: dict[str, Callable[[EngineOptions], RunPartitions]] = {
    "local": lambda _: run_local,
    "ray": lambda o: _ray_engine(o.ray_address),
}
