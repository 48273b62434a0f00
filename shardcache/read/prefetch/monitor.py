"""StallMonitor: where a training step waits for data, per step, for the loggers a team watches.

The read path times its own stages with ``time.perf_counter`` sums (no per-token work): a
``ShardDataset`` with ``time_stages`` set puts each batch's plan, fetch (download wait), gather
and collate seconds in ``meta["stage_s"]``, so they travel with the batch out of a DataLoader
worker; a ``DevicePrefetcher`` counts its consumer wait, pinning and copies. The monitor times
the consumer's ``next()`` itself and, once per step, turns the sums since the last step into
one flat dict of floats (see ``StallMonitor.step``), written to a TensorBoard
``SummaryWriter`` when given one.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from shardcache.errors import ConfigError
from shardcache.read.prefetch.prefetcher import DevicePrefetcher

#: The reader's stages, as keys of ``meta["stage_s"]`` and of the monitor's figures.
READER_STAGES = ("plan_s", "fetch_s", "gather_s", "collate_s")
#: The prefetcher's counters (cumulative) -> the monitor's per-step figures.
PREFETCH_STAGES = {"pack_s": "pin_s", "copy_s": "copy_s"}


class StallMonitor:
    """Per-step data-loading figures: how long the step waited, and on what.

    Wrap the batches, call ``step()`` once per optimizer step::

        monitor = StallMonitor(SummaryWriter("runs/x"))
        for batch in monitor.wrap(loader):
            train_step(batch)
            figures = monitor.step()  # a dict for any other logger

    ``wrap`` turns on the stage timing of the ``ShardDataset`` it finds behind a
    ``ShardLoader``, ``DataLoader`` or ``DevicePrefetcher`` (set before the workers start).

    Args:
        writer: a ``torch.utils.tensorboard.SummaryWriter`` (anything with ``add_scalar``), or
            None to only return the figures.
        prefix: put before each figure's name in the writer (e.g. ``"data/"``).
        ranks: with ``torch.distributed`` initialized and more than one rank, add the max
            and min of ``data_loading_s`` over the ranks (one all-reduce per ``step()``, a
            collective: every rank must call ``step()`` the same number of times).

    Raises:
        ConfigError: ``writer`` has no ``add_scalar``.
    """

    def __init__(self, writer: Any = None, *, prefix: str = "data/", ranks: bool = True) -> None:
        if writer is not None and not callable(getattr(writer, "add_scalar", None)):
            raise ConfigError(
                f"StallMonitor: writer {writer!r} has no add_scalar(); pass a "
                "torch.utils.tensorboard.SummaryWriter, or None and log the dicts step() returns"
            )
        self.writer = writer
        self.prefix = prefix
        self.ranks = ranks
        self.steps = 0
        self._prefetcher: DevicePrefetcher | None = None
        self._last_prefetch: dict[str, float] = {}
        self._step_began: float | None = None
        self._loading_s = 0.0
        self._batches = 0
        self._stages = dict.fromkeys(READER_STAGES, 0.0)

    def wrap(self, batches: Iterable[Any]) -> Iterator[Any]:
        """Iterate over ``batches``, timing each ``next()`` and collecting the stage times.

        Args:
            batches: a ``ShardLoader``, ``DataLoader``, ``DevicePrefetcher`` or any iterable.

        Returns:
            The same batches, in order.
        """
        self._watch(batches)
        return self._iterate(batches)

    def _watch(self, batches: Any) -> None:
        """Find the prefetcher and turn on the stage timing of the dataset behind ``batches``."""
        seen = 0
        obj = batches
        while obj is not None and seen < 4:  # ShardLoader -> DevicePrefetcher -> DataLoader -> ds
            seen += 1
            if isinstance(obj, DevicePrefetcher):
                self._prefetcher = obj
                self._last_prefetch = self._prefetch_counters()
            if hasattr(obj, "time_stages"):
                obj.time_stages = True
                return
            prefetcher = getattr(obj, "prefetcher", None)
            if isinstance(prefetcher, DevicePrefetcher) and self._prefetcher is None:
                self._prefetcher = prefetcher
                self._last_prefetch = self._prefetch_counters()
            upstream = getattr(obj, "dataset", None)
            obj = upstream if upstream is not None else getattr(obj, "iterable", None)

    def _iterate(self, batches: Iterable[Any]) -> Iterator[Any]:
        it = iter(batches)
        try:
            while True:
                began = time.perf_counter()
                if self._step_began is None:
                    self._step_began = began
                try:
                    batch = next(it)
                except StopIteration:
                    return
                self._loading_s += time.perf_counter() - began
                self._batches += 1
                meta = batch.get("meta") if isinstance(batch, dict) else None
                stages = meta.get("stage_s") if isinstance(meta, dict) else None
                if isinstance(stages, dict):
                    for name in READER_STAGES:
                        self._stages[name] += float(stages.get(name, 0.0))
                yield batch
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()

    def _prefetch_counters(self) -> dict[str, float]:
        assert self._prefetcher is not None
        s = self._prefetcher.stats()
        return {
            "consumer_wait_s": s.consumer_wait_s,
            "consumer_next_s": s.consumer_next_s,
            "pack_s": s.pack_s,
            "copy_s": s.copy_s,
        }

    def step(self, step: int | None = None) -> dict[str, float]:
        """Close a step: the figures since the previous ``step()`` (or the first batch).

        Args:
            step: the global step written to the writer (default: steps counted so far).

        Returns:
            ``step_s`` (wall time of the step), ``data_loading_s`` (in the loader's
            ``next()``), ``data_loading_pct`` (its percent of ``step_s``), ``compute_s`` (the
            rest), ``batches``; the split of the wait: ``wait_reader_s`` (the reader had no
            batch ready) and ``wait_copy_s`` (handing a batch to the device); the reader's
            stage times of this step's batches (``plan_s``, ``fetch_s``, ``gather_s``,
            ``collate_s``: in whichever process built them, so overlapped with training when
            workers read ahead); with a prefetcher ``pin_s`` and ``copy_s`` (device time,
            with ``PrefetchOptions(timing=True)``); and over ranks ``data_loading_max_s``,
            ``data_loading_min_s``.
        """
        now = time.perf_counter()
        began = self._step_began if self._step_began is not None else now
        step_s = now - began
        loading = self._loading_s
        figures: dict[str, float] = {
            "step_s": step_s,
            "data_loading_s": loading,
            "data_loading_pct": 100.0 * loading / step_s if step_s > 0 else 0.0,
            "compute_s": max(step_s - loading, 0.0),
            "batches": float(self._batches),
            "wait_reader_s": loading,
            "wait_copy_s": 0.0,
        }
        figures.update(self._stages)
        if self._prefetcher is not None:
            counters = self._prefetch_counters()
            delta = {k: v - self._last_prefetch.get(k, 0.0) for k, v in counters.items()}
            self._last_prefetch = counters
            if not self._prefetcher.passthrough:
                figures["wait_reader_s"] = delta["consumer_wait_s"]
                figures["wait_copy_s"] = max(delta["consumer_next_s"] - delta["consumer_wait_s"], 0)
            for name, out in PREFETCH_STAGES.items():
                figures[out] = delta[name]
        if self.ranks:
            figures.update(_over_ranks(loading))
        at = self.steps if step is None else step
        self.steps += 1
        self._step_began, self._loading_s, self._batches = now, 0.0, 0
        self._stages = dict.fromkeys(READER_STAGES, 0.0)
        if self.writer is not None:
            for name, value in figures.items():
                self.writer.add_scalar(self.prefix + name, value, at)
        return figures


def _over_ranks(loading_s: float) -> dict[str, float]:
    """The max and min of ``loading_s`` over the ranks (empty without a process group)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return {}
    device = "cpu"
    if dist.get_backend() == "nccl":  # (NCCL reduces device tensors only)
        device = f"cuda:{torch.cuda.current_device()}"
    both = torch.tensor([loading_s, -loading_s], dtype=torch.float64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    top, bottom = both.tolist()
    return {"data_loading_max_s": top, "data_loading_min_s": -bottom}
