"""DevicePrefetcher (CPU batches to the accelerator) and StallMonitor (where a step waits)."""

from shardcache.read.device_prefetch.backend import DeviceBackend, TorchDeviceBackend
from shardcache.read.device_prefetch.monitor import StallMonitor
from shardcache.read.device_prefetch.options import PrefetchOptions, PrefetchStats
from shardcache.read.device_prefetch.prefetcher import DevicePrefetcher

__all__ = [
    "DeviceBackend",
    "DevicePrefetcher",
    "PrefetchOptions",
    "PrefetchStats",
    "StallMonitor",
    "TorchDeviceBackend",
]
