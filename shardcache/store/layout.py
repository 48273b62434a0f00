"""The folder layout of a cache and the one place a manifest name becomes a path.

A cache directory::

    manifest.json            written last, atomically: its presence means "committed"
    index/lengths.npy        uint32 length of every sequence, in sample-id order
    quarantine.jsonl         one line per skipped bad record (sha256 in the manifest)
    shards/<part>-b<bucket>-<n>.arrow     a partition's shards of one bucket
    shards/merged-b<bucket>-<n>.arrow     partial shards of several partitions, joined at commit
    parts/build.json         the plan and the options fingerprint (build bookkeeping)
    parts/<part>.json        per-partition completion record (+ .lengths.npy, .quarantine.jsonl)
    .shares/                 job-array share markers and locks (only while shares run)
    .lock                    only while a build runs (shardcache.store.build_lock)

Names read from a manifest are joined to the cache folder only through :func:`cache_path`,
so the rule about which names are acceptable lives here: a shard name is exactly what the
writer makes (``p00042-b03-00007.arrow``, ``merged-b03-00000.arrow``), the index and
quarantine names are the fixed ones above, every digest is 64 lowercase hex characters, and
any other relative name (a remote listing under ``parts/``) is made of plain components (no
``..``, no leading ``/``, no backslash or NUL). Anything else is a
:class:`~shardcache.errors.CacheError` naming the field and the value, raised before any file
is opened or written: a crafted manifest cannot make a reader open, or a download write, a
file outside the folder it belongs to.
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
QUARANTINE = "quarantine.jsonl"
SHARES_DIR = ".shares"
BUILD_STATE = "build.json"  # in parts/: the plan + the options fingerprint
#: Token bytes per Arrow record batch. Small enough that a reader of a compressed shard
#: decompresses little more than it needs, large enough that per-batch overhead vanishes.
RECORD_BATCH_BYTES = 4 * 1024 * 1024
#: What :class:`~shardcache.store.shards.BucketWriter` names a shard (partition, bucket,
#: number), or :func:`~shardcache.store.shards.merge_shards` a commit's merged one.
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
    """``name`` if it is a shard name the writer makes, else :class:`CacheError`."""
    if not isinstance(name, str) or not SHARD_NAME.fullmatch(name):
        raise _refuse(field, name, "expected a shard name like 'p00000-b00-00000.arrow'")
    return name


def check_digest(digest: object, field: str = "sha256") -> str:
    """``digest`` if it is a sha256 hex digest (64 lowercase hex), else :class:`CacheError`."""
    if not isinstance(digest, str) or not SHA256_HEX.fullmatch(digest):
        raise _refuse(field, digest, "expected 64 lowercase hex characters")
    return digest


def check_relative_name(name: object, field: str = "name") -> str:
    """``name`` if it is a relative ``/``-separated path of plain components (letters,
    digits, ``._-``; not ``.`` or ``..``), else :class:`CacheError`."""
    if not isinstance(name, str) or not name:
        raise _refuse(field, name, "expected a non-empty relative name")
    parts = name.split("/")
    if not all(_PLAIN_PART.fullmatch(p) and p not in (".", "..") for p in parts):
        raise _refuse(field, name, "expected a relative name of plain components (no '..')")
    return name


def cache_path(root: str, *names: str) -> str:
    """``root/names...``: the path of a file of the cache folder ``root``."""
    return os.path.join(root, *names)


def shard_path(root: str, name: str) -> str:
    """The path of shard ``name`` (as listed in the manifest) in the cache folder ``root``;
    a name the writer does not make is a :class:`CacheError`."""
    return cache_path(root, SHARD_DIR, check_shard_name(name))


def merged_shard_name(bucket: int, number: int) -> str:
    """The name of the ``number``-th merged shard of ``bucket`` (see :data:`SHARD_NAME`)."""
    return f"{MERGED_OWNER}-b{bucket:02d}-{number:05d}.arrow"
