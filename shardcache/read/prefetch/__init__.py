"""DevicePrefetcher: move CPU batches to the accelerator without stalling training."""

from shardcache.read.prefetch.backend import DeviceBackend, TorchDeviceBackend
from shardcache.read.prefetch.options import PrefetchOptions, PrefetchStats
from shardcache.read.prefetch.prefetcher import DevicePrefetcher

__all__ = [
    "DeviceBackend",
    "DevicePrefetcher",
    "PrefetchOptions",
    "PrefetchStats",
    "TorchDeviceBackend",
]
