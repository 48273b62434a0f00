"""``shardcache check`` and ``shardcache lock``: is a cache (or a lock file) still what the
training code's configuration would build?

Three comparisons, all through :func:`shardcache.key.compare`:

* cache vs. current configuration (tokenizer, template, truncation; data when inputs or a
  data version are given),
* lock file vs. current configuration (the fast CI check: no cache data needed),
* lock file vs. cache (pure JSON: no tokenizer is loaded at all).

The recorded side (cache or lock) is "old", the current side "new". Data hashing, when the
inputs are given, is timed separately so its MB/s can be reported.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shardcache.config import chat_options_from_mapping, tokenize_options_from_mapping
from shardcache.key import (
    CacheKey,
    KeyComparison,
    compare,
    compute_key,
    data_component_from_files,
    data_component_from_version,
    manifest_key,
    read_lock,
)
from shardcache.sources import hash_file, list_inputs


@dataclass
class DataHashing:
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0

    @property
    def mb_per_second(self) -> float:
        return self.bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0


def current_data(values: Mapping[str, Any], hashing: DataHashing) -> dict[str, Any] | None:
    """The data component of the current configuration, or None when it is not given."""
    if values.get("data_version") is not None:
        return data_component_from_version(values["data_version"])
    inputs = values.get("input")
    if not inputs:
        return None
    files = list_inputs([inputs] if isinstance(inputs, str) else list(inputs))
    start = time.perf_counter()
    entries = [{"relpath": f.relpath, "size": f.size, "sha256": hash_file(f.path)} for f in files]
    hashing.files += len(files)
    hashing.bytes += sum(f.size for f in files)
    hashing.seconds += time.perf_counter() - start
    return data_component_from_files(entries)


def current_key(values: Mapping[str, Any], hashing: DataHashing) -> CacheKey:
    """The key the current configuration (recipe values + flags) would build."""
    from shardcache.chat import make_encoder

    encoder = make_encoder(tokenize_options_from_mapping(values), chat_options_from_mapping(values))
    return compute_key(encoder, current_data(values, hashing))


def compare_keys(old: CacheKey, new: CacheKey, strict: bool) -> KeyComparison:
    skip = ("data",) if new.components.get("data") is None else ()
    return compare(old, new, strict=strict, skip=skip)


def cache_key(path: str) -> CacheKey:
    """The key recorded in a cache's manifest (reads only manifest.json; folder or URL)."""
    from shardcache.remote import read_any_manifest

    return manifest_key(read_any_manifest(path), path)


def check_cache(path: str, values: Mapping[str, Any], strict: bool = False) -> KeyComparison:
    return compare_keys(cache_key(path), current_key(values, DataHashing()), strict)


def check_lock(lock: str, values: Mapping[str, Any], strict: bool = False) -> KeyComparison:
    return compare_keys(read_lock(lock), current_key(values, DataHashing()), strict)
