"""DevicePrefetcher (CPU batches to the accelerator) and StallMonitor (where a step waits)."""

from shardcache.read.prefetch.backend import DeviceBackend, TorchDeviceBackend
from shardcache.read.prefetch.monitor import StallMonitor
from shardcache.read.prefetch.options import PrefetchOptions, PrefetchStats
from shardcache.read.prefetch.prefetcher import DevicePrefetcher

__all__ = [
    "DeviceBackend",
    "DevicePrefetcher",
    "PrefetchOptions",
    "PrefetchStats",
    "StallMonitor",
    "TorchDeviceBackend",
]
