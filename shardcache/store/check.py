"""``shardcache check``, store side: the key a cache or lock records, and how two compare.

The current key needs the tokenizer (``builder.key_computation.current_key``); the CLI joins them.
"""

from __future__ import annotations

from shardcache.store.key import CacheKey, KeyComparison, compare, manifest_key
from shardcache.store.manifest import read_manifest
from shardcache.store.remote import RemoteCache, is_url


def read_any_manifest(path: str) -> dict:
    """The validated manifest of a cache folder or URL (reads only the manifest)."""
    return RemoteCache(path).manifest if is_url(path) else read_manifest(path)


def compare_keys(old: CacheKey, new: CacheKey, strict: bool) -> KeyComparison:
    """Compare a recorded key with the current one (its ``data`` is skipped when it has none)."""
    skip = ("data",) if new.components.get("data") is None else ()
    return compare(old, new, strict=strict, skip=skip)


def cache_key(path: str) -> CacheKey:
    """The key recorded in the manifest of a cache folder or URL."""
    return manifest_key(read_any_manifest(path), path)
