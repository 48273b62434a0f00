"""Caches and inputs in object storage (``s3://``, ``gs://``, ``file://`` ...) through fsspec.

shardcache never speaks an object store's protocol itself: every URL goes through
``fsspec.core.url_to_fs``, so credentials and endpoints are the filesystem layer's usual
settings (for S3: ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_PROFILE``,
``AWS_ENDPOINT_URL`` for an S3-compatible store, or any ``FSSPEC_S3_<KWARG>`` variable).
``s3fs`` is the optional extra ``shardcache[s3]``.

The write side (staging a build, uploading it, committing shares) is
:mod:`shardcache.build.remote`; this module gives it :func:`staging_dir` and
:func:`upload_tree`.

Read side: **a content-addressed local shard cache.** ``open_cache(URL)`` (and so
``ShardDataset``, ``info``, ``check``) downloads the manifest (each open) and the length index
(once per content), then shards on demand into ``$SHARDCACHE_CACHE_DIR/objects/<sha256>``.
Every download streams into a private ``*.tmp``, is checked against the manifest's sha256 and
size, then renamed: a file under its final name is always complete and correct, and a shard
rebuilt under the same name gets a new sha256, so a stale copy is never read. Several ranks
on one machine share the folder: a per-object ``flock`` (``<sha256>.lock``) serializes the
download (one rank downloads, the others wait and then find it), and a reader holds a shared
lock on it while the shard is open. The folder is bounded (``SHARDCACHE_CACHE_SIZE``, default
64 GiB): after a download, least-recently-opened objects are deleted until the total fits,
skipping any object some process holds open (a non-blocking exclusive lock fails). The bound
is soft when the shards open at once exceed it. ``verify URL`` downloads every listed file
into a temporary folder and runs the local verifier on it, so damage is reported, not raised.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import re
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
from shardcache.store.files import cache_root, copy_hashing, private_tmp, sha256_text
from shardcache.store.integrity import record_verified
from shardcache.store.layout import (
    LENGTHS_FILE,
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
    """True for ``scheme://...`` (object stores, ``file://``); plain paths are local."""
    return bool(_URL.match(os.fspath(path)))


def filesystem(url: str) -> tuple[Any, str]:
    """``(fsspec filesystem, path inside it)`` for a URL; names the pip command if missing."""
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
    """A :class:`CacheError` naming the URL and what to check when ``err`` means the object
    store could not be reached (connection refused, DNS, timeout: builtin, botocore or aiohttp
    errors); None for other errors."""
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
    """The bound of the local shard cache (``SHARDCACHE_CACHE_SIZE``, e.g. ``200GiB``)."""
    value = os.environ.get(CACHE_SIZE_ENV)
    return parse_size(value, CACHE_SIZE_ENV) if value else DEFAULT_CACHE_SIZE_BYTES


def url_digest(text: str) -> str:
    """A short stable folder name for a URL (or any text)."""
    return sha256_text(text)[:20]


def download(fs: Any, rpath: str, local: str, sha256: str | None, size: int | None) -> None:
    """Stream ``rpath`` into ``local`` (private tmp, checked, renamed); raise if it differs."""
    os.makedirs(os.path.dirname(local) or ".", exist_ok=True)
    tmp = private_tmp(local)
    digest = hashlib.sha256()
    with contextlib.suppress(Exception):
        fs.invalidate_cache(rpath)  # a listing cached before the object was replaced
    try:
        with fs.open(rpath, "rb", block_size=_CHUNK) as src, open(tmp, "wb") as dst:
            got, _ = copy_hashing(src, dst, digest)
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


class ObjectStore:
    """The bounded, content-addressed folder of downloaded shards shared by local processes."""

    def __init__(self, folder: str, size_bytes: int):
        self.folder = folder
        self.size_bytes = size_bytes
        os.makedirs(folder, exist_ok=True)

    def path(self, sha256: str) -> str:
        return os.path.join(self.folder, f"{check_digest(sha256, 'shard sha256')}.arrow")

    def acquire(self, fs: Any, rpath: str, info: dict[str, Any]) -> tuple[str, Callable[[], None]]:
        """Download (if needed) the shard ``info``; returns its path and a release function
        to call when done with it (until then a shared lock keeps it from eviction).

        ``flock`` locks of two descriptors conflict even inside one process, so a process
        takes each object's lock once and counts its users (``_HELD``).
        """
        sha = check_digest(info["sha256"], "shard sha256")  # it names files here
        path = self.path(sha)
        held = _HELD.get(sha)
        if held is not None and os.path.isfile(path):
            held[1] += 1
            return path, functools.partial(_release, sha)
        fd = os.open(os.path.join(self.folder, f"{sha}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            while True:
                fcntl.flock(fd, fcntl.LOCK_EX)  # one process downloads, the others wait
                fresh = False
                if not os.path.isfile(path) or os.path.getsize(path) != int(info["bytes"]):
                    download(fs, rpath, path, sha, int(info["bytes"]))
                    fresh = True
                fcntl.flock(fd, fcntl.LOCK_SH)  # in use: not evictable
                if os.path.isfile(path):  # an evictor may have won the gap between the locks
                    break
            st = os.stat(path)
            os.utime(path, ns=(time.time_ns(), st.st_mtime_ns))  # atime = LRU order
        except BaseException:
            os.close(fd)
            raise
        _HELD[sha] = [fd, 1]
        if fresh:
            self.evict(keep=path)
        return path, functools.partial(_release, sha)

    def evict(self, keep: str) -> None:
        """Delete least-recently-opened objects not in use until the folder fits the bound."""
        entries = []
        with os.scandir(self.folder) as it:
            for entry in it:
                if entry.name.endswith(".arrow"):
                    with contextlib.suppress(FileNotFoundError):
                        st = entry.stat()
                        entries.append((st.st_atime_ns, st.st_size, entry.path))
        total = sum(e[1] for e in entries)
        for _, size, path in sorted(entries):
            if total <= self.size_bytes:
                return
            if path == keep:
                continue
            if os.path.basename(path)[: -len(".arrow")] in _HELD:
                continue  # open in this process
            lock = path[: -len(".arrow")] + ".lock"
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue  # open in some process
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
                    total -= size
            finally:
                os.close(fd)


#: sha256 -> [lock fd, users] for the objects this process holds open
_HELD: dict[str, list[int]] = {}


def _release(sha: str) -> None:
    held = _HELD.get(sha)
    if held is None:
        return
    held[1] -= 1
    if held[1] <= 0:
        del _HELD[sha]
        with contextlib.suppress(OSError):
            os.close(held[0])


class RemoteCache:
    """A committed cache at a URL, seen through a local folder holding its manifest.

    ``local_dir`` holds ``manifest.json`` (refreshed on every open); :attr:`lengths_path` the
    length index (content-addressed, downloaded once); shards come from :meth:`fetch_shard`.
    """

    def __init__(self, url: str):
        self.url = url.rstrip("/")
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
        target = os.path.join(self.local_dir, MANIFEST)
        tmp = private_tmp(target)
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, target)  # several ranks may do this at once: whole files only
        self.manifest = read_manifest(self.local_dir)

    @property
    def lengths_path(self) -> str:
        entry = self.manifest["index"]["lengths"]
        sha = check_digest(entry["sha256"], "index.lengths.sha256")
        path = os.path.join(cache_root(), "index", f"{sha}.npy")
        if not os.path.isfile(path) or os.path.getsize(path) != int(entry["bytes"]):
            download(self.fs, f"{self.root}/{LENGTHS_FILE}", path, entry["sha256"], entry["bytes"])
        return path

    def fetch_shard(self, info: dict[str, Any]) -> tuple[str, Callable[[], None]]:
        name = check_shard_name(info["name"], "shard name")
        return self.store.acquire(self.fs, f"{self.root}/{SHARD_DIR}/{name}", info)


# ------------------------------------------------------------------------ write side


def staging_dir(url: str, tag: str = "") -> str:
    """The local folder a build for ``url`` runs in (kept until the upload succeeded)."""
    return os.path.join(cache_root(), "staging", url_digest(f"{url.rstrip('/')}|{tag}"))


def upload_tree(folder: str, url: str, with_manifest: bool) -> int:
    """Upload every file of a staged build (not locks or tmp files); the manifest last."""
    fs, root = filesystem(url)
    local, remote = [], []
    for dirpath, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            rel = os.path.relpath(os.path.join(dirpath, name), folder).replace(os.sep, "/")
            if name.startswith(".lock") or name.endswith(".tmp") or rel == MANIFEST:
                continue
            local.append(os.path.join(dirpath, name))
            remote.append(f"{root}/{rel}")
    if local:
        fs.put(local, remote)
    if with_manifest:
        fs.put_file(os.path.join(folder, MANIFEST), f"{root}/{MANIFEST}")
    fs.invalidate_cache()
    return len(local) + int(with_manifest)
