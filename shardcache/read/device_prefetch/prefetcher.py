"""DevicePrefetcher: move upstream CPU batches to the accelerator without stalling training.

A packer thread packs each upstream batch into a pinned host slot of a bounded ring (ring.py);
the consumer's ``next()`` issues one host-to-device copy on a dedicated copy stream and makes
the compute stream wait on it. Use the upstream ``DataLoader`` with ``pin_memory=False``.

Ownership: a yielded batch is never overwritten by the prefetcher; its tensors are ordinary
device tensors owned by the caller, ready on the stream current when ``next()`` was called.
The prefetcher reuses only its own pinned slots, and only after the copy that read them
completed.

Errors and shutdown: upstream exceptions are re-raised in the consumer (same object, after
the batches before them). End of data, ``break`` and a dropped iterator stop the packer
thread and wait for outstanding copies; ``close()`` or leaving a ``with`` block also drops the
pinned slots (a dropped prefetcher frees them with it: no finalizer). One epoch is live at a
time.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from shardcache.errors import ConfigError
from shardcache.read.device_prefetch.backend import (
    DeviceBackend,
    TorchDeviceBackend,
    default_device,
    parse_device,
)
from shardcache.read.device_prefetch.options import PrefetchOptions, PrefetchStats
from shardcache.read.device_prefetch.ring import Ring

#: The most batches ``DevicePrefetcher`` stages ahead.
MAX_DEPTH = 64


class DevicePrefetcher:
    """Yield each upstream batch on the device, in order, with copies overlapping compute.

    See the module docstring for the ownership rule::

        with DevicePrefetcher(loader, depth=2) as batches:
            for batch in batches:
                loss = model(**batch)

    Args:
        iterable: re-iterated once per epoch (a ``DataLoader`` with ``pin_memory=False``).
        device: the device (default the current accelerator; a CPU pass-through without one).
        depth: batches staged ahead of the one consumed (1 to ``MAX_DEPTH``).
        cast: host dtype -> dtype handed out, converted on the device after the copy (e.g.
            ``{torch.int32: torch.int64}``).
        options: the less common knobs.
        backend: replaces the torch device backend (tests, other accelerators).

    Raises:
        ConfigError: ``depth``, ``options`` or ``cast`` is invalid.
    """

    def __init__(
        self,
        iterable: Iterable[Any],
        device: torch.device | str | None = None,
        depth: int = 2,
        *,
        cast: Mapping[torch.dtype, torch.dtype] | None = None,
        options: PrefetchOptions | None = None,
        backend: DeviceBackend | None = None,
    ) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth <= MAX_DEPTH:
            raise ConfigError(
                f"DevicePrefetcher depth={depth!r}: must be an integer in [1, {MAX_DEPTH}] "
                "(batches staged ahead; 2 double-buffers, 3-4 absorb producer jitter)."
            )
        if options is None:
            options = PrefetchOptions()
        elif not isinstance(options, PrefetchOptions):
            raise ConfigError(
                f"DevicePrefetcher options={options!r}: must be a PrefetchOptions or None."
            )
        cast = dict(cast or {})
        for src, dst in cast.items():
            if not isinstance(src, torch.dtype) or not isinstance(dst, torch.dtype):
                raise ConfigError(
                    f"DevicePrefetcher cast={{{src!r}: {dst!r}}}: keys and values must be "
                    "torch.dtype, e.g. {torch.int32: torch.int64}."
                )
        if backend is not None:
            if not isinstance(backend, DeviceBackend):
                raise ConfigError(
                    f"DevicePrefetcher backend={backend!r}: does not implement DeviceBackend."
                )
            if device is not None and parse_device(device) != backend.device:
                raise ConfigError(
                    f"DevicePrefetcher device={str(device)!r} differs from the backend's device "
                    f"{str(backend.device)!r}; pass only one of them."
                )
        else:
            dev = default_device() if device is None else parse_device(device)
            if dev.type != "cpu":
                backend = TorchDeviceBackend(dev)
        self.device: torch.device = backend.device if backend is not None else torch.device("cpu")
        self.depth = depth
        self._ring = Ring(iterable, backend, depth, cast, options)

    @property
    def iterable(self) -> Iterable[Any]:
        """The upstream iterable (a ``DataLoader``)."""
        return self._ring.iterable

    @property
    def passthrough(self) -> bool:
        """True when there is no accelerator and batches are handed out as they come."""
        return self._ring.backend is None

    def __iter__(self) -> Iterator[Any]:
        """Start an epoch (stopping a previous, unfinished one) and iterate over it."""
        return self._iterate()

    def _iterate(self) -> Iterator[Any]:
        # `break` or dropping the iterator closes the generator, which stops the epoch in
        # run()'s finally.
        yield from self._ring.run()

    def __len__(self) -> int:
        return len(self._ring.iterable)  # type: ignore[arg-type]

    def stats(self) -> PrefetchStats:
        """A snapshot of the metrics; never synchronises the device.

        Returns:
            The counters since construction.
        """
        return self._ring.stats()

    def close(self) -> None:
        """Stop the packer thread, wait for outstanding copies, free the pinned slots (idempotent).

        A later ``iter()`` starts afresh.
        """
        self._ring.close()

    def __enter__(self) -> DevicePrefetcher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
