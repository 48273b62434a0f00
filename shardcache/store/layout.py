"""The folder layout of a cache and the one place a manifest name becomes a path.

A cache folder holds ``manifest.json`` (written last: its presence means committed),
``index/lengths.npy``, ``index/content_keys.npy`` (caches built before content keys: none),
``quarantine.jsonl``, ``shards/*.arrow``, and while building ``parts/``,
``.shares/`` and ``.lock``. Manifest names become paths only after the checks here, so a crafted
manifest cannot make a reader open, or a download write, outside its folder.
"""

from __future__ import annotations

import os
import re

from shardcache.errors import CacheError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SHARD_DIR = "shards"
INDEX_DIR = "index"
PARTS_DIR = "parts"
LENGTHS_FILE = "index/lengths.npy"
#: A 64-bit hash of every sequence's document content (uint64, in sample-id order).
CONTENT_KEYS_FILE = "index/content_keys.npy"
QUARANTINE = "quarantine.jsonl"
SHARES_DIR = ".shares"
BUILD_STATE = "build.json"  # in parts/: the plan + the options fingerprint
#: Token bytes per Arrow record batch. Small enough that a reader of a compressed shard
#: decompresses little more than it needs, large enough that per-batch overhead vanishes.
RECORD_BATCH_BYTES = 4 * 1024 * 1024
#: What ``shards.BucketWriter`` names a shard (partition, bucket, number), or
#: ``shards.merge_shards`` a commit's merged one.
SHARD_NAME = re.compile(r"(p[0-9]{5,}|merged)-b[0-9]{2,}-[0-9]{5,}\.arrow")
#: The owner part of a merged shard's name: no partition owns it.
MERGED_OWNER = "merged"
#: A partition id of the build plan (``p00042``).
PARTITION_ID = re.compile(r"p[0-9]{5,}")
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_PLAIN_PART = re.compile(r"[A-Za-z0-9._\-]+")


def _refuse(field: str, value: object, expected: str) -> CacheError:
    shown = repr(value) if len(repr(value)) <= 200 else repr(value)[:200] + "..."
    return CacheError(
        f"{field} is {shown}: {expected}; names and digests of a cache must stay inside its "
        "folder, so nothing was opened or written for it. The manifest (or the store's "
        "listing) is damaged or was not written by shardcache: rebuild the cache"
    )


def check_shard_name(name: object, field: str = "shard name") -> str:
    """Return ``name`` if it is a shard name the writer makes, else raise CacheError."""
    if not isinstance(name, str) or not SHARD_NAME.fullmatch(name):
        raise _refuse(field, name, "expected a shard name like 'p00000-b00-00000.arrow'")
    return name


def check_digest(digest: object, field: str = "sha256") -> str:
    """Return ``digest`` if it is a sha256 hex digest (64 lowercase hex), else raise CacheError."""
    if not isinstance(digest, str) or not SHA256_HEX.fullmatch(digest):
        raise _refuse(field, digest, "expected 64 lowercase hex characters")
    return digest


def check_relative_name(name: object, field: str = "name") -> str:
    """Return ``name`` if a relative ``/`` path of plain parts (no ``..``); else CacheError."""
    if not isinstance(name, str) or not name:
        raise _refuse(field, name, "expected a non-empty relative name")
    parts = name.split("/")
    if not all(_PLAIN_PART.fullmatch(p) and p not in (".", "..") for p in parts):
        raise _refuse(field, name, "expected a relative name of plain components (no '..')")
    return name


def cache_path(root: str, *names: str) -> str:
    """The path of a file in a cache folder."""
    return os.path.join(root, *names)


def shard_path(root: str, name: str) -> str:
    """The path of a shard listed in the manifest (CacheError unless a writer-made name)."""
    return cache_path(root, SHARD_DIR, check_shard_name(name))


def merged_shard_name(bucket: int, number: int) -> str:
    """The file name of a commit's merged shard ``number`` of ``bucket``."""
    return f"{MERGED_OWNER}-b{bucket:02d}-{number:05d}.arrow"


def share_name(index: int, count: int) -> str:
    """The name of a job-array share's lock folder and note under ``SHARES_DIR``."""
    return f"share-{index}-of-{count}"


def parse_share_name(name: str) -> tuple[int, int] | None:
    """``(i, N)`` of a ``share_name``, or None for any other name."""
    parts = name.split("-")
    if len(parts) != 4 or parts[0] != "share" or parts[2] != "of":
        return None
    if not (parts[1].isdigit() and parts[3].isdigit()):
        return None
    return int(parts[1]), int(parts[3])
