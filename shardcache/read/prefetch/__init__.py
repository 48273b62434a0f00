"""DevicePrefetcher: move upstream CPU batches to the accelerator without stalling training
(prefetcher.py: ownership and shutdown; ring.py, backend.py, tree.py, options.py).
"""

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
