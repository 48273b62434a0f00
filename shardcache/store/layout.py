"""The folder layout of a cache and the one place a manifest name becomes a path.

A cache directory::

    manifest.json            written last, atomically: its presence means "committed"
    index/lengths.npy        uint32 length of every sequence, in sample-id order
    quarantine.jsonl         one line per skipped bad record (sha256 in the manifest)
    shards/<part>-b<bucket>-<n>.arrow
    parts/build.json         the plan and the options fingerprint (build bookkeeping)
    parts/<part>.json        per-partition completion record (+ .lengths.npy, .quarantine.jsonl)
    .shares/                 job-array share markers and locks (only while shares run)
    .lock                    only while a build runs (shardcache.build.lock)

Names read from a manifest are joined to the cache folder only through :func:`cache_path`,
so the rule about which names are acceptable lives here.
"""

from __future__ import annotations

import os

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SHARD_DIR = "shards"
INDEX_DIR = "index"
PARTS_DIR = "parts"
LENGTHS_FILE = "index/lengths.npy"
QUARANTINE = "quarantine.jsonl"
SHARES_DIR = ".shares"
BUILD_STATE = "build.json"  # in parts/: the plan + the options fingerprint
#: Token bytes per Arrow record batch. Small enough that a reader of a compressed shard
#: decompresses little more than it needs, large enough that per-batch overhead vanishes.
RECORD_BATCH_BYTES = 4 * 1024 * 1024


def cache_path(root: str, *names: str) -> str:
    """``root/names...``: the path of a file of the cache folder ``root``."""
    return os.path.join(root, *names)


def shard_path(root: str, name: str) -> str:
    """The path of shard ``name`` (as listed in the manifest) in the cache folder ``root``."""
    return cache_path(root, SHARD_DIR, name)
