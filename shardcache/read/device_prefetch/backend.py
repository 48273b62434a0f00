"""The device backend: the only place the prefetcher touches device APIs.

``TorchDeviceBackend`` uses ``torch.accelerator`` / ``torch.Stream`` / ``torch.Event`` where
torch has them, else ``torch.cuda``; tests inject a fake ``DeviceBackend``.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from shardcache.errors import ConfigError, ShardcacheError


@runtime_checkable
class DeviceBackend(Protocol):
    """The only place device APIs are touched. Streams and events are opaque to the prefetcher.

    Attributes:
        device: the device copies go to.
    """

    device: torch.device

    def current_stream(self) -> Any:
        """The calling thread's current stream on ``device``.

        Returns:
            The stream.
        """

    def new_stream(self, priority: int) -> Any:
        """A new stream on ``device``.

        Args:
            priority: the stream priority (lower runs first).

        Returns:
            The stream.
        """

    def new_event(self, timing: bool) -> Any:
        """A new event.

        Args:
            timing: whether ``elapsed_ms`` may measure it (sync-only events are cheaper).

        Returns:
            The event.
        """

    def record(self, event: Any, stream: Any) -> None:
        """Record ``event`` on ``stream`` after the work enqueued so far.

        Args:
            event: the event.
            stream: the stream.
        """

    def wait(self, stream: Any, event: Any) -> None:
        """Order future work on ``stream`` after ``event``, without blocking the host.

        Args:
            stream: the stream.
            event: the event.
        """

    def query(self, event: Any) -> bool:
        """Whether an event has completed.

        Args:
            event: the event.

        Returns:
            True when the work before it has completed (never blocks).
        """

    def synchronize(self, event: Any) -> None:
        """Block the calling thread until ``event`` has completed.

        Args:
            event: the event.
        """

    def elapsed_ms(self, start: Any, end: Any) -> float:
        """The device time between two events.

        Args:
            start: a completed timing event.
            end: a later completed timing event.

        Returns:
            Milliseconds.
        """

    def alloc_pinned(self, nbytes: int) -> torch.Tensor:
        """Pinned host memory.

        Args:
            nbytes: the size.

        Returns:
            A pinned uint8 host tensor.

        Raises:
            ShardcacheError: the memory returned is not pinned.
        """

    def alloc_device(self, nbytes: int) -> torch.Tensor:
        """Device memory, allocated on the calling thread's *current* stream.

        The caching allocator ties the block to that stream.

        Args:
            nbytes: the size.

        Returns:
            A uint8 tensor on ``device``.
        """

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        """Enqueue ``dst.copy_(src)`` on ``stream`` without blocking the host.

        The copy may read ``src`` until an event recorded on ``stream`` after it completes.

        Args:
            dst: the device tensor.
            src: the pinned host tensor.
            stream: the copy stream.
        """

    def init_thread(self) -> None:
        """Make ``device`` current in the calling thread (the packer's)."""


def _has_generic_api() -> bool:
    """True when torch has the device-agnostic stream API we need (torch >= 2.7)."""
    acc = getattr(torch, "accelerator", None)
    return (
        acc is not None
        and all(hasattr(acc, n) for n in ("set_device_index", "set_stream", "current_stream"))
        and hasattr(torch, "Stream")
        and hasattr(torch, "Event")
    )


def parse_device(device: object) -> torch.device:
    """The ``device=`` argument as a ``torch.device``; ``ConfigError`` names the accepted forms."""
    try:
        return torch.device(device)  # type: ignore[arg-type]
    except (RuntimeError, TypeError, ValueError) as err:
        raise ConfigError(
            f"DevicePrefetcher device={device!r}: not a device torch understands ({err}); "
            "use None, 'cpu', 'cuda' or 'cuda:N'."
        ) from err


def default_device() -> torch.device:
    """The current accelerator device, or CPU when there is none."""
    if _has_generic_api() and torch.accelerator.is_available():
        acc = torch.accelerator.current_accelerator()
        if acc is not None:
            return torch.device(acc.type, torch.accelerator.current_device_index())
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class TorchDeviceBackend:
    """The real ``DeviceBackend``: ``torch.accelerator`` where torch has it, else ``torch.cuda``.

    Raises ``ConfigError`` when there is no usable accelerator of the device's type.
    """

    def __init__(self, device: torch.device) -> None:
        acc = None
        if _has_generic_api() and torch.accelerator.is_available():
            acc = torch.accelerator.current_accelerator()
        self._generic = acc is not None and acc.type == device.type
        if not self._generic and device.type != "cuda":
            raise ConfigError(
                f"DevicePrefetcher device={str(device)!r}: no usable accelerator of that type "
                f"(current accelerator: {acc}); use device=None or a device torch reports."
            )
        if not self._generic and not torch.cuda.is_available():
            raise ConfigError(
                f"DevicePrefetcher device={str(device)!r}: torch.cuda.is_available() is False; "
                "use device=None (pass-through without an accelerator) or install a CUDA torch."
            )
        if device.index is None:
            index = (
                torch.accelerator.current_device_index()
                if self._generic
                else torch.cuda.current_device()
            )
            device = torch.device(device.type, index)
        self.device = device

    def current_stream(self) -> Any:
        """The calling thread's current stream."""
        if self._generic:
            return torch.accelerator.current_stream(self.device)
        return torch.cuda.current_stream(self.device)

    def new_stream(self, priority: int) -> Any:
        """A new stream."""
        if self._generic:
            return torch.Stream(device=self.device, priority=priority)
        return torch.cuda.Stream(self.device, priority=priority)

    def new_event(self, timing: bool) -> Any:
        """A new event."""
        # Sync-only events (no timing) are the cheapest for stream waits and queries.
        if self._generic:
            return torch.Event(device=self.device, enable_timing=timing)
        return torch.cuda.Event(enable_timing=timing)

    def record(self, event: Any, stream: Any) -> None:
        """Record ``event`` on ``stream``."""
        event.record(stream)

    def wait(self, stream: Any, event: Any) -> None:
        """Make ``stream`` wait for ``event``."""
        stream.wait_event(event)

    def query(self, event: Any) -> bool:
        """Whether ``event`` has completed."""
        return bool(event.query())

    def synchronize(self, event: Any) -> None:
        """Block until ``event`` has completed."""
        event.synchronize()

    def elapsed_ms(self, start: Any, end: Any) -> float:
        """Device milliseconds between two timing events."""
        return float(start.elapsed_time(end))

    def alloc_pinned(self, nbytes: int) -> torch.Tensor:
        """Pinned host memory; refuses memory that came back unpinned."""
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        # pytorch#149032: pinning before the device is initialised returned unpinned memory in
        # some versions; an unpinned slot would silently turn every copy into a synchronous one.
        if not host.is_pinned():
            raise ShardcacheError(
                f"DevicePrefetcher: allocating {nbytes} bytes of pinned host memory returned "
                "unpinned memory; the device may not be initialised or memlock is limited. "
                "Initialise the device first (e.g. torch.cuda.init()) or raise the memlock limit."
            )
        return host

    def alloc_device(self, nbytes: int) -> torch.Tensor:
        """Device memory on the calling thread's current stream."""
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        """Enqueue ``dst.copy_(src)`` on ``stream``."""
        # set_stream in the calling thread only; a shared `with stream:` object is not
        # thread-safe (torch.Stream keeps the saved stream on the object).
        if self._generic:
            prev = torch.accelerator.current_stream(self.device)
            torch.accelerator.set_stream(stream)
            try:
                dst.copy_(src, non_blocking=True)
            finally:
                torch.accelerator.set_stream(prev)
        else:
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)

    def init_thread(self) -> None:
        """Make the device current in the calling thread."""
        # The current device is per thread; the packer allocates pinned slots on it.
        if self._generic:
            torch.accelerator.set_device_index(self.device.index)
        else:
            torch.cuda.set_device(self.device)
