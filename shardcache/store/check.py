"""``shardcache check``, store side: the key a cache or lock records, and how two compare.

The key of the *current* configuration needs the tokenizer
(:func:`shardcache.builder.key_computation.current_key`); the CLI puts the two together.
"""

from __future__ import annotations

from shardcache.store.key import CacheKey, KeyComparison, compare, manifest_key
from shardcache.store.manifest import read_manifest
from shardcache.store.remote import RemoteCache, is_url


def read_any_manifest(path: str) -> dict:
    """The manifest of a cache folder or URL (reads only the manifest).

    Args:
        path: the cache folder or URL.

    Returns:
        The validated manifest.

    Raises:
        CacheNotFoundError: no committed cache there.
        CorruptShardError: the manifest is malformed.
    """
    return RemoteCache(path).manifest if is_url(path) else read_manifest(path)


def compare_keys(old: CacheKey, new: CacheKey, strict: bool) -> KeyComparison:
    """Compare a recorded key with the current configuration's.

    Args:
        old: the recorded key.
        new: the current key; its data part is skipped when it has none.
        strict: library version differences are errors too.

    Returns:
        The comparison (:func:`~shardcache.store.key.compare`).
    """
    skip = ("data",) if new.components.get("data") is None else ()
    return compare(old, new, strict=strict, skip=skip)


def cache_key(path: str) -> CacheKey:
    """The key recorded in a cache's manifest (reads only the manifest).

    Args:
        path: the cache folder or URL.

    Returns:
        The key.

    Raises:
        CacheNotFoundError: no committed cache there.
    """
    return manifest_key(read_any_manifest(path), path)
