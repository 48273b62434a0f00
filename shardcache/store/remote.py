"""Caches and inputs in object storage (``s3://``, ``gs://``, ``file://`` ...) through fsspec.

A cache at a URL is read through local copies: its manifest (each open), its length index (once
per content) and its shards on demand, in the content-addressed ``$SHARDCACHE_CACHE_DIR/objects``
that local processes share, bounded by ``SHARDCACHE_CACHE_SIZE``. Downloads are checked against
the manifest's sha256 and size before they are renamed into place.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from typing import Any

from shardcache.config import parse_size
from shardcache.errors import (
    CacheError,
    CacheNotFoundError,
    ConfigError,
    CorruptShardError,
    MissingDependencyError,
)
from shardcache.store.files import CACHE_DIR_ENV as CACHE_DIR_ENV  # re-exported
from shardcache.store.files import (
    cache_root,
    copy_hashing,
    private_tmp,
    sha256_text,
    write_bytes_atomic,
)
from shardcache.store.integrity import record_verified
from shardcache.store.layout import (
    MANIFEST,
    PARTS_DIR,
    SHARD_DIR,
    check_digest,
    check_shard_name,
)
from shardcache.store.manifest import read_manifest

CACHE_SIZE_ENV = "SHARDCACHE_CACHE_SIZE"
DEFAULT_CACHE_SIZE_BYTES = 64 << 30
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")
_CHUNK = 8 << 20
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}


def is_url(path: str | os.PathLike[str]) -> bool:
    """Whether a location is a ``scheme://...`` URL (object stores, ``file://``), not a path."""
    return bool(_URL.match(os.fspath(path)))


def filesystem(url: str) -> tuple[Any, str]:
    """The fsspec filesystem of a URL and the path inside it, without a trailing ``/``.

    Raises ``MissingDependencyError`` (naming the pip command) when the scheme's package is
    missing, ``ConfigError`` when fsspec does not know the URL.
    """
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(url)
    except ImportError as err:
        scheme = url.split("://", 1)[0]
        extra = _EXTRAS.get(scheme)
        package = err.name or f"the fsspec backend for {scheme}://"
        command = "pip install 'shardcache[s3]'" if extra == "s3" else f"pip install {package}"
        raise MissingDependencyError(
            f"{url!r}: the {scheme}:// filesystem needs an optional package that is not "
            f"installed ({err}); install it with `{command}`"
        ) from err
    except ValueError as err:
        raise ConfigError(f"{url!r}: not a URL fsspec can open ({err}); check the scheme") from err
    return fs, path.rstrip("/")


def unreachable(err: BaseException, url: str) -> CacheError | None:
    """A ``CacheError`` naming what to check when ``err`` means the store could not be reached.

    None for other errors; network errors are recognised by class name (builtin, botocore, aiohttp).
    """
    names = {t.__name__ for t in type(err).__mro__}
    network = {"EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError",
               "ConnectionError", "TimeoutError", "ServerTimeoutError"}  # fmt: skip
    if not names & network:
        return None
    endpoint = os.environ.get("AWS_ENDPOINT_URL") or "the default endpoint"
    return CacheError(
        f"{url!r}: cannot reach the object store ({type(err).__name__}: {err}); check the "
        f"network, the endpoint ({endpoint}; AWS_ENDPOINT_URL or the fsspec options) and the "
        "credentials, then retry"
    )


def cache_size_bytes() -> int:
    """The bound of the local shard cache: ``$SHARDCACHE_CACHE_SIZE`` or the 64 GiB default."""
    value = os.environ.get(CACHE_SIZE_ENV)
    return parse_size(value, CACHE_SIZE_ENV) if value else DEFAULT_CACHE_SIZE_BYTES


def url_digest(text: str) -> str:
    """A short stable folder name for a URL (20 hex characters of its sha256)."""
    return sha256_text(text)[:20]


def download(
    fs: Any,
    rpath: str,
    local: str,
    sha256: str | None,
    size: int | None,
    tmp: str | None = None,
) -> None:
    """Stream an object into ``local`` through a temporary file, checked, then renamed.

    ``sha256``/``size`` of None are not checked. ``tmp`` is a file ``ObjectStore`` reserved at full
    size; by default a private tmp beside ``local``. A wrong size or digest raises
    ``CorruptShardError``, a missing object ``CacheError``.
    """
    os.makedirs(os.path.dirname(local) or ".", exist_ok=True)
    reserved = tmp is not None
    tmp = tmp or private_tmp(local)
    digest = hashlib.sha256()
    with contextlib.suppress(Exception):
        fs.invalidate_cache(rpath)  # a listing cached before the object was replaced
    try:
        with (
            fs.open(rpath, "rb", block_size=_CHUNK) as src,
            open(tmp, "r+b" if reserved else "wb") as dst,
        ):
            got, _ = copy_hashing(src, dst, digest)
            dst.truncate(got)
        if size is not None and got != int(size):
            raise CorruptShardError(
                f"{fs.unstrip_protocol(rpath)}: downloaded {got} bytes but the manifest says "
                f"{size}: the object was truncated or replaced; run `shardcache verify` on the "
                "URL and rebuild the cache"
            )
        if sha256 and digest.hexdigest() != sha256:
            raise CorruptShardError(
                f"{fs.unstrip_protocol(rpath)}: checksum mismatch on download: sha256 "
                f"{digest.hexdigest()[:16]}... but the manifest says {sha256[:16]}...; the "
                "object is corrupt: run `shardcache verify` on the URL and rebuild the cache"
            )
        os.replace(tmp, local)
        if sha256:  # hashed while streaming: readers of this copy need not hash it again
            record_verified(local, sha256)
    except FileNotFoundError as err:
        raise CacheError(
            f"{fs.unstrip_protocol(rpath)}: listed in the manifest but missing from the store "
            f"({err}); the cache is incomplete: rebuild it"
        ) from err
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


# ------------------------------------------------------------------------- read side

#: Per object ``<sha>.lock``: shared while some process has the object open (readers hold it
#: as long as the shard is in their LRU), exclusive only for the instant an evictor deletes it
#: (non-blocking: an evictor never waits). Per object ``<sha>.fetch``: exclusive while one
#: process downloads it. Folder-wide ``.space.lock``: exclusive while one process makes room
#: and reserves the bytes of a download. Nobody waits for a lock while holding one that others
#: keep long, so no wait can close a cycle (an exclusive lock taken while readers hold shared
#: locks on the shards of their LRUs would let two readers wait for each other).
_SPACE_LOCK = ".space.lock"
logger = logging.getLogger("shardcache")


class ObjectStore:
    """The bounded, content-addressed folder of downloaded shards shared by local processes.

    The bound is hard for closed objects: before a download, least-recently-opened objects no
    process holds open are evicted until it fits, and the download's bytes are reserved (its tmp is
    created at full size), so concurrent downloads cannot overshoot together. Open objects are never
    deleted: when they alone exceed the bound, ``acquire`` asks its caller to ``shed`` idle ones,
    then warns once and goes over the bound rather than failing the reader.
    """

    def __init__(self, folder: str, size_bytes: int):
        self.folder = folder
        self.size_bytes = size_bytes
        os.makedirs(folder, exist_ok=True)

    def path(self, sha256: str) -> str:
        """The local path of object ``sha256``, there or not; ``CacheError`` if not a hex digest."""
        return os.path.join(self.folder, f"{check_digest(sha256, 'shard sha256')}.arrow")

    def acquire(
        self,
        fs: Any,
        rpath: str,
        info: dict[str, Any],
        shed: Callable[[], bool] | None = None,
    ) -> tuple[str, Callable[[], None]]:
        """Download a shard if needed and hold it; return its local path and the release to call.

        Until released, a shared lock keeps it from eviction. A process takes each object's lock
        once and counts its users: ``flock`` locks of two descriptors conflict even in one process.
        ``shed`` closes one shard the caller holds but does not need (False: none).
        """
        sha = check_digest(info["sha256"], "shard sha256")  # it names files here
        size = int(info["bytes"])
        path = self.path(sha)
        with _HELD_LOCK:
            held = _HELD.get(path)
            if held is not None and os.path.isfile(path):  # (the folder may have been wiped)
                held[1] += 1
                return path, functools.partial(_release, path)
        fd = _open_lock(os.path.join(self.folder, f"{sha}.lock"))
        try:
            # waits only for an evictor's instant exclusive lock; from here on the object
            # cannot be deleted
            fcntl.flock(fd, fcntl.LOCK_SH)
            if not _complete(path, size):
                self._download(fs, rpath, sha, size, shed)
            st = os.stat(path)
            os.utime(path, ns=(time.time_ns(), st.st_mtime_ns))  # atime = LRU order
        except BaseException:
            os.close(fd)
            raise
        with _HELD_LOCK:
            held = _HELD.get(path)
            if held is not None:  # another thread opened it meanwhile, or it was re-fetched
                held[1] += 1
                fd, held[0] = held[0], fd  # keep the lock on the file that is there now
                os.close(fd)
            else:
                _HELD[path] = [fd, 1]
        return path, functools.partial(_release, path)

    def _download(
        self, fs: Any, rpath: str, sha: str, size: int, shed: Callable[[], bool] | None
    ) -> None:
        """Download one object (one process at a time per object), room made first."""
        path = self.path(sha)
        fd = _open_lock(os.path.join(self.folder, f"{sha}.fetch"))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # the holder only downloads: a bounded wait
            if _complete(path, size):  # another process downloaded it while we waited
                return
            tmp = private_tmp(path)
            try:
                self._reserve(tmp, sha, size, shed)
                download(fs, rpath, path, sha, size, tmp=tmp)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(tmp)
        finally:
            os.close(fd)

    def _reserve(self, tmp: str, sha: str, size: int, shed: Callable[[], bool] | None) -> None:
        """Make room for ``size`` bytes and reserve them by creating ``tmp`` at that size."""
        fd = _open_lock(os.path.join(self.folder, _SPACE_LOCK))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # the holder never waits for another lock
            used = self._usage()
            used -= self._evict(used + size - self.size_bytes, keep=sha)
            while used + size > self.size_bytes and shed is not None and shed():
                used -= self._evict(used + size - self.size_bytes, keep=sha)
            if used + size > self.size_bytes:
                self._report_over(used, size)
            with open(tmp, "wb") as f:
                f.truncate(size)
        finally:
            os.close(fd)

    def _usage(self) -> int:
        """Bytes of objects plus reservations in flight; dead downloads' tmp files are deleted."""
        used = 0
        with os.scandir(self.folder) as it:
            entries = list(it)
        for entry in entries:
            with contextlib.suppress(FileNotFoundError):
                if entry.name.endswith(".arrow"):
                    used += entry.stat().st_size
                elif entry.name.endswith(".tmp"):
                    sha = entry.name.split(".", 1)[0]
                    if _try_exclusive(os.path.join(self.folder, f"{sha}.fetch"), entry.path):
                        continue  # nobody downloads it: a leftover, removed
                    used += entry.stat().st_size
        return used

    def _evict(self, need: int, keep: str) -> int:
        """Delete least-recently-opened objects no process holds until ``need`` bytes are freed."""
        if need <= 0:
            return 0
        entries = []
        with os.scandir(self.folder) as it:
            for entry in it:
                if entry.name.endswith(".arrow"):
                    with contextlib.suppress(FileNotFoundError):
                        st = entry.stat()
                        entries.append((st.st_atime_ns, st.st_size, entry.name[: -len(".arrow")]))
        freed = 0
        for _, size, sha in sorted(entries):
            if freed >= need:
                break
            if sha == keep or self.path(sha) in _HELD:
                continue  # open in this process
            lock = os.path.join(self.folder, f"{sha}.lock")
            if _try_exclusive(lock, self.path(sha)):
                freed += size
        return freed

    def _report_over(self, used: int, size: int) -> None:
        """Warn once per folder that the open shards alone exceed the bound."""
        if self.folder in _REPORTED:
            return
        _REPORTED.add(self.folder)
        logger.warning(
            "local shard cache %s: the shards open in reader processes hold %d bytes, so the "
            "next %d-byte shard takes the folder to %d bytes, over SHARDCACHE_CACHE_SIZE=%d "
            "(open shards are never deleted; the folder shrinks back as they are closed); "
            "raise SHARDCACHE_CACHE_SIZE or open fewer shards at once (fewer DataLoader "
            "workers or ranks per machine)",
            self.folder,
            used,
            size,
            used + size,
            self.size_bytes,
        )


def _open_lock(path: str) -> int:
    """Open (creating) a lock file; return its descriptor."""
    return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)


def _complete(path: str, size: int) -> bool:
    """Whether ``path`` exists with exactly ``size`` bytes."""
    try:
        return os.path.getsize(path) == size
    except FileNotFoundError:
        return False


def _try_exclusive(lock: str, victim: str) -> bool:
    """Delete ``victim`` if the exclusive lock ``lock`` is free right now (never waits)."""
    fd = _open_lock(lock)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # held by some process
        try:
            os.remove(victim)
        except FileNotFoundError:
            return False
        return True
    finally:
        os.close(fd)


#: object path -> [lock fd, users] for the objects this process holds open (by path, not by
#: sha256: two local folders may hold the same shard, and holding one must neither pin nor
#: unlock the other). A forked child inherits the descriptors (and so the shared locks, until
#: both sides close them): still correct.
_HELD: dict[str, list[int]] = {}
#: guards _HELD; replaced in a forked child (a DataLoader worker may be forked while another
#: thread of the parent holds it)
_HELD_LOCK = threading.Lock()


def _new_held_lock() -> None:
    """Replace ``_HELD_LOCK`` in a forked child: another parent thread may have held it."""
    global _HELD_LOCK
    _HELD_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_new_held_lock)
#: object folders whose bound was reported exceeded (once per process)
_REPORTED: set[str] = set()


def _release(path: str) -> None:
    """One user of ``path`` is done with it; the last one's shared lock goes with it."""
    with _HELD_LOCK:
        held = _HELD.get(path)
        if held is None:
            return
        held[1] -= 1
        if held[1] > 0:
            return
        del _HELD[path]
    with contextlib.suppress(OSError):
        os.close(held[0])


class RemoteCache:
    """A committed cache at a URL, seen through a local folder holding its manifest."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        #: set by the reader: closes one idle open shard (see ``ObjectStore.acquire``)
        self.shed: Callable[[], bool] | None = None
        self.fs, self.root = filesystem(self.url)
        self.fs.invalidate_cache()  # every open sees the store as it is now
        base = cache_root()
        self.local_dir = os.path.join(base, "caches", url_digest(self.url))
        self.store = ObjectStore(os.path.join(base, "objects"), cache_size_bytes())
        try:
            data = self.fs.cat_file(f"{self.root}/{MANIFEST}")
        except FileNotFoundError:
            hint = ""
            with contextlib.suppress(Exception):
                if self.fs.exists(f"{self.root}/{PARTS_DIR}/build.json"):
                    hint = " (a build was started there but never committed; rerun it)"
            raise CacheNotFoundError(
                f"{self.url!r} holds no shardcache cache: {MANIFEST} is missing{hint}; build "
                "one with `shardcache build --output URL`"
            ) from None
        except Exception as err:
            explained = unreachable(err, self.url)
            if explained is None:
                raise
            raise explained from err
        os.makedirs(self.local_dir, exist_ok=True)
        # several ranks may do this at once: whole files only
        write_bytes_atomic(os.path.join(self.local_dir, MANIFEST), data, private=True)
        self.manifest = read_manifest(self.local_dir)

    @property
    def lengths_path(self) -> str:
        """The local copy of the length index (content-addressed, downloaded once)."""
        return self.index_path("lengths")

    def index_path(self, key: str) -> str:
        """The local copy of the manifest's index file ``key`` (content-addressed, downloaded once).

        Args:
            key: an entry of the manifest's ``index`` (``"lengths"``, ``"content_keys"``).

        Returns:
            Its local path.
        """
        entry = self.manifest["index"][key]
        sha = check_digest(entry["sha256"], f"index.{key}.sha256")
        path = os.path.join(cache_root(), "index", f"{sha}.npy")
        if not os.path.isfile(path) or os.path.getsize(path) != int(entry["bytes"]):
            # the name was checked against the layout's when the manifest was read
            download(self.fs, f"{self.root}/{entry['name']}", path, entry["sha256"], entry["bytes"])
        return path

    def fetch_shard(
        self, info: dict[str, Any], *, background: bool = False
    ) -> tuple[str, Callable[[], None]]:
        """Download a shard if needed and hold it; return its local path and the release to call.

        ``background``: called off the reader's thread, so the reader's open shards are never closed
        for room.
        """
        name = check_shard_name(info["name"], "shard name")
        shed = None if background else self.shed
        return self.store.acquire(self.fs, f"{self.root}/{SHARD_DIR}/{name}", info, shed=shed)

    def has_shard(self, info: dict[str, Any]) -> bool:
        """Whether the local shard cache holds a complete copy of a shard (no download)."""
        return _complete(self.store.path(info["sha256"]), int(info["bytes"]))

    def shard_url(self, info: dict[str, Any]) -> str:
        """The URL, with the scheme, of a shard's object in the store."""
        return str(self.fs.unstrip_protocol(f"{self.root}/{SHARD_DIR}/{info['name']}"))
