"""shardcache: pre-tokenize a corpus once into verified shards, stream token-budget batches."""

from __future__ import annotations

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

__version__ = "0.1.0"

__all__ = [
    "BadRecordError",
    "BuildLockedError",
    "CacheError",
    "CacheKeyMismatch",
    "CacheNotFoundError",
    "ConfigError",
    "CorruptShardError",
    "ShardcacheError",
    "SourceError",
    "StateError",
    "TokenizerError",
    "__version__",
]
