"""``shardcache.loader``: a ShardDataset, its DataLoader and optional DevicePrefetcher in one call.

A cache the compiled kernels read is read in-process (receiving a batch from a worker costs more
than building it); others get 2 workers, started by ``forkserver``: a fork of a training process
copies its threads' locks (process group, CUDA, OpenMP).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader

from shardcache.config import check_int
from shardcache.errors import ConfigError, MissingDependencyError
from shardcache.read.dataset import Batch, ShardDataset
from shardcache.read.device_prefetch import DevicePrefetcher, StallMonitor

#: The worker start method used when the platform offers it (see the module docstring).
START_METHOD = "forkserver"
#: Workers when the numpy path builds the batches (``loader(num_workers=None)``).
DEFAULT_WORKERS = 2


def stop_workers(batches: Any, persistent: bool = False) -> None:
    """Stop the worker processes of a DataLoader iterator now, freeing their queues' semaphores.

    What the iterator's finalizer does, done when the pass ends rather than when the iterator
    is collected. A persistent workers' iterator is its DataLoader's to reuse: it is stopped
    only when ``persistent`` (the loader closing); anything else is left as it is.
    """
    shutdown = getattr(batches, "_shutdown_workers", None)
    if shutdown is None or (getattr(batches, "_persistent_workers", False) and not persistent):
        return
    with contextlib.suppress(AttributeError):  # an iterator its start-up left half made
        shutdown()


class ShardLoader:
    """Batches of a ShardDataset through a DataLoader and optional prefetcher, exactly resumable.

    Built by [`loader`][shardcache.loader]; a context manager. ``state_dict()`` counts the batches
    handed out, so it is exact when readers run ahead, and a pass left early continues after them.

    Args:
        dataset: the dataset; the loader owns it.
        dataloader: the DataLoader over ``dataset`` (``batch_size=None``).
        prefetcher: the prefetcher over ``dataloader``, or None (no ``device=``).
    """

    def __init__(
        self,
        dataset: ShardDataset,
        dataloader: DataLoader[Batch],
        prefetcher: DevicePrefetcher | None,
    ) -> None:
        self.dataset = dataset
        self.dataloader = dataloader
        self.prefetcher = prefetcher
        self._base: dict[str, Any] | None = None  # the position where the current pass began
        self._taken = 0  # batches handed out in the current pass
        self._finished = False  # the current pass ran to its end
        #: Time every pass with this monitor (``StallMonitor.wrap``); ``StallMonitorCallback``
        #: sets it, for a trainer that iterates the loader itself.
        self.monitor: StallMonitor | None = None
        self._passes: weakref.WeakSet[Any] = weakref.WeakSet()  # passes not yet ended

    def __iter__(self) -> Iterator[Batch]:
        # kept so that close() can end a pass whose loop an exception left (Ctrl-C): its frames,
        # held by the traceback, would keep the DataLoader's workers until the process exits
        passed = self._pass()
        self._passes.add(passed)
        return passed

    def _pass(self) -> Iterator[Batch]:
        """One pass over the batches; its end (or ``close()``) stops the workers it started."""
        if self._base is not None and not self._finished:
            # the previous pass was left early (break): continue after the last batch handed
            # out, not where the readers had got to (workers and the prefetcher read ahead)
            self.dataset.load_state_dict(self.state_dict())
        self._base, self._taken, self._finished = self.dataset.state_dict(steps=0), 0, False
        source = self.prefetcher if self.prefetcher is not None else self.dataloader
        batches = iter(source) if self.monitor is None else self.monitor.wrap(source)
        try:
            for batch in batches:
                self._taken += 1
                yield batch
            self._finished = True
        finally:
            close = getattr(batches, "close", None)
            if close is not None:  # a generator (the prefetcher's epoch, a monitor): stop it now
                close()
            stop_workers(batches)

    def __len__(self) -> int:
        return len(self.dataset)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch, as ``ShardDataset.set_epoch`` does.

        Args:
            epoch: the epoch; a new one starts at 0, the current one keeps its position.
        """
        if self._base is not None and not self._finished and epoch == self.dataset.epoch:
            self.dataset.load_state_dict(self.state_dict())
        self.dataset.set_epoch(epoch)
        self._base = None

    def state_dict(self) -> dict[str, Any]:
        """The reader position after the batches this loader handed out.

        Returns:
            A JSON-able state for ``load_state_dict`` (any world size or workers).
        """
        if self._base is None:
            return self.dataset.state_dict(steps=0)
        state = dict(self._base)
        # the global cursor advances by world_size per batch a rank takes (ShardDataset)
        state["consumed"] = int(state["consumed"]) + int(state["world_size"]) * self._taken
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a state (any world size and ``num_workers``).

        Args:
            state: what ``state_dict`` returned.

        Raises:
            StateError: the state does not fit this dataset.
        """
        self.dataset.load_state_dict(state)
        self._base = None

    def close(self) -> None:
        """Stop the workers, the prefetcher and the dataset; idempotent.

        Ends any pass still open and stops the DataLoader's workers (persistent ones too), the
        prefetcher (freeing pinned memory), then closes the dataset.
        """
        for passed in list(self._passes):
            passed.close()
        self._passes.clear()
        persistent = getattr(self.dataloader, "_iterator", None)
        if persistent is not None:
            stop_workers(persistent, persistent=True)
            self.dataloader._iterator = None
        if self.prefetcher is not None:
            self.prefetcher.close()
        self.dataset.close()

    def __enter__(self) -> ShardLoader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def loader(
    path: str | os.PathLike[str],
    max_tokens: int,
    *,
    num_workers: int | None = None,
    device: str | Any | None = None,
    attention: str | None = None,
    stateful: bool = False,
    start_method: str | None = None,
    persistent_workers: bool = False,
    **options: Any,
) -> ShardLoader:
    """A [`ShardLoader`][shardcache.ShardLoader] over ``ShardDataset(path, max_tokens, ...)``.

    Args:
        path: the cache folder or URL (or a list of mixture sources).
        max_tokens: the token budget of a batch.
        num_workers: DataLoader workers (default: none when the compiled kernels read the cache
            and no worker option is given, else 2).
        device: add a [`DevicePrefetcher`][shardcache.DevicePrefetcher] that hands out batches
            on this device.
        attention: required with ``mode="pack"``: ``"mask"``, ``"varlen"`` or ``"none"``.
        stateful: use torchdata's ``StatefulDataLoader`` (``pip install torchdata``).
        start_method: how workers start (default ``"forkserver"`` where available).
        persistent_workers: keep the workers across epochs.
        **options: the other ``ShardDataset`` keywords (``mode``, ``seq_len``, ``seed``, ...).

    Returns:
        The loader (its DataLoader has ``batch_size=None`` and no ``pin_memory``).

    Raises:
        ConfigError: an option is invalid.
        MissingDependencyError: ``stateful=True`` without torchdata.
    """
    if num_workers is not None:
        check_int("num_workers", num_workers, 0)
    if not isinstance(stateful, bool):
        raise ConfigError(f"stateful: got {stateful!r}, expected True or False")
    if not isinstance(persistent_workers, bool):
        raise ConfigError(f"persistent_workers: got {persistent_workers!r}, expected True or False")
    dataset = ShardDataset(path, max_tokens, attention=attention, **options)
    if num_workers is None:  # workers asked for by their options, or needed: some, else none
        wanted = start_method is not None or persistent_workers or not dataset.reads_compiled
        num_workers = DEFAULT_WORKERS if wanted else 0
    if persistent_workers and num_workers == 0:
        raise ConfigError(
            "persistent_workers=True with num_workers=0: there are no worker processes to "
            "keep. Set num_workers > 0 or drop persistent_workers"
        )
    context = None
    if num_workers > 0:
        methods = multiprocessing.get_all_start_methods()
        method = start_method or (START_METHOD if START_METHOD in methods else None)
        if method is not None and method not in methods:
            raise ConfigError(
                f"start_method: got {method!r}; this platform offers {', '.join(methods)}"
            )
        context = multiprocessing.get_context(method) if method else None
    elif start_method is not None:
        raise ConfigError(
            f"start_method: got {start_method!r} with num_workers=0; there are no worker "
            "processes to start. Drop start_method or set num_workers > 0"
        )
    settings: dict[str, Any] = {
        "batch_size": None,
        "num_workers": num_workers,
        "multiprocessing_context": context,
        "persistent_workers": persistent_workers,
        "pin_memory": False,
    }
    dataloader: DataLoader[Batch]
    if stateful:
        try:
            from torchdata.stateful_dataloader import (  # type: ignore[import-untyped]
                StatefulDataLoader,
            )
        except ImportError as err:
            raise MissingDependencyError(
                "loader(stateful=True): torchdata is not installed; `pip install torchdata` "
                "(or use stateful=False: ShardLoader.state_dict() is exact without it)"
            ) from err
        with warnings.catch_warnings():
            # torchdata 0.11 calls torch.set_vital, which torch 2.13 deprecates with a
            # UserWarning on every construction: noise about torchdata, not about this call
            warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
            dataloader = StatefulDataLoader(dataset, **settings)
    else:
        dataloader = DataLoader(dataset, **settings)
    prefetcher = DevicePrefetcher(dataloader, device=device) if device is not None else None
    return ShardLoader(dataset, dataloader, prefetcher)
