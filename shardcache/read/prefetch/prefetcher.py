"""DevicePrefetcher: move upstream CPU batches to the accelerator without stalling training.

What this module owns
---------------------
A background *packer* thread, a bounded ring of reusable pinned host slots, one dedicated copy
stream and the events that order it against the consumer's (compute) stream. The point is not
PCIe bandwidth: a token batch of 16 x 8192 int64 ids is ~1 MiB, about 20 us at ~55 GB/s. The
point is never stalling the compute stream:

* no pageable ``.to(device)`` on the compute stream (a pageable H2D copy performs a stream sync
  before it starts, which kills the CPU's run-ahead);
* no per-batch ``pin_memory()`` of fresh memory (with variable shapes the caching host allocator
  keeps creating size classes and pinned memory grows without bound, pytorch#97432);
* the DataLoader's receive + unpickle cost moved off the training thread (it runs in the
  packer thread, which blocks in ``next(upstream)``);
* correct buffer lifetimes on both sides, written down in ring.py and pinned by tests.

Data flow (one epoch)::

    upstream iterator --(packer thread: next(), pack every CPU tensor into one pinned slot)-->
    ready FIFO --(consumer, inside next(): allocate device buffer on the compute stream S,
    copy stream C waits on an event recorded on S, one H2D copy on C, record copy_done)-->
    S waits on copy_done --> batch of device views handed to the caller

Ownership rule
--------------
**A yielded batch is never overwritten by the prefetcher: its tensors are ordinary device tensors
owned by the caller and may be kept for any time.** The prefetcher reuses only its own pinned
host slots, and only after the copy that read them completed. The batch is ready for work on the
stream that was current when ``next()`` was called; to read it on another stream, make that
stream wait on this one (and ``record_stream`` it if it outlives that use), as for any tensor.

Use the upstream ``DataLoader`` with ``pin_memory=False``: this class owns pinning; a pinned
upstream batch would be pinned twice (still correct, just wasted work and memory).

Errors and shutdown
-------------------
End of data and upstream exceptions travel in-band through the ready FIFO, after all earlier
batches; an exception is re-raised in the consumer as the same object, so its original
traceback (the upstream frames) is kept. End of data, ``close()``, ``break`` out of a ``for``
loop (the epoch generator is closed), the ``with`` block and garbage collection (a
``weakref.finalize``) all stop the packer thread, wait for outstanding copies, and drop the pinned
slots (they go back to torch's caching host allocator; ``torch.accelerator.empty_host_cache()``
returns them to the OS). One epoch is live at a time: ``iter()`` again stops the previous epoch.
The packer cannot be interrupted while it is blocked inside the upstream ``next()``; ``close()``
joins it with a timeout and the thread is a daemon (use ``DataLoader(timeout=...)`` for upstreams
that may hang).

Where the rest lives
--------------------
ring.py: the slot ring, the packer thread and the copies (packing, the backpressure, slot and
device-buffer invariants, streams and threads). backend.py: :class:`DeviceBackend`, the only
place device APIs are touched, and :class:`TorchDeviceBackend`. tree.py: flattening nested
batches to tensors and back. options.py: :class:`PrefetchOptions` and :class:`PrefetchStats`
(the metrics and how to read them).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from shardcache.errors import ConfigError
from shardcache.read.prefetch.backend import (
    DeviceBackend,
    TorchDeviceBackend,
    default_device,
    parse_device,
)
from shardcache.read.prefetch.options import PrefetchOptions, PrefetchStats
from shardcache.read.prefetch.ring import Ring

#: The most batches ``DevicePrefetcher`` stages ahead.
MAX_DEPTH = 64


class DevicePrefetcher:
    """Yield each upstream batch on the device, in order, with copies overlapping compute.

    ``iterable`` is re-iterated once per epoch (e.g. a ``DataLoader`` built with
    ``pin_memory=False``). ``device=None`` picks the current accelerator, or a CPU pass-through
    when there is none. ``depth`` batches are staged ahead of the one being consumed (plus one
    being packed). ``cast`` maps a host dtype to the dtype handed out, converted on the device
    after the copy (e.g. ``{torch.int32: torch.int64}``). ``backend`` replaces the torch device
    backend (tests, other accelerators). See the module docstring for the ownership rule::

        with DevicePrefetcher(loader, depth=2) as batches:
            for batch in batches:
                loss = model(**batch)
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
        # Runs at close() or when this object is garbage collected; holds only the ring.
        self._finalizer = weakref.finalize(self, self._ring.close)

    @property
    def passthrough(self) -> bool:
        """True when there is no accelerator and batches are handed out as they come."""
        return self._ring.backend is None

    def __iter__(self) -> Iterator[Any]:
        """Start an epoch (stopping a previous, unfinished one) and iterate over it."""
        return self._iterate()

    def _iterate(self) -> Iterator[Any]:
        # A generator method, so a live epoch keeps this object (and its finalizer) alive;
        # `break` closes the generator, which stops the epoch in run()'s finally.
        yield from self._ring.run()

    def __len__(self) -> int:
        return len(self._ring.iterable)  # type: ignore[arg-type]

    def stats(self) -> PrefetchStats:
        """A snapshot of the metrics; never synchronises the device."""
        return self._ring.stats()

    def close(self) -> None:
        """Stop the packer thread, wait for outstanding copies, free the pinned slots.

        Idempotent. A later ``iter()`` starts afresh (re-allocating slots and the copy stream).
        """
        self._ring.close()

    def __enter__(self) -> DevicePrefetcher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
