"""The manifest: the commit point of a cache, read and checked in one place.

``manifest.json`` is written last and atomically by a build's commit; its presence means the
cache is complete. Every reader (``open_cache``, ``ShardDataset``, ``info``, ``verify``,
``check``) gets it through :func:`read_manifest`.
"""

from __future__ import annotations

import json
import os
from typing import Any

from shardcache.errors import CacheNotFoundError, CorruptShardError
from shardcache.store.layout import FORMAT_VERSION, MANIFEST, PARTS_DIR


def read_manifest(cache_dir: str) -> dict[str, Any]:
    """Read ``manifest.json``; a directory without one holds no (committed) cache."""
    path = os.path.join(cache_dir, MANIFEST)
    if not os.path.exists(cache_dir):
        raise CacheNotFoundError(
            f"{cache_dir!r} does not exist; give the folder a `shardcache build --output` wrote"
        )
    if not os.path.isdir(cache_dir):
        raise CacheNotFoundError(
            f"{cache_dir!r} is a file, not a cache folder; give the folder a `shardcache build "
            "--output` wrote"
        )
    if not os.path.isfile(path):
        hint = (
            " (a build was started there but never committed; rerun the build)"
            if os.path.isdir(os.path.join(cache_dir, PARTS_DIR))
            else ""
        )
        raise CacheNotFoundError(
            f"{cache_dir!r} holds no shardcache cache: {MANIFEST} is missing{hint}; "
            "build one with `shardcache build`"
        )
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as err:
        raise CorruptShardError(f"{path}: cannot read the manifest: {err}") from err
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise CorruptShardError(
            f"{path}: format_version {version!r} is not supported by this shardcache "
            f"(reads {FORMAT_VERSION}); rebuild the cache or use a matching shardcache version"
        )
    return manifest
