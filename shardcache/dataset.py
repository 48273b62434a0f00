"""ShardDataset: the epoch plan + the shard reader -> batches of tensors.

``ShardDataset`` is a ``torch.utils.data.IterableDataset`` that yields whole batches (use it
with ``DataLoader(ds, batch_size=None)``). Each batch is a dict of tensors:

* ``input_ids`` int64 ``B x L`` (``L`` = longest row, rounded up to ``pad_to_multiple_of``),
  padded with the tokenizer's pad id;
* ``attention_mask`` int64, 1 on tokens, 0 on padding;
* ``labels`` int64, the input ids with -100 on padding;
* ``sample_ids`` int64 ``B``: global sample ids (``Cache.lookup`` gives file and record).

All rows of a batch come from one length bucket and ``B x L <= max_tokens``.

Splitting: the global batch list of an epoch (plan.py) is dealt to ranks round-robin
(rank ``r`` of ``W`` takes batches ``r, r+W, ...``, the tail that would make counts unequal
is dropped), then a rank's batches to DataLoader workers round-robin, which is the order in
which the DataLoader collects from its workers: the stream a rank sees does not depend on
``num_workers``. The cache (memory maps) is opened lazily in each worker process.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from shardcache.cache import Cache
from shardcache.errors import ConfigError
from shardcache.plan import DEFAULT_WINDOW_SIZE, EpochPlan, PlanOptions, plan_epoch


def _resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is not None or world_size is not None:
        rank = 0 if rank is None else rank
        world_size = 1 if world_size is None else world_size
    elif torch.distributed.is_available() and torch.distributed.is_initialized():
        rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    else:
        rank = int(os.environ.get("RANK", "0"))
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(
            f"rank/world_size: got rank={rank}, world_size={world_size}; need "
            "0 <= rank < world_size"
        )
    return rank, world_size


class ShardDataset(IterableDataset):
    """Token-budget batches from a cache, sharded over ranks and DataLoader workers."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        max_tokens: int,
        shuffle: bool = True,
        seed: int = 0,
        *,
        pad_to_multiple_of: int = 1,
        window_size: int = DEFAULT_WINDOW_SIZE,
        rank: int | None = None,
        world_size: int | None = None,
    ):
        super().__init__()
        self.path = os.fspath(path)
        self.options = PlanOptions(
            max_tokens=max_tokens,
            shuffle=shuffle,
            pad_to_multiple_of=pad_to_multiple_of,
            window_size=window_size,
        )
        self.seed = int(seed)
        self.epoch = 0
        self.rank, self.world_size = _resolve_rank(rank, world_size)
        cache = Cache(self.path)
        self.pad_id = cache.pad_id
        self._lengths = np.asarray(cache.lengths)
        self._buckets = cache.buckets()
        self._cache: Cache | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_cache"] = None  # memory maps do not travel to worker processes
        return state

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (reshuffles); call before iterating each epoch."""
        self.epoch = int(epoch)

    def plan(self, epoch: int | None = None) -> EpochPlan:
        """The global batch plan of an epoch (all ranks)."""
        return plan_epoch(
            self._lengths,
            self._buckets,
            self.options,
            self.seed,
            self.epoch if epoch is None else epoch,
        )

    def batches_per_rank(self, epoch: int | None = None) -> int:
        """How many batches every rank yields in an epoch."""
        return len(self.plan(epoch)) // self.world_size

    def _rank_batches(self, plan: EpochPlan) -> np.ndarray:
        per_rank = len(plan) // self.world_size
        return self.rank + self.world_size * np.arange(per_rank, dtype=np.int64)

    def __iter__(self) -> Any:
        if self._cache is None:
            self._cache = Cache(self.path)
        plan = self.plan()
        mine = self._rank_batches(plan)
        info = get_worker_info()
        if info is not None:
            mine = mine[info.id :: info.num_workers]
        for index in mine.tolist():
            yield self.collate(plan.batch(index))

    def collate(self, sample_ids: np.ndarray) -> dict[str, torch.Tensor]:
        """Read the sequences of ``sample_ids`` and pad them into one batch."""
        assert self._cache is not None
        rows = [self._cache.read(int(s)) for s in sample_ids]
        lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
        width = int(self.options.padded(int(lengths.max())))
        input_ids = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        for i, row in enumerate(rows):
            input_ids[i, : len(row)] = row
        mask = np.arange(width)[None, :] < lengths[:, None]
        labels = np.where(mask, input_ids, -100)
        return {
            "input_ids": torch.from_numpy(input_ids),
            "attention_mask": torch.from_numpy(mask.astype(np.int64)),
            "labels": torch.from_numpy(labels),
            "sample_ids": torch.from_numpy(np.asarray(sample_ids, dtype=np.int64)),
        }
