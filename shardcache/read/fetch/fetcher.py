"""The fetch stage of the read pipeline: the shards a pass needs, downloaded ahead of it.

A local cache's shards are memory-mapped by the selection's readers (an LRU of open shards);
a cache in object storage has its shards downloaded ahead of the batches that read them, in
the order this rank's plan reads them (``shard_readahead``). The ``Fetcher`` owns the
read-ahead of the pass being read and what fetching cost this process, over all passes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from shardcache.read.fetch.shard_readahead import (
    ReadAhead,
    ReadAheadOptions,
    ReadStats,
    cache_readahead,
)
from shardcache.read.selection.selection import Selection


class _UnitSamples:
    """A plan of units seen as sample ids (for the read-ahead's shard lookup)."""

    def __init__(self, plan: Any, samples: Callable[[np.ndarray], np.ndarray]) -> None:
        self.plan, self.samples = plan, samples

    def batch(self, index: int) -> np.ndarray:
        """The sample ids of global batch ``index``."""
        return self.samples(self.plan.batch(index))


class Fetcher:
    """Read-ahead of a remote selection's shards, pass by pass, and its statistics.

    Args:
        options: how far ahead to download.
    """

    def __init__(self, options: ReadAheadOptions) -> None:
        self.options = options
        self.stats = ReadStats()
        self.passes = 0  # passes started by this process (for fetched_over_share)
        self.current: ReadAhead | None = None  # of the pass being read

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "current": None}

    def begin(
        self,
        selection: Selection,
        plan: Any,
        samples: Callable[[np.ndarray], np.ndarray],
        batches: np.ndarray,
        where: str,
    ) -> ReadAhead | None:
        """Start a pass over global ``batches`` of ``plan`` (an unfinished one stops first)."""
        self.close()
        self.passes += 1
        caches, index = selection.sources()
        sampled = _UnitSamples(plan, samples)
        self.current = cache_readahead(
            caches, index, selection.close_idle, sampled, batches, self.options, self.stats, where
        )
        return self.current

    def end(self, readahead: ReadAhead | None) -> None:
        """Close a pass's read-ahead."""
        if readahead is not None:
            readahead.close()
            if self.current is readahead:
                self.current = None

    def close(self) -> None:
        """Stop the pass being read's downloads."""
        if self.current is not None:
            self.current.close()
            self.current = None

    def as_dict(self, cache_bytes: int, world_size: int) -> dict[str, Any]:
        """What reading cost this process (``ShardDataset.stats``, without the schedule)."""
        stats = self.stats.as_dict()
        share = cache_bytes / world_size
        fetched = stats["bytes_ahead"] + stats["bytes_on_demand"]
        stats["share_bytes"] = share
        stats["fetched_over_share"] = fetched / max(self.passes, 1) / share if share else 0.0
        return stats
