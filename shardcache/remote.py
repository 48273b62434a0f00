"""Caches and inputs in object storage (``s3://``, ``gs://``, ``file://`` ...) through fsspec.

shardcache never speaks an object store's protocol itself: every URL goes through
``fsspec.core.url_to_fs``, so credentials and endpoints are the filesystem layer's usual
settings (for S3: ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_PROFILE``,
``AWS_ENDPOINT_URL`` for an S3-compatible store, or any ``FSSPEC_S3_<KWARG>`` variable).
``s3fs`` is the optional extra ``shardcache[s3]``.

Write side: **stage, then upload, manifest last.** A build whose ``--output`` is a URL builds
into a local staging folder (``$SHARDCACHE_CACHE_DIR/staging/<hash of the URL>``), exactly as
a local build would (same bytes), then uploads ``shards/``, ``parts/``, ``index/`` and the
quarantine file, and ``manifest.json`` last: the manifest's presence is the commit on an
object store too, where there is no rename. A killed build resumes from its staging folder
(same machine); an upload that failed after the staged commit is redone by rerunning. The
staging folder is deleted after a successful upload. A job-array share (``--partition i/N``)
uploads its partitions' files; ``shardcache commit URL`` downloads ``parts/`` (small: records,
length arrays, quarantine lines), checks the shards' sizes with one listing, commits in a
staging folder and uploads the index, the quarantine file and the manifest.

Inputs given as URLs are downloaded into ``$SHARDCACHE_CACHE_DIR/inputs/`` before the plan
(the split into byte ranges needs seeks; a download is sequential, one pass). Each keeps its
path relative to the common prefix of the URLs and its size, and gets the object's
modification time, so the manifest's per-file relpath / size / sha256 and the resume
fingerprint are those of a local build of the same files.

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
import dataclasses
import fcntl
import functools
import hashlib
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

from shardcache.config import BuildOptions, parse_size
from shardcache.errors import (
    CacheError,
    CacheNotFoundError,
    ConfigError,
    CorruptShardError,
    MissingDependencyError,
    SourceError,
)
from shardcache.format import (
    LENGTHS_FILE,
    MANIFEST,
    PARTS_DIR,
    SHARD_DIR,
    ShardCache,
    ShardReader,
    read_manifest,
)
from shardcache.sources import InputFile, detect_format

CACHE_DIR_ENV = "SHARDCACHE_CACHE_DIR"
CACHE_SIZE_ENV = "SHARDCACHE_CACHE_SIZE"
DEFAULT_CACHE_SIZE_BYTES = 64 << 30
QUARANTINE = "quarantine.jsonl"
SHARES_DIR = ".shares"  # job-array share markers and locks (see engines.py)
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


def cache_root() -> str:
    """The local folder for downloads and staging (``SHARDCACHE_CACHE_DIR``)."""
    root = os.environ.get(CACHE_DIR_ENV) or os.path.join(
        os.path.expanduser("~"), ".cache", "shardcache"
    )
    os.makedirs(root, exist_ok=True)
    return root


def cache_size_bytes() -> int:
    """The bound of the local shard cache (``SHARDCACHE_CACHE_SIZE``, e.g. ``200GiB``)."""
    value = os.environ.get(CACHE_SIZE_ENV)
    return parse_size(value, CACHE_SIZE_ENV) if value else DEFAULT_CACHE_SIZE_BYTES


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _tmp_name(path: str) -> str:
    return f"{path}.{os.getpid()}.{os.urandom(4).hex()}.tmp"


def download(fs: Any, rpath: str, local: str, sha256: str | None, size: int | None) -> None:
    """Stream ``rpath`` into ``local`` (private tmp, checked, renamed); raise if it differs."""
    os.makedirs(os.path.dirname(local) or ".", exist_ok=True)
    tmp = _tmp_name(local)
    digest = hashlib.sha256()
    got = 0
    with contextlib.suppress(Exception):
        fs.invalidate_cache(rpath)  # a listing cached before the object was replaced
    try:
        with fs.open(rpath, "rb", block_size=_CHUNK) as src, open(tmp, "wb") as dst:
            while chunk := src.read(_CHUNK):
                dst.write(chunk)
                digest.update(chunk)
                got += len(chunk)
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
        return os.path.join(self.folder, f"{sha256}.arrow")

    def acquire(self, fs: Any, rpath: str, info: dict[str, Any]) -> tuple[str, Callable[[], None]]:
        """Download (if needed) the shard ``info``; returns its path and a release function
        to call when done with it (until then a shared lock keeps it from eviction).

        ``flock`` locks of two descriptors conflict even inside one process, so a process
        takes each object's lock once and counts its users (``_HELD``).
        """
        sha = str(info["sha256"])
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


class RemoteShardCache(ShardCache):
    """:class:`~shardcache.format.ShardCache` whose shards come through an
    :class:`ObjectStore`; the store's lock on a shard is held while it is in this LRU."""

    def __init__(self, remote: RemoteCache, shards: list[dict[str, Any]], dtype: Any, size: int):
        super().__init__(remote.url, shards, dtype, size)
        self.remote = remote
        self._release: dict[int, Callable[[], None]] = {}

    def get(self, index: int) -> ShardReader:
        reader = self._open.get(index)
        if reader is not None:
            self._open.move_to_end(index)
            return reader
        info = self.shards[index]
        path, release = self.remote.fetch_shard(info)
        try:
            reader = ShardReader(path, info, self.dtype)
        except BaseException:
            release()
            raise
        self._open[index] = reader
        self._release[index] = release
        if len(self._open) > self.size:
            old, _ = self._open.popitem(last=False)
            self._release.pop(old)()
        return reader

    def __del__(self) -> None:
        for release in getattr(self, "_release", {}).values():
            with contextlib.suppress(Exception):
                release()


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
        self.local_dir = os.path.join(base, "caches", _digest(self.url))
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
        os.makedirs(self.local_dir, exist_ok=True)
        target = os.path.join(self.local_dir, MANIFEST)
        tmp = _tmp_name(target)
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, target)  # several ranks may do this at once: whole files only
        self.manifest = read_manifest(self.local_dir)

    @property
    def lengths_path(self) -> str:
        entry = self.manifest["index"]["lengths"]
        path = os.path.join(cache_root(), "index", f"{entry['sha256']}.npy")
        if not os.path.isfile(path) or os.path.getsize(path) != int(entry["bytes"]):
            download(self.fs, f"{self.root}/{LENGTHS_FILE}", path, entry["sha256"], entry["bytes"])
        return path

    def fetch_shard(self, info: dict[str, Any]) -> tuple[str, Callable[[], None]]:
        return self.store.acquire(self.fs, f"{self.root}/{SHARD_DIR}/{info['name']}", info)

    def shard_cache(self, dtype: Any, size: int) -> RemoteShardCache:
        return RemoteShardCache(self, self.manifest["shards"], dtype, size)


def read_any_manifest(path: str) -> dict[str, Any]:
    """The manifest of a cache folder or URL (reads only the manifest)."""
    return RemoteCache(path).manifest if is_url(path) else read_manifest(path)


def verify_remote(url: str) -> Any:
    """``verify_cache`` for a URL: download every listed file into a temporary folder."""
    from shardcache.verify import VerifyReport, verify_cache

    url = url.rstrip("/")
    try:
        remote = RemoteCache(url)
    except CacheError as err:
        report = VerifyReport(cache=url)
        report.add(MANIFEST, "manifest", str(err))
        return report
    fs, root, manifest = remote.fs, remote.root, remote.manifest
    folder = tempfile.mkdtemp(prefix="verify-", dir=cache_root())
    try:
        names = [MANIFEST]
        index = manifest.get("index", {}).get("lengths", {}).get("name")
        if index:
            names.append(index)
        if manifest.get("quarantine"):
            names.append(manifest["quarantine"]["name"])
        names += [f"{SHARD_DIR}/{s['name']}" for s in manifest.get("shards", [])]
        for rel in names:
            local = os.path.join(folder, rel)
            os.makedirs(os.path.dirname(local), exist_ok=True)
            with contextlib.suppress(FileNotFoundError):  # missing: reported by the verifier
                fs.get_file(f"{root}/{rel}", local)
        report = verify_cache(folder)
        with contextlib.suppress(FileNotFoundError):
            listed = {s["name"] for s in manifest.get("shards", [])}
            found = [p.rsplit("/", 1)[-1] for p in fs.find(f"{root}/{SHARD_DIR}")]
            report.extra_files = sorted(f"{SHARD_DIR}/{n}" for n in found if n not in listed)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    report.cache = url
    return report


# ------------------------------------------------------------------------ write side


def _mtime_ns(fs: Any, path: str, info: dict[str, Any]) -> int:
    with contextlib.suppress(Exception):
        return int(fs.modified(path).timestamp() * 1e9)
    for key in ("mtime", "LastModified", "last_modified"):
        if key in info:
            value = info[key]
            return int((value.timestamp() if hasattr(value, "timestamp") else float(value)) * 1e9)
    return 0


def stage_inputs(specs: tuple[str, ...]) -> list[InputFile]:
    """Download URL inputs (files, folders/prefixes or globs) into the local cache folder.

    Returns input files whose ``relpath`` is relative to the URLs' common prefix (as a local
    listing would make it), ``size`` the object's, and whose local copy carries the object's
    modification time (so a resumed build's fingerprint matches).
    """
    found: dict[str, tuple[Any, str, dict[str, Any]]] = {}
    for spec in specs:
        if not is_url(spec):
            raise ConfigError(
                f"inputs: {spec!r} is a local path among URL inputs; give all inputs as URLs "
                "or all as local paths"
            )
        fs, path = filesystem(spec)
        try:
            if any(ch in path for ch in "*?["):
                listed = fs.glob(path, detail=True)
                if not listed:
                    raise SourceError(f"input {spec!r}: the pattern matches no object")
            elif fs.isdir(path):
                listed = {p: i for p, i in fs.find(path, detail=True).items()
                          if detect_format(p)}  # fmt: skip
                if not listed:
                    raise SourceError(f"input {spec!r}: the prefix holds no input file")
            else:
                listed = {path: fs.info(path)}
        except FileNotFoundError as err:
            raise SourceError(f"input {spec!r}: no such object or prefix ({err})") from err
        for p, info in listed.items():
            if info.get("type") == "directory":
                continue
            if detect_format(p) is None:
                raise SourceError(f"input {fs.unstrip_protocol(p)!r}: unknown format")
            found[fs.unstrip_protocol(p)] = (fs, p, info)
    if not found:
        raise SourceError(f"inputs {list(specs)}: no input file found")
    root = os.path.commonpath([u.split("://", 1)[1].rsplit("/", 1)[0] for u in found])
    folder = os.path.join(cache_root(), "inputs")
    files = []
    for url, (fs, p, info) in sorted(found.items()):
        relpath = os.path.relpath(url.split("://", 1)[1], root).replace(os.sep, "/")
        size = int(info.get("size") or 0)
        mtime = _mtime_ns(fs, p, info)
        local = os.path.join(folder, _digest(f"{url}|{size}|{mtime}"), os.path.basename(p))
        if not os.path.isfile(local) or os.path.getsize(local) != size:
            download(fs, p, local, None, size)
            os.utime(local, ns=(mtime, mtime))
        fmt = detect_format(p) or ""
        files.append(InputFile(path=local, relpath=relpath, size=size, format=fmt))
    files.sort(key=lambda f: f.relpath)
    return files


def staging_dir(url: str, tag: str = "") -> str:
    """The local folder a build for ``url`` runs in (kept until the upload succeeded)."""
    return os.path.join(cache_root(), "staging", _digest(f"{url.rstrip('/')}|{tag}"))


def upload_tree(folder: str, url: str, with_manifest: bool) -> int:
    """Upload every file of a staged build (not locks or tmp files); the manifest last."""
    fs, root = filesystem(url)
    local, remote = [], []
    for dirpath, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            rel = os.path.relpath(os.path.join(dirpath, name), folder).replace(os.sep, "/")
            if name == ".lock" or name.endswith(".tmp") or rel == MANIFEST:
                continue
            local.append(os.path.join(dirpath, name))
            remote.append(f"{root}/{rel}")
    if local:
        fs.put(local, remote)
    if with_manifest:
        fs.put_file(os.path.join(folder, MANIFEST), f"{root}/{MANIFEST}")
    fs.invalidate_cache()
    return len(local) + int(with_manifest)


def build_remote(
    options: BuildOptions,
    build_local: Callable[[BuildOptions, list[InputFile] | None], Any],
    share_tag: str = "",
) -> Any:
    """Build with URL inputs and/or a URL output: stage, build locally, upload, manifest last.

    ``build_local(options, inputs)`` runs the ordinary build (or a share) on local paths and
    returns its report.
    """
    remote_inputs = any(map(is_url, options.source.inputs))
    inputs = stage_inputs(options.source.inputs) if remote_inputs else None
    if not is_url(options.output):
        return build_local(options, inputs)
    url = options.output.rstrip("/")
    fs, root = filesystem(url)
    stage = staging_dir(url, share_tag)
    if fs.exists(f"{root}/{MANIFEST}"):
        if not options.force or share_tag:
            raise CacheError(
                f"{url!r} already holds a committed cache; pass --force to rebuild it (not "
                "with --partition: delete the prefix first), or choose another --output"
            )
        fs.rm_file(f"{root}/{MANIFEST}")  # first: readers stop seeing the old cache
        fs.invalidate_cache()
    if os.path.isfile(os.path.join(stage, MANIFEST)) and not options.force:
        report = _staged_report(stage)  # committed here, upload interrupted: redo the upload
    else:
        report = build_local(dataclasses.replace(options, output=stage), inputs)
    upload_tree(stage, url, with_manifest=os.path.isfile(os.path.join(stage, MANIFEST)))
    shutil.rmtree(stage, ignore_errors=True)
    if inputs:
        for f in inputs:
            shutil.rmtree(os.path.dirname(f.path), ignore_errors=True)
    if hasattr(report, "output"):
        report.output = url
    return report


def _staged_report(stage: str) -> Any:
    from shardcache.engines import report_from_manifest

    return report_from_manifest(stage, read_manifest(stage), 0.0)


def commit_remote(url: str, commit_local: Callable[[str, dict[str, int]], Any]) -> Any:
    """``shardcache commit URL``: fetch ``parts/``, commit in a staging folder, upload."""
    url = url.rstrip("/")
    fs, root = filesystem(url)
    stage = staging_dir(url, "commit")
    shutil.rmtree(stage, ignore_errors=True)
    os.makedirs(os.path.join(stage, PARTS_DIR))
    fs.invalidate_cache()
    if fs.exists(f"{root}/{MANIFEST}"):
        fs.get_file(f"{root}/{MANIFEST}", os.path.join(stage, MANIFEST))
    for sub in (PARTS_DIR, SHARES_DIR):
        with contextlib.suppress(FileNotFoundError):
            for rpath in fs.find(f"{root}/{sub}"):
                rel = rpath[len(root) + 1 :]
                if rel.endswith((".lock", ".tmp")):
                    continue
                local = os.path.join(stage, rel)
                os.makedirs(os.path.dirname(local), exist_ok=True)
                fs.get_file(rpath, local)
    sizes: dict[str, int] = {}
    with contextlib.suppress(FileNotFoundError):
        for rpath, info in fs.find(f"{root}/{SHARD_DIR}", detail=True).items():
            sizes[rpath.rsplit("/", 1)[-1]] = int(info["size"])
    already = os.path.isfile(os.path.join(stage, MANIFEST))
    result = commit_local(stage, sizes)
    if not already:
        names = [LENGTHS_FILE, QUARANTINE]
        fs.put([os.path.join(stage, n) for n in names], [f"{root}/{n}" for n in names])
        fs.put_file(os.path.join(stage, MANIFEST), f"{root}/{MANIFEST}")
        fs.invalidate_cache()
    shutil.rmtree(stage, ignore_errors=True)
    return result
