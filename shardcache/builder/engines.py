"""Where partitions run: an engine maps a build's pending partitions, anywhere, in any order.

A partition's output is a pure function of its bytes and options, published with its record
last, and the commit reads only records; so any engine produces the same bytes. ``local``
(``shardcache.builder.pool``) runs here or in a process pool; ``ray`` runs one retried task
per partition on a local Ray or the cluster at ``--ray-address`` (the output must then be
reachable from every node).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shardcache.builder.build_plan import BuildPlan, Partition, PartitionResult, Share
from shardcache.builder.encoders import Encoder, encoder_in_worker, encoder_spec
from shardcache.builder.partition import build_partition
from shardcache.builder.pool import run_local
from shardcache.builder.report import Progress
from shardcache.errors import (
    CacheError,
    ConfigError,
    MissingDependencyError,
)

__all__ = ["ENGINES", "EngineOptions", "RunPartitions", "Share", "run_ray"]

RAY_MAX_RETRIES = 3


@dataclass(frozen=True)
class EngineOptions:
    """Where partitions run and which of them (never changes the output bytes).

    ``share`` is the job-array share this process runs (None: every partition). Raises
    ``ConfigError`` for an unknown engine, or ``ray_address`` without ``--engine ray``.
    """

    engine: str = "local"
    ray_address: str | None = None
    share: Share | None = None

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError(f"engine: got {self.engine!r}, expected one of {sorted(ENGINES)}")
        if self.ray_address is not None and self.engine != "ray":
            raise ConfigError("ray_address: given without --engine ray; add --engine ray")


RunPartitions = Callable[
    [BuildPlan, list[Partition], Encoder, Progress, int], dict[str, PartitionResult]
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


def _ray_partition(spec: dict[str, Any], plan: BuildPlan, index: int) -> dict[str, Any]:
    """A Ray task: build one partition (an importable, picklable module function)."""
    # one Rayon thread per task CPU, set before this process's tokenizer pool starts
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    encoder = encoder_in_worker(spec)
    return build_partition(plan, plan.partitions[index], encoder, Progress()).to_message()


def run_ray(
    plan: BuildPlan,
    pending: list[Partition],
    encoder: Encoder,
    progress: Progress,
    workers: int,
    address: str | None = None,
) -> dict[str, PartitionResult]:
    """Run ``pending`` as Ray tasks, largest first; progress advances per finished partition.

    ``workers`` sizes the local Ray started when none runs and no ``address`` is given.
    Raises ``MissingDependencyError`` without Ray, and ``CacheError`` when a task fails after
    its retries (completed partitions are kept).
    """
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


#: Engine name -> factory of the function that runs a build's pending partitions.
ENGINES: dict[str, Callable[[EngineOptions], RunPartitions]] = {
    "local": lambda _: run_local,
    "ray": lambda o: _ray_engine(o.ray_address),
}
