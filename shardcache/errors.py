"""The shardcache exception tree.

Every error a user can cause or meet derives from :class:`ShardcacheError`, so a caller can
catch one type, and the CLI maps the whole tree to exit codes at the boundary (cli.py).
Messages follow one template: what failed -> the values -> why -> what to do.

::

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

Only :class:`ConfigError` means "usage error" (exit 2); all others are failures (exit 1).
"""

from __future__ import annotations


class ShardcacheError(Exception):
    """Root of every error raised by shardcache."""


class ConfigError(ShardcacheError, ValueError):
    """An option, a recipe entry or an argument has an invalid value."""


class SourceError(ShardcacheError):
    """An input path cannot be listed, opened or decoded."""


class BadRecordError(SourceError):
    """A single input record is malformed and the build runs with ``on_error='fail'``."""


class TokenizerError(ShardcacheError):
    """The tokenizer cannot be loaded or cannot be used the way the build needs."""


class EncoderError(TokenizerError):
    """The accelerated encoder was required (``--encoder fast``) but cannot be used for this
    tokenizer / build, or produced ids that differ from the Hugging Face tokenizer's."""


class CacheError(ShardcacheError):
    """A problem with a cache directory on disk."""


class CacheNotFoundError(CacheError):
    """The path holds no committed cache (no manifest.json)."""


class CorruptShardError(CacheError):
    """A shard or index file fails a checksum or a structural check."""


class CacheKeyMismatch(CacheError):
    """The cache was built under a different cache key than the one expected.

    Args:
        message: what differs and what to do.
        differences: the changed fields as ``(component, field, old, new)`` tuples (kept as
            the attribute ``differences``).
    """

    def __init__(self, message: str, differences: list[tuple[str, str, object, object]]):
        super().__init__(message)
        self.differences = differences


class BuildLockedError(CacheError):
    """Another build that is still alive writes to the same output directory."""


class IncompleteBuildError(CacheError):
    """``shardcache commit`` found partitions without a completion record.

    Args:
        message: which and what to do.
        missing: their ids (kept as the attribute ``missing``).
    """

    def __init__(self, message: str, missing: list[str]):
        super().__init__(message)
        self.missing = missing


class MissingDependencyError(ShardcacheError, ImportError):
    """An optional dependency (``shardcache[ray]``, ``shardcache[s3]``, ``shardcache[fast]``
    for ``--encoder fast``) is not installed."""


class StateError(ShardcacheError, ValueError):
    """A reader state that does not belong to this cache or these plan options."""
