"""Local files: the one streaming sha256, atomic writes (tmp + fsync + rename), JSON reads.

Every file of a cache is written as a temporary file, fsynced, then renamed over its final
name, so a name always holds a whole file. Writers that may race with another
process on one name (job-array shares, ranks sharing a download folder) use ``private_tmp``,
so neither deletes nor overwrites the other's half-written file.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import io
import json
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, BinaryIO

import numpy as np

from shardcache.errors import CacheError, CorruptShardError

READ_CHUNK = 1 << 20
CACHE_DIR_ENV = "SHARDCACHE_CACHE_DIR"
#: Set to 1 to neither read nor write memos (``read_memo``): everything is computed again.
NO_MEMO_ENV = "SHARDCACHE_NO_MEMO"


def cache_root() -> str:
    """The local folder (``$SHARDCACHE_CACHE_DIR``) for downloads, plans and integrity records."""
    root = os.environ.get(CACHE_DIR_ENV) or os.path.join(
        os.path.expanduser("~"), ".cache", "shardcache"
    )
    if root not in _ROOTS or not os.path.isdir(root):
        os.makedirs(root, exist_ok=True)
        _ROOTS.add(root)
    return root


_ROOTS: set[str] = set()  # roots made (a stat then, not a mkdir: readers ask once a shard)


def sha256_text(text: str) -> str:
    """The sha256 hex digest of a string's UTF-8 bytes."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def sha256_bytes(data: Any) -> str:
    """The sha256 hex digest of a bytes-like object (large ones hashed without holding the GIL)."""
    return hashlib.sha256(data).hexdigest()


class HashingReader(io.RawIOBase):
    """A raw reader that hashes (sha256) and counts the bytes read; ``on_bytes`` sees each chunk."""

    def __init__(self, raw: BinaryIO, on_bytes: Callable[[int], None] | None = None):
        self._raw = raw
        self._on_bytes = on_bytes
        self.sha256 = hashlib.sha256()
        self.bytes_read = 0

    def readable(self) -> bool:
        """True (``io.RawIOBase``)."""
        return True

    def readinto(self, buffer: Any) -> int:
        """Read into ``buffer``, hashing and counting what was read; 0 at the end."""
        n = self._raw.readinto(buffer)
        if n:
            view = memoryview(buffer)[:n]
            self.sha256.update(view)
            self.bytes_read += n
            if self._on_bytes is not None:
                self._on_bytes(n)
        return n or 0

    def drain(self) -> None:
        """Read (and hash) whatever is left, so the digest covers the whole file."""
        # often nothing is left (a parser read to the end): a small buffer first, since a
        # fresh READ_CHUNK one costs more than reading a tiny file
        buf = bytearray(4096)
        while n := self.readinto(buf):
            if n == len(buf) and len(buf) < READ_CHUNK:
                buf = bytearray(READ_CHUNK)

    def close(self) -> None:
        """Close the reader and the file under it."""
        self._raw.close()
        super().close()


class HashingWriter(io.RawIOBase):
    """A new file at ``path`` that hashes (sha256) and counts every byte written through it.

    The digest needs no second read: every ``write`` writes all its bytes, and ``close`` flushes
    and fsyncs first, so the digest is of the bytes on disk. An ``OSError`` names ``path``.
    """

    def __init__(self, path: str):
        self.path = path
        self._file = open(path, "wb")  # noqa: SIM115 (closed by close())
        self.sha256 = hashlib.sha256()
        self.bytes_written = 0

    def writable(self) -> bool:
        """True (``io.RawIOBase``)."""
        return True

    def write(self, data: Any) -> int:
        """Hash a contiguous bytes-like object and write all of it; return its size."""
        view = memoryview(data)
        # hashed as passed and written whole (BufferedWriter): the digest is of what the file holds
        self.sha256.update(view)
        with self._named_errors():
            self._file.write(view)
        self.bytes_written += view.nbytes
        return view.nbytes

    def close(self) -> None:
        """Flush, fsync and close (idempotent)."""
        if self.closed:
            return
        try:
            with self._named_errors():
                self._file.flush()
                os.fsync(self._file.fileno())
        finally:
            self._file.close()
            super().close()

    @contextlib.contextmanager
    def _named_errors(self) -> Iterator[None]:
        """Put ``path`` into an ``OSError`` that lacks a file name: the OS leaves it out."""
        try:
            yield
        except OSError as err:  # the OS leaves the name out: a person needs it
            if err.filename is None:
                err.filename = self.path
            raise


def sha256_file(path: str, on_bytes: Callable[[int], None] | None = None) -> str:
    """The sha256 hex digest of a file; ``on_bytes`` is told the size of every chunk read."""
    with open(path, "rb") as f:
        reader = HashingReader(f, on_bytes)  # type: ignore[arg-type]
        reader.drain()
        return reader.sha256.hexdigest()


def copy_hashing(src: BinaryIO, dst: BinaryIO, digest: Any) -> tuple[int, int]:
    """Copy ``src`` into ``dst``, feeding ``digest``; return the bytes and newlines copied."""
    size = lines = 0
    while chunk := src.read(READ_CHUNK):
        dst.write(chunk)
        digest.update(chunk)
        size += len(chunk)
        lines += chunk.count(b"\n")
    return size, lines


def private_tmp(path: str) -> str:
    """A temporary name next to ``path`` that no other process uses (pid and a random suffix)."""
    return f"{path}.{os.getpid()}.{os.urandom(4).hex()}.tmp"


@contextlib.contextmanager
def exclusive_lock(path: str) -> Iterator[bool]:
    """Hold an exclusive ``flock`` on the lock file ``path`` for the block.

    One process computes, the others wait, then find the result. Yields True while holding it;
    False, holding nothing, when the lock file cannot be opened (a read-only folder).
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield False
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield True
    finally:
        os.close(fd)  # closing releases the lock


def fsync_dir(path: str) -> None:
    """Fsync a folder, so a rename in it survives a power cut."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: str, *, private: bool = False) -> Iterator[BinaryIO]:
    """A temporary file to write ``path`` into, fsynced and renamed over it when the block succeeds.

    On an error the temporary file is removed and nothing is left under ``path``'s name.
    ``private`` uses a temporary name of this process's own (files several processes may write).
    """
    tmp = private_tmp(path) if private else path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(os.path.abspath(path)))
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def write_bytes_atomic(path: str, data: bytes, *, private: bool = False) -> None:
    """Write a file whole or not at all."""
    with atomic_file(path, private=private) as f:
        f.write(data)


def write_json_atomic(path: str, obj: Any, *, private: bool = False) -> None:
    """Write a JSON file (indented, keys sorted, final newline) whole or not at all."""
    data = (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()
    write_bytes_atomic(path, data, private=private)


def read_json_or_none(path: str) -> dict[str, Any] | None:
    """Read a JSON object; None when the file is missing, unreadable or not an object."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def memo_disabled() -> bool:
    """Whether ``$SHARDCACHE_NO_MEMO`` turns memos off (set, and not empty or 0)."""
    return os.environ.get(NO_MEMO_ENV, "") not in ("", "0")


def read_memo(kind: str, digest: str) -> Any | None:
    """A value ``write_memo`` remembered under ``kind``/``digest``; None when off or missing.

    A memo only saves work: the caller validates it. ``digest`` covers everything the value
    depends on, and a memo of another digest is ignored.
    """
    if memo_disabled():
        return None
    try:
        saved = read_json_or_none(os.path.join(cache_root(), kind, digest + ".json"))
    except OSError:  # the cache folder cannot be created
        return None
    if saved is None or saved.get("input") != digest or "value" not in saved:
        return None
    return saved["value"]


def write_memo(kind: str, digest: str, value: Any) -> None:
    """Remember a JSON value as ``<cache_root>/<kind>/<digest>.json``, atomically.

    An ``OSError`` (read-only or full disk) is ignored: a missing memo only costs time.
    """
    if memo_disabled():
        return
    # UTF-8, not \u escapes: a byte-level vocabulary's memo is half the size
    data = json.dumps({"input": digest, "value": value}, ensure_ascii=False).encode()
    with contextlib.suppress(OSError):
        folder = os.path.join(cache_root(), kind)
        os.makedirs(folder, exist_ok=True)
        write_bytes_atomic(os.path.join(folder, digest + ".json"), data, private=True)


def write_npy_atomic(path: str, array: np.ndarray) -> None:
    """Write an array as ``.npy`` (no pickles) whole or not at all."""
    with atomic_file(path) as f:
        np.save(f, array, allow_pickle=False)


def write_npy_concat_atomic(path: str, sources: Sequence[str | tuple[str, int, int]]) -> None:
    """Write 1-d ``.npy`` files, or ``(file, start, stop)`` slices of them, as one ``.npy``.

    The files must share a dtype. One slice is in memory at a time and each header is parsed
    once. Raises ``CorruptShardError`` when the dtypes differ or a file is shorter than a slice.
    """
    layouts: dict[str, tuple[np.dtype, int, int]] = {}  # file: dtype, elements, data offset
    pieces = []
    for source in sources:
        name, start, stop = (source, 0, None) if isinstance(source, str) else source
        if name not in layouts:
            arr = np.load(name, mmap_mode="r", allow_pickle=False)
            layouts[name] = (arr.dtype, arr.shape[0], arr.offset)
            del arr  # its mapping holds a descriptor: never one per file at once
        dtype, count, _ = layouts[name]
        pieces.append((name, start, count if stop is None else stop))
    dtype = layouts[pieces[0][0]][0] if pieces else np.dtype(np.uint32)
    if any(d != dtype for d, _, _ in layouts.values()):
        raise CorruptShardError(f"{path}: the partition length files disagree on the dtype")
    total = sum(stop - start for _, start, stop in pieces)
    with atomic_file(path) as f:
        header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                  "fortran_order": False, "shape": (total,)}  # fmt: skip
        np.lib.format.write_array_header_1_0(f, header)
        for name, start, stop in pieces:
            if stop <= start:
                continue
            _, count, offset = layouts[name]
            want = (stop - start) * dtype.itemsize
            with open(name, "rb", buffering=0) as src:
                src.seek(offset + start * dtype.itemsize)
                data = src.read(want) if stop <= count else b""
            if len(data) != want:
                raise CorruptShardError(
                    f"{name}: holds {count} lengths, fewer than the {stop} its record lists; "
                    "delete that partition's files under parts/ and rerun the build"
                )
            f.write(data)


def concat_files_atomic(path: str, sources: list[str]) -> tuple[int, str, int]:
    """Concatenate files into ``path`` atomically; return the bytes, sha256 and lines written."""
    digest = hashlib.sha256()
    size = lines = 0
    with atomic_file(path) as out:
        for source in sources:
            with open(source, "rb") as f:
                n, k = copy_hashing(f, out, digest)  # type: ignore[arg-type]
            size += n
            lines += k
    return size, digest.hexdigest(), lines


#: Write errors of the disk or its limits, with what a person does about them.
_DISK_ERRORS = {
    errno.ENOSPC: ("no space left on the device", "free space"),
    errno.EDQUOT: ("the disk quota is exceeded", "free space or raise the quota"),
    errno.EFBIG: ("a file reached the file-size limit (ulimit -f)", "raise the limit"),
    errno.EROFS: ("the file system is read-only", "choose a writable --output"),
    errno.EACCES: ("permission denied", "choose a writable --output or fix its permissions"),
    errno.EPERM: ("operation not permitted", "choose a writable --output or fix its permissions"),
}


def disk_error(err: OSError, output: str) -> CacheError | None:
    """A ``CacheError`` with the fix for a disk-full/quota/read-only/permission error, else None."""
    known = _DISK_ERRORS.get(err.errno or 0)
    if known is None:
        return None
    why, fix = known
    path = err.filename or output
    return CacheError(
        f"cannot write {path!r} ({why}: {err.strerror}); {fix}, then rerun the same command: "
        f"completed partitions in {output!r} are kept and the result is byte-identical"
    )


def resource_limit_error(err: OSError, path: str) -> CacheError | None:
    """A ``CacheError`` naming the limit and the fix when an open or map hit one; else None."""
    import resource

    if err.errno == errno.EMFILE:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        return CacheError(
            f"cannot open {path!r}: this process reached its open-file limit (RLIMIT_NOFILE "
            f"soft {soft}, hard {hard}); the file is not damaged. Raise the soft limit "
            "(`ulimit -n` before starting, or resource.setrlimit; above the hard limit only "
            "an administrator can), or open fewer files at once (fewer caches, DataLoader "
            "workers or open_shards)"
        )
    if err.errno == errno.ENFILE:
        return CacheError(
            f"cannot open {path!r}: the system-wide open-file table is full (ENFILE; Linux: "
            "/proc/sys/fs/file-max); the file is not damaged: close other programs' files or "
            "raise fs.file-max, then retry"
        )
    if err.errno == errno.ENOMEM:
        return CacheError(
            f"cannot map {path!r}: out of memory or of memory mappings (ENOMEM; Linux: "
            "vm.max_map_count, or the address-space limit RLIMIT_AS); the file is not "
            "damaged: raise the limit, or read with fewer open shards or processes, then retry"
        )
    return None
