"""StallMonitor: where a training step waits for data, per step, for the loggers a team watches.

The read path times its own stages with ``time.perf_counter`` sums (no per-token work): a
``ShardDataset`` with ``time_stages`` set puts each batch's plan, fetch (download wait), gather
and collate seconds in ``meta["stage_s"]``, so they travel with the batch out of a DataLoader
worker; a ``DevicePrefetcher`` counts its consumer wait, pinning and copies. The monitor times
the consumer's ``next()`` itself and, once per step, turns the sums since the last step into
one flat dict of floats (see ``StallMonitor.step``), written to a TensorBoard
``SummaryWriter`` when given one. When the step waits for data more than ``warn_pct`` of the
time while it also computes, the monitor logs one warning naming the stage that dominates the
wait and what to change (``stall_advice``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from shardcache.errors import ConfigError
from shardcache.read.device_prefetch.prefetcher import DevicePrefetcher
from shardcache.read.fetch.shard_readahead import MIN_CONSUMER_SHARE

logger = logging.getLogger("shardcache")

#: The reader's stages, as keys of ``meta["stage_s"]`` and of the monitor's figures.
READER_STAGES = ("plan_s", "fetch_s", "gather_s", "collate_s")
#: The prefetcher's counters (cumulative) -> the monitor's per-step figures.
PREFETCH_STAGES = {"pack_s": "pin_s", "copy_s": "copy_s"}
#: Steps after the first (worker start-up, the plan) before the wait share is judged.
WARN_AFTER_STEPS = 8

#: Each stage a step can wait on: what it is, and what to change when it dominates the wait.
STALL_ADVICE = {
    "plan_s": (
        "planning the pass (charged to its first batch)",
        "plan fewer rows at a time or less often: a smaller shuffle_block "
        "(ShardDataset(shuffle_block=...): a rank plans that many rows of each of its streams "
        "at a time), canonical streams rather than one global plan (streams=None, not 0), or "
        "longer passes",
    ),
    "fetch_s": (
        "waiting for downloads from storage (read-ahead)",
        "read further ahead (ShardDataset(readahead=ReadAheadOptions(shards=..., "
        "threads=...))), raise SHARDCACHE_CACHE_SIZE if the window is held back by it, or "
        "point SHARDCACHE_CACHE_DIR at a local disk (or copy the cache there)",
    ),
    "gather_s": (
        "reading the sequences from the shards (and the transform)",
        "more DataLoader workers (loader(..., num_workers=...)), the cache on a local disk "
        "rather than a network file system, or a cheaper transform",
    ),
    "collate_s": (
        "padding / packing the batch",
        "more DataLoader workers (loader(..., num_workers=...)), or the compiled kernels "
        "(pip install 'shardcache[fast]')",
    ),
    "pin_s": (
        "packing the batch into pinned host memory (the DevicePrefetcher's packer thread)",
        "a deeper prefetch (DevicePrefetcher(..., depth=...)) so that packing overlaps more "
        "steps, or fewer tensors per batch",
    ),
    "copy_s": (
        "the host-to-device copy",
        "a deeper prefetch (DevicePrefetcher(..., depth=...)) so that the copy of the next "
        "batch overlaps the step, or smaller batches (a lower max_tokens)",
    ),
}


def stall_advice(figures: dict[str, float]) -> tuple[str, str]:
    """The stage that dominates a wait, and the sentence that says what it is and what to change.

    Args:
        figures: ``StallMonitor.step`` figures (one step's, or sums over steps).

    Returns:
        ``(stage, sentence)``: ``stage`` is a key of ``STALL_ADVICE``: ``copy_s`` when
        handing batches to the device (``wait_copy_s``) took longer than waiting for the
        reader, else the largest of the reader's and the packer's stage times.
    """
    if figures.get("wait_copy_s", 0.0) > figures.get("wait_reader_s", 0.0):
        stage = "copy_s"
    else:
        stages = [*READER_STAGES, "pin_s"]
        stage = max(stages, key=lambda name: (figures.get(name, 0.0), -stages.index(name)))
    what, change = STALL_ADVICE[stage]
    seconds = figures.get("wait_copy_s" if stage == "copy_s" else stage, 0.0)
    return stage, f"the largest stage is {stage[:-2]} ({what}, {seconds:.3f} s): {change}"


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
        warn_pct: log one warning (logger ``"shardcache"``) when, after ``WARN_AFTER_STEPS``
            steps past the first, the steps waited for data more than this percent of their
            time while computing ``MIN_CONSUMER_SHARE`` of it or more (a loop with no model
            waits all the time, which says nothing about training); it names the stage that
            dominates the wait and what to change (``stall_advice``). None: never warn.

    Raises:
        ConfigError: ``writer`` has no ``add_scalar``, or ``warn_pct`` is not in [0, 100].
    """

    def __init__(
        self,
        writer: Any = None,
        *,
        prefix: str = "data/",
        ranks: bool = True,
        warn_pct: float | None = 10.0,
    ) -> None:
        if warn_pct is not None and (
            isinstance(warn_pct, bool)
            or not isinstance(warn_pct, (int, float))
            or not 0 <= warn_pct <= 100
        ):
            raise ConfigError(
                f"StallMonitor warn_pct: got {warn_pct!r}, expected a percent in [0, 100], or "
                "None to never warn"
            )
        if writer is not None and not callable(getattr(writer, "add_scalar", None)):
            raise ConfigError(
                f"StallMonitor: writer {writer!r} has no add_scalar(); pass a "
                "torch.utils.tensorboard.SummaryWriter, or None and log the dicts step() returns"
            )
        self.writer = writer
        self.prefix = prefix
        self.ranks = ranks
        self.warn_pct = warn_pct
        self.warned = False
        self.steps = 0
        self._judged: dict[str, float] = {}  # sums over the steps judged for the warning
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
        # iter() is timed with the first next(): a ShardDataset plans its pass in iter()
        began: float | None = time.perf_counter()
        it = iter(batches)
        try:
            while True:
                if began is None:
                    began = time.perf_counter()
                if self._step_began is None:
                    self._step_began = began
                try:
                    batch = next(it)
                except StopIteration:
                    return
                self._loading_s += time.perf_counter() - began
                began = None
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
            figures.update(over_ranks(loading))
        if self.warn_pct is not None and not self.warned and self.steps > 0:
            self._judge(figures)
        at = self.steps if step is None else step
        self.steps += 1
        self._step_began, self._loading_s, self._batches = now, 0.0, 0
        self._stages = dict.fromkeys(READER_STAGES, 0.0)
        if self.writer is not None:
            for name, value in figures.items():
                self.writer.add_scalar(self.prefix + name, value, at)
        return figures

    def _judge(self, figures: dict[str, float]) -> None:
        """Add a step (not the first) to the judged sums; warn once when they stall (see init)."""
        for name, value in figures.items():
            self._judged[name] = self._judged.get(name, 0.0) + value
        judged = self._judged
        step_s, loading = judged.get("step_s", 0.0), judged.get("data_loading_s", 0.0)
        if self.steps < WARN_AFTER_STEPS or step_s <= 0:
            return
        if judged.get("compute_s", 0.0) < MIN_CONSUMER_SHARE * step_s:
            return
        pct = 100.0 * loading / step_s
        assert self.warn_pct is not None
        if pct <= self.warn_pct:
            return
        self.warned = True
        _, advice = stall_advice(judged)
        logger.warning(
            "StallMonitor: the training step waited for data %.1f%% of the time over steps "
            "2-%d (%.2f s of %.2f s: %.2f s waiting for the reader, %.2f s for the copy to "
            "the device); %s",
            pct,
            self.steps + 1,
            loading,
            step_s,
            judged.get("wait_reader_s", 0.0),
            judged.get("wait_copy_s", 0.0),
            advice,
        )


def over_ranks(loading_s: float) -> dict[str, float]:
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
