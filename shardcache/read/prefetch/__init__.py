"""DevicePrefetcher: move upstream CPU batches to the accelerator without stalling training."""

from shardcache.read.prefetch.prefetcher import (
    DeviceBackend,
    DevicePrefetcher,
    PrefetchOptions,
    PrefetchStats,
    TorchDeviceBackend,
)

__all__ = [
    "DeviceBackend",
    "DevicePrefetcher",
    "PrefetchOptions",
    "PrefetchStats",
    "TorchDeviceBackend",
]
