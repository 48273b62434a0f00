"""DevicePrefetcher: move upstream CPU batches to the accelerator without stalling training.

The overview (data flow, ownership rule, shutdown) is in prefetcher.py; ring.py is the pinned
slot ring and packer thread, backend.py the device API, tree.py nested-batch flattening and
options.py the options and metrics.
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
