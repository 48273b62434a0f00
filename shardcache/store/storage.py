"""Where a build's output lives: one interface over a local folder and an fsspec URL.

Names are relative to the output. A build writes every file into a local staging folder, then
publishes it: a local folder stages in place (each file ``*.tmp`` + fsync + rename; publishing
is a no-op); a URL stages in a temporary folder and publishes by uploading in the given order,
a completion record or the manifest last, so an object appears whole or not at all. Only a local
folder has a build lock; object stores have none (one driver per output).
"""

from __future__ import annotations

import abc
import contextlib
import json
import os
import shutil
import tempfile
import urllib.parse
from collections.abc import Iterator
from typing import Any

from shardcache.errors import CacheError, ConfigError
from shardcache.store.build_lock import BuildLock, refuse_colliding_builds
from shardcache.store.files import read_json_or_none, write_json_atomic
from shardcache.store.layout import INDEX_DIR, PARTS_DIR, SHARD_DIR, check_relative_name
from shardcache.store.remote import filesystem, is_url, unreachable

#: The folders a staging area holds (a partition's files, a commit's).
STAGED_FOLDERS = (SHARD_DIR, PARTS_DIR, INDEX_DIR)


class Storage(abc.ABC):
    """The operations a build needs on its output (``location``: folder or URL, no final ``/``)."""

    location: str

    @abc.abstractmethod
    def exists(self, name: str) -> bool:
        """Whether ``name`` exists, from a fresh listing (another machine may have written it)."""

    @abc.abstractmethod
    def read_json(self, name: str) -> dict[str, Any] | None:
        """Read a JSON object; None when it is missing or not a whole JSON object."""

    @abc.abstractmethod
    def read_many(self, names: list[str]) -> dict[str, bytes | None]:
        """Read several small files at once; None for a missing one."""

    @abc.abstractmethod
    def write_json(self, name: str, obj: Any, *, private: bool = False) -> None:
        """Write a JSON file whole or not at all.

        ``private`` uses a temporary name of this process's own, for a file several processes may
        write at once.
        """

    @abc.abstractmethod
    def sizes(self, folder: str) -> dict[str, int]:
        """Size of each file under ``folder``, by name relative to it; empty when it is missing."""

    @abc.abstractmethod
    def remove(self, names: list[str]) -> None:
        """Delete files; missing ones are fine."""

    @abc.abstractmethod
    def remove_folders(self, folders: list[str]) -> None:
        """Delete folders and everything in them; missing ones are fine."""

    @abc.abstractmethod
    def lock(self, name: str = "") -> contextlib.AbstractContextManager[Any]:
        """A context manager holding the exclusive build lock of ``name`` (``""``: the output).

        A share's lock is ``.shares/share-i-of-N``. Local folders raise ``BuildLockedError`` when a
        live build holds it or runs beside it that it would collide with.
        """

    @abc.abstractmethod
    def staging(self, label: str) -> contextlib.AbstractContextManager[str]:
        """A context manager giving a local folder, with ``STAGED_FOLDERS`` made, to write into."""

    @abc.abstractmethod
    def publish(self, staged: str, names: list[str]) -> None:
        """Make files written under ``staged`` part of the output, in the order of ``names``."""

    @abc.abstractmethod
    def fetch(self, staged: str, names: list[str]) -> None:
        """Copy files of the output into ``staged`` (a no-op in place)."""


class LocalStorage(Storage):
    """A local folder: staged in place, locked with ``<folder>/.lock``."""

    def __init__(self, folder: str):
        if os.path.exists(folder) and not os.path.isdir(folder):
            raise CacheError(f"--output {folder!r} exists and is not a folder; choose another path")
        self.location = folder
        self.root = folder

    def _path(self, name: str) -> str:
        """The path of ``name`` under the folder."""
        return os.path.join(self.root, name)

    def exists(self, name: str) -> bool:
        """Whether the file exists."""
        return os.path.exists(self._path(name))

    def read_json(self, name: str) -> dict[str, Any] | None:
        """Read a JSON object; None when missing or not whole."""
        return read_json_or_none(self._path(name))

    def read_many(self, names: list[str]) -> dict[str, bytes | None]:
        """Read several files; None for a missing or unreadable one."""
        out: dict[str, bytes | None] = {}
        for name in names:
            try:
                with open(self._path(name), "rb") as f:
                    out[name] = f.read()
            except OSError:
                out[name] = None
        return out

    def write_json(self, name: str, obj: Any, *, private: bool = False) -> None:
        """Write a JSON file atomically, making its folder."""
        path = self._path(name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_json_atomic(path, obj, private=private)

    def sizes(self, folder: str) -> dict[str, int]:
        """Sizes of the files under ``folder``; a temporary file renamed meanwhile is skipped."""
        top = self._path(folder)
        out: dict[str, int] = {}
        for root, _, files in os.walk(top):
            for name in files:
                path = os.path.join(root, name)
                with contextlib.suppress(FileNotFoundError):  # a tmp file renamed meanwhile
                    out[os.path.relpath(path, top).replace(os.sep, "/")] = os.path.getsize(path)
        return out

    def remove(self, names: list[str]) -> None:
        """Delete files; missing ones are fine."""
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self._path(name))

    def remove_folders(self, folders: list[str]) -> None:
        """Delete folder trees; missing ones are fine."""
        for folder in folders:
            shutil.rmtree(self._path(folder), ignore_errors=True)

    @contextlib.contextmanager
    def lock(self, name: str = "") -> Iterator[BuildLock]:
        """Hold the build lock of ``name``, then refuse builds this one would collide with."""
        with BuildLock(self._path(name) if name else self.root) as held:
            refuse_colliding_builds(self.root, name)
            yield held

    @contextlib.contextmanager
    def staging(self, label: str) -> Iterator[str]:
        """Stage in the output folder itself."""
        for sub in STAGED_FOLDERS:
            os.makedirs(self._path(sub), exist_ok=True)
        yield self.root

    def publish(self, staged: str, names: list[str]) -> None:
        """Nothing to do: files staged in place were written atomically where they belong."""

    def fetch(self, staged: str, names: list[str]) -> None:
        """Nothing to do: the staging folder is the output."""


class FsspecStorage(Storage):
    """An output at a URL, through fsspec.

    Every listing is fresh (the listing cache is dropped first) and every name is checked to stay
    under the output. Raises ``MissingDependencyError`` when the URL's backend is not installed,
    ``ConfigError`` when fsspec cannot open it.
    """

    def __init__(self, url: str):
        self.location = url.rstrip("/")
        parts = urllib.parse.urlsplit(self.location)
        if parts.query or parts.fragment:
            raise ConfigError(
                f"{url!r}: a cache's URL takes no query or fragment "
                f"({'?' + parts.query if parts.query else ''}"
                f"{'#' + parts.fragment if parts.fragment else ''}); object names cannot hold "
                "them. Give the bucket and folder alone, e.g. "
                f"{parts.scheme}://{parts.netloc}{parts.path}"
            )
        self.fs, self.root = filesystem(self.location)
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        #: a filesystem with real folders (``file://``) needs them made before a write
        self.has_folders = "file" in protocols or "local" in protocols
        if not self.has_folders:
            self._check_bucket()

    def _check_bucket(self) -> None:
        """Refuse an object store's bucket that does not exist (every write would fail)."""
        bucket = self.root.split("/", 1)[0]
        try:
            if self.fs.exists(bucket):
                return
            # exists() also says False for a store it cannot reach: listing tells them apart
            self.fs.ls(bucket, detail=False)
            return
        except FileNotFoundError:
            pass
        except Exception as err:  # (the store's own errors; an unreachable one is named)
            problem = unreachable(err, self.location)
            if problem is not None:
                raise problem from err
            return  # e.g. no right to look: the writes will say what is wrong
        raise CacheError(
            f"{self.location!r}: the bucket {bucket!r} does not exist in the object store "
            f"(endpoint {os.environ.get('AWS_ENDPOINT_URL') or 'the default'}); create it, "
            "or fix the bucket name in the URL"
        )

    def _path(self, name: str) -> str:
        # every name (ours, or listed from the store) is a plain relative name: a listed key
        # such as parts/../../x is refused, never read, deleted or written
        """The object path of ``name``, refused unless it is a plain relative name."""
        return f"{self.root}/{check_relative_name(name, f'object name under {self.location!r}')}"

    def _writing(self, name: str) -> str:
        """The object path of ``name``, its folders made on filesystems that have real ones."""
        path = self._path(name)
        if self.has_folders:
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        return path

    def exists(self, name: str) -> bool:
        """Whether the object exists, after dropping the listing cache."""
        self.fs.invalidate_cache()
        return bool(self.fs.exists(self._path(name)))

    def read_json(self, name: str) -> dict[str, Any] | None:
        """Read a JSON object; None when missing or not whole."""
        try:
            data = json.loads(self.fs.cat_file(self._path(name)))
        except (FileNotFoundError, ValueError, RecursionError):
            return None
        return data if isinstance(data, dict) else None

    def read_many(self, names: list[str]) -> dict[str, bytes | None]:
        """Read several objects in one batched call; None for a missing one."""
        if not names:
            return {}
        got = self.fs.cat([self._path(n) for n in names], on_error="return")
        out: dict[str, bytes | None] = {}
        for n in names:
            value = got.get(self._path(n))
            out[n] = value if isinstance(value, bytes) else None
        return out

    def write_json(self, name: str, obj: Any, *, private: bool = False) -> None:
        """Upload the JSON in one put (atomic on object stores, so ``private`` is not needed)."""
        data = (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()
        self.fs.pipe_file(self._writing(name), data)

    def sizes(self, folder: str) -> dict[str, int]:
        """Sizes of the objects under ``folder``, from a fresh listing."""
        self.fs.invalidate_cache()
        prefix = self._path(folder).rstrip("/") + "/"
        try:
            found = self.fs.find(prefix, detail=True)
        except FileNotFoundError:
            return {}
        return {
            p[len(prefix) :]: int(i.get("size") or 0)
            for p, i in found.items()
            if p.startswith(prefix) and i.get("type") != "directory"
        }

    def remove(self, names: list[str]) -> None:
        """Delete objects; missing ones are fine."""
        if names:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm([self._path(n) for n in names])
            self.fs.invalidate_cache()

    def remove_folders(self, folders: list[str]) -> None:
        """Delete every object under each folder."""
        for folder in folders:
            self.remove([f"{folder}/{n}" for n in self.sizes(folder)])

    def lock(self, name: str = "") -> contextlib.AbstractContextManager[Any]:
        """No lock: object stores have none."""
        return contextlib.nullcontext()  # object stores have no lock: one driver per output

    @contextlib.contextmanager
    def staging(self, label: str) -> Iterator[str]:
        """Stage in a private temporary folder, removed on exit."""
        with tempfile.TemporaryDirectory(prefix=f"shardcache-{label}-") as scratch:
            for sub in STAGED_FOLDERS:
                os.makedirs(os.path.join(scratch, sub))
            yield scratch

    def publish(self, staged: str, names: list[str]) -> None:
        """Upload the files in order, one request each: the last one is the commit point."""
        for name in names:  # in order, one request each: the last one is the commit point
            self.fs.put_file(os.path.join(staged, name), self._writing(name))

    def fetch(self, staged: str, names: list[str]) -> None:
        """Download the named objects into ``staged``."""
        if names:
            self.fs.get([self._path(n) for n in names], [os.path.join(staged, n) for n in names])


def open_storage(location: str) -> Storage:
    """The ``Storage`` of an ``--output``: ``FsspecStorage`` for a URL, else ``LocalStorage``."""
    return FsspecStorage(location) if is_url(location) else LocalStorage(location)
