"""The shardcache exception tree.

Every error a user can cause or meet derives from ``ShardcacheError``; the CLI maps the tree to
exit codes. Messages say what failed -> the values -> why -> what to do.

    ShardcacheError
    ├── ConfigError (also ValueError)        bad option / recipe value; CLI exit 2
    ├── SourceError                          an input cannot be listed or read
    │   └── BadRecordError                   one record is malformed (--on-error fail)
    ├── TokenizerError                       tokenizer missing, slow-only, unusable
    │   └── EncoderError                     --encoder fast cannot be used, or disagreed with HF
    ├── CacheError                           the cache on disk
    │   ├── CacheNotFoundError               no committed manifest at the path
    │   ├── CorruptShardError                a shard fails a checksum or structure check
    │   ├── CacheKeyMismatch                 cache built under another key (fields listed)
    │   ├── BuildLockedError                 another live build holds the output
    │   └── IncompleteBuildError             commit: partitions (job-array shares) missing
    ├── MissingDependencyError (ImportError) an optional extra is not installed (pip command)
    └── StateError (also ValueError)         a reader state that does not fit this cache/plan
"""

from __future__ import annotations


class ShardcacheError(Exception):
    """Root of every error raised by shardcache: catch it to catch them all."""


class ConfigError(ShardcacheError, ValueError):
    """An option, a recipe entry or an argument has an invalid value: fix it (CLI exit 2)."""


class SourceError(ShardcacheError):
    """An input path cannot be listed, opened or decoded."""


class BadRecordError(SourceError):
    """One input record is malformed under ``on_error='fail'``; ``'skip'`` quarantines it."""


class TokenizerError(ShardcacheError):
    """The tokenizer cannot be loaded, or cannot be used the way the build needs."""


class EncoderError(TokenizerError):
    """``--encoder fast`` cannot be used, or disagreed with HF: build with ``auto`` or ``hf``."""


class CacheError(ShardcacheError):
    """A problem with a cache folder on disk."""


class CacheNotFoundError(CacheError):
    """The path holds no committed cache (no manifest.json): build or commit one."""


class CorruptShardError(CacheError):
    """A shard, index or manifest fails a checksum or structural check: rebuild."""


class CacheKeyMismatch(CacheError):
    """The cache was built under another cache key than the one expected: rebuild it.

    Args:
        message: what differs and what to do.
        differences: ``(component, field, old, new)`` per changed field (kept as ``differences``).
    """

    def __init__(self, message: str, differences: list[tuple[str, str, object, object]]):
        super().__init__(message)
        self.differences = differences


class BuildLockedError(CacheError):
    """Another live build writes to the same output: wait for it, stop it, or use another."""


class IncompleteBuildError(CacheError):
    """``shardcache commit`` found partitions without a completion record: run their shares.

    Args:
        message: which partitions, and what to do.
        missing: their ids (kept as ``missing``).
    """

    def __init__(self, message: str, missing: list[str]):
        super().__init__(message)
        self.missing = missing


class MissingDependencyError(ShardcacheError, ImportError):
    """An optional extra (``shardcache[ray]``/``[s3]``/``[fast]``) is missing: install it."""


class StateError(ShardcacheError, ValueError):
    """A reader state saved for another cache or other plan options: resume with the same ones."""
