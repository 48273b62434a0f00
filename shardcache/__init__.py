"""shardcache: pre-tokenize a corpus once into verified shards, stream token-budget batches.

The build side (``build``, ``open_cache``, options, errors) imports without torch; the
torch-based reader classes (``ShardDataset``) are imported on first access.
"""

from __future__ import annotations

from typing import Any

from shardcache.build import BuildReport, build_cache
from shardcache.cache import Cache, Provenance, Sequence, open_cache
from shardcache.config import BuildOptions, LayoutOptions, SourceOptions, TokenizeOptions
from shardcache.errors import (
    BadRecordError,
    BuildLockedError,
    CacheError,
    CacheKeyMismatch,
    CacheNotFoundError,
    ConfigError,
    CorruptShardError,
    ShardcacheError,
    SourceError,
    StateError,
    TokenizerError,
)
from shardcache.format import FORMAT_VERSION
from shardcache.read.plan import EpochPlan, PlanOptions, plan_epoch
from shardcache.verify import VerifyReport, verify_cache
from shardcache.version import __version__

_LAZY = {
    "DeviceBackend": "shardcache.read.prefetch",
    "DevicePrefetcher": "shardcache.read.prefetch",
    "EpochSplit": "shardcache.read.plan",
    "PrefetchOptions": "shardcache.read.prefetch",
    "PrefetchStats": "shardcache.read.prefetch",
    "ShardDataset": "shardcache.read.dataset",
    "TorchDeviceBackend": "shardcache.read.prefetch",
    "split_epoch": "shardcache.read.plan",
}

__all__ = [  # noqa: RUF022 - plain sorted order, checked by a test
    "BadRecordError",
    "BuildLockedError",
    "BuildOptions",
    "BuildReport",
    "Cache",
    "CacheError",
    "CacheKeyMismatch",
    "CacheNotFoundError",
    "ConfigError",
    "CorruptShardError",
    "DeviceBackend",
    "DevicePrefetcher",
    "EpochPlan",
    "EpochSplit",
    "FORMAT_VERSION",
    "LayoutOptions",
    "PlanOptions",
    "PrefetchOptions",
    "PrefetchStats",
    "Provenance",
    "Sequence",
    "ShardDataset",
    "ShardcacheError",
    "SourceError",
    "SourceOptions",
    "StateError",
    "TokenizeOptions",
    "TokenizerError",
    "TorchDeviceBackend",
    "VerifyReport",
    "__version__",
    "build_cache",
    "open_cache",
    "plan_epoch",
    "split_epoch",
    "verify_cache",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'shardcache' has no attribute {name!r}")
