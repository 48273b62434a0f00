"""Integrity checked once per file version: a record of the files whose sha256 matched.

A file that hashed clean gets an empty marker named by a digest of its identity (absolute path,
size, mtime_ns, inode, the manifest's sha256) under ``$SHARDCACHE_CACHE_DIR/verified/``: later
processes skip the hash after one ``stat``, and any change to the file or manifest changes the
identity. One process hashes under an exclusive ``flock``; the others wait, then find the marker.
An unwritable folder keeps the record in this process only.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from shardcache.errors import CorruptShardError
from shardcache.store.files import (
    CACHE_DIR_ENV,
    cache_root,
    exclusive_lock,
    resource_limit_error,
    sha256_file,
    sha256_text,
)

CHECKSUMS_ENV = "SHARDCACHE_SHARD_CHECKSUMS"
VERIFIED_DIR = "verified"

#: identities verified by this process (also the fallback when no marker can be written)
_SEEN: set[str] = set()


def checksums_enabled(checksum: bool | None = None) -> bool:
    """Whether shard reads check sha256: ``checksum``, else ``$SHARDCACHE_SHARD_CHECKSUMS`` != 0."""
    if checksum is not None:
        return checksum
    return os.environ.get(CHECKSUMS_ENV, "1").lower() not in ("0", "false", "no")


def _identity(path: str, st: os.stat_result, sha256: str) -> str:
    text = "|".join(map(str, (os.path.abspath(path), st.st_size, st.st_mtime_ns, st.st_ino)))
    return sha256_text(f"{text}|{sha256}")


#: marker folders known to exist, by cache root (a reader opens thousands of shards: no
#: ``mkdir`` per open)
_FOLDERS: set[str] = set()


#: the markers' root folder by the value of ``$SHARDCACHE_CACHE_DIR`` (cache_root() costs a
#: stat and a home-folder lookup)
_ROOTS: dict[str | None, str] = {}


def _marker(identity: str, create: bool = True) -> str | None:
    """The marker's path (None when its folder cannot be made); ``create=False`` makes no folder."""
    try:
        env = os.environ.get(CACHE_DIR_ENV)
        root = _ROOTS.get(env)
        if root is None:
            root = _ROOTS[env] = os.path.join(cache_root(), VERIFIED_DIR)
        folder = os.path.join(root, identity[:2])
        if create and folder not in _FOLDERS:
            os.makedirs(folder, exist_ok=True)
            _FOLDERS.add(folder)
    except OSError:
        return None
    return os.path.join(folder, identity)


def is_verified(path: str, sha256: str, st: os.stat_result | None = None) -> bool:
    """Whether a file, as it is now, hashed clean before (in this or an earlier process)."""
    st = os.stat(path) if st is None else st
    identity = _identity(path, st, sha256)
    if identity in _SEEN:
        return True
    marker = _marker(identity, create=False)
    if marker is not None and os.path.exists(marker):
        _SEEN.add(identity)
        return True
    return False


def record_verified(path: str, sha256: str, st: os.stat_result | None = None) -> None:
    """Record that a file, as it is now, hashed clean (for this and later processes)."""
    st = os.stat(path) if st is None else st
    identity = _identity(path, st, sha256)
    _SEEN.add(identity)
    marker = _marker(identity)
    if marker is not None and not os.path.exists(marker):
        # an empty file whose existence is the record: creating it is atomic, and one lost to
        # a power cut only means hashing again, so no temporary file and no fsync
        with contextlib.suppress(OSError), open(marker, "ab"):
            pass


def check_file(path: str, entry: dict[str, Any], what: str, checksum: bool | None = None) -> bool:
    """Check a cache file's presence, size and sha256 against its manifest entry.

    Raises CorruptShardError; returns whether the sha256 was confirmed (now or by a record).
    """
    try:
        st = os.stat(path)
    except OSError as err:
        raise CorruptShardError(
            f"{path}: {what} listed in the manifest is missing or unreadable ({err}); the cache "
            "is incomplete: rebuild it or restore the file"
        ) from err
    expected_bytes = entry.get("bytes")
    if expected_bytes is not None and st.st_size != int(expected_bytes):
        raise CorruptShardError(
            f"{path}: not a readable {what}: {st.st_size} bytes but the manifest says "
            f"{expected_bytes} (truncated or replaced); run `shardcache verify` and rebuild"
        )
    expected = entry.get("sha256")
    if not expected or not checksums_enabled(checksum):
        return False
    expected = str(expected)
    if is_verified(path, expected, st):
        return True
    marker = _marker(_identity(path, st, expected))
    with contextlib.ExitStack() as stack:
        # one process hashes, the others wait on the lock and then find the marker
        locked = marker is not None and stack.enter_context(exclusive_lock(marker + ".lock"))
        if locked and is_verified(path, expected, st):
            return True
        try:
            actual = sha256_file(path)
        except OSError as err:
            limit = resource_limit_error(err, path)
            if limit is not None:
                raise limit from err
            raise
        if actual != expected:
            raise CorruptShardError(
                f"{path}: checksum mismatch: sha256 {actual[:16]}... but the manifest says "
                f"{expected[:16]}...; the {what} is corrupt (flipped bytes or a partial write): "
                "run `shardcache verify CACHE` to list every damaged file, then rebuild"
            )
        record_verified(path, expected, st)
    return True
