"""Builds from and into object storage with no shared filesystem: tasks write to the store.

**Write side.** A build whose ``--output`` is a URL keeps all its state in the store, so any
machine can run any part of it and the driver never reads a node's local disk:

* the plan (``parts/build.json``, with the options fingerprint) is written to the store
  before any partition runs;
* each partition task (a local worker, a Ray task on any node, a job-array share) builds its
  partition in a task-local scratch folder (at most one partition's output; removed after),
  uploads its shards (``shards/<partition id>-...arrow``, names only this partition writes)
  and its ``parts/<id>.lengths.npy`` / ``parts/<id>.quarantine.jsonl``, and **its completion
  record ``parts/<id>.json`` last** (:func:`build_partition_into_store`). Until the record is
  there, the partition's objects are ignored; a retried or restarted task rewrites the same
  names with the same bytes (a partition's output is a pure function of its input), so
  nothing half-written survives a retry, and each byte is uploaded once (no copy at commit);
* the driver, or ``shardcache commit URL``, lists the records in the store, checks each
  against a listing of ``parts/`` and ``shards/`` (record readable, its files present, every
  shard at its recorded size), deletes objects no record lists, builds the length index and
  the quarantine file from the records' small files (in a temporary folder), uploads them and
  writes ``manifest.json`` **last**: the commit point. Object stores have no rename, but an
  object appears whole or not at all, and readers open nothing but what the manifest lists,
  so a reader never sees a half-written cache. A commit that dies is redone by running it
  again: every object it writes before the manifest is a pure function of the records.
* **resume from anywhere**: rerunning the command on any machine (fresh HOME, TMPDIR,
  ``SHARDCACHE_CACHE_DIR``) reads the plan from the store, keeps every partition whose
  record checks out, and runs the rest; the result is byte-identical to an uninterrupted
  build. ``--force`` deletes the manifest first (readers stop seeing the old cache), then the
  build's objects.

There is no lock across machines (object stores have none): run one driver per output, or
shares with distinct ``--partition i/N``; two runs of the same work write the same bytes.

**Inputs** given as URLs (files, prefixes or globs) are listed here (:func:`list_url_inputs`)
and read where they are, streamed through fsspec file objects (range reads; see
:func:`shardcache.builder.sources.open_input`): nothing is downloaded whole. Each keeps its
path relative to the common prefix of the URLs, its size and the object's modification time
(for the resume fingerprint), so the manifest's per-file relpath / size / sha256 are those of
a local build of the same files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
from collections.abc import Callable, Iterable
from typing import Any

from shardcache.builder.sources import InputFile, detect_format
from shardcache.errors import ConfigError, SourceError
from shardcache.store.layout import PARTS_DIR, SHARD_DIR, check_relative_name
from shardcache.store.remote import filesystem, is_url


def _mtime_ns(fs: Any, path: str, info: dict[str, Any]) -> int:
    with contextlib.suppress(Exception):
        return int(fs.modified(path).timestamp() * 1e9)
    for key in ("mtime", "LastModified", "last_modified"):
        if key in info:
            value = info[key]
            return int((value.timestamp() if hasattr(value, "timestamp") else float(value)) * 1e9)
    return 0


def list_url_inputs(specs: Iterable[str]) -> list[InputFile]:
    """List URL inputs (files, folders/prefixes or globs) without reading them.

    Returns input files whose ``path`` is the object's URL, ``relpath`` relative to the URLs'
    common prefix (as a local listing would make it), ``size`` the object's and ``mtime_ns``
    its modification time (the resume fingerprint).
    """
    specs = list(specs)
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
        raise SourceError(f"inputs {specs}: no input file found")
    root = os.path.commonpath([u.split("://", 1)[1].rsplit("/", 1)[0] for u in found])
    files = []
    for url, (fs, p, info) in sorted(found.items()):
        files.append(
            InputFile(
                path=url,
                relpath=os.path.relpath(url.split("://", 1)[1], root).replace(os.sep, "/"),
                size=int(info.get("size") or 0),
                format=detect_format(p) or "",
                mtime_ns=_mtime_ns(fs, p, info),
            )
        )
    files.sort(key=lambda f: f.relpath)
    return files


class OutputStore:
    """A build output at a URL: the few object operations the write side needs.

    Names are relative to the output (``parts/p00001.json``); every listing is fresh (the
    filesystem's listing cache is dropped first, another machine may have written since).
    """

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.fs, self.root = filesystem(self.url)
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        #: a filesystem with real folders (``file://``) needs them made before a write
        self._folders = "file" in protocols or "local" in protocols

    def _path(self, name: str) -> str:
        # every object name (ours, or listed from the store) is a plain relative name: a
        # listed key such as parts/../../x is refused, never read, deleted or written
        return f"{self.root}/{check_relative_name(name, f'object name under {self.url!r}')}"

    def _writing(self, name: str) -> str:
        path = self._path(name)
        if self._folders:
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        return path

    def exists(self, name: str) -> bool:
        self.fs.invalidate_cache()
        return bool(self.fs.exists(self._path(name)))

    def read_json(self, name: str) -> dict[str, Any] | None:
        """A JSON object, or None when it is missing or not a whole JSON object."""
        try:
            data = json.loads(self.fs.cat_file(self._path(name)))
        except (FileNotFoundError, ValueError, RecursionError):
            return None
        return data if isinstance(data, dict) else None

    def read_many(self, names: list[str]) -> dict[str, bytes | None]:
        """Several small objects at once (concurrent requests); None for a missing one."""
        if not names:
            return {}
        got = self.fs.cat([self._path(n) for n in names], on_error="return")
        out: dict[str, bytes | None] = {}
        for n in names:
            value = got.get(self._path(n))
            out[n] = value if isinstance(value, bytes) else None
        return out

    def write_json(self, name: str, obj: Any) -> None:
        """One object, written whole (the format of ``write_json_atomic``)."""
        data = (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()
        self.fs.pipe_file(self._writing(name), data)

    def put(self, pairs: list[tuple[str, str]]) -> None:
        """Upload ``(local file, name)`` pairs (in order, one request each)."""
        for local, name in pairs:
            self.fs.put_file(local, self._writing(name))

    def get(self, pairs: list[tuple[str, str]]) -> None:
        """Download ``(name, local file)`` pairs."""
        if pairs:
            self.fs.get([self._path(n) for n, _ in pairs], [local for _, local in pairs])

    def sizes(self, folder: str) -> dict[str, int]:
        """Every object under ``folder`` (one listing): name relative to it -> size."""
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
        """Delete objects (missing ones are fine)."""
        if names:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm([self._path(n) for n in names])
            self.fs.invalidate_cache()

    def remove_folders(self, folders: list[str]) -> None:
        for folder in folders:
            self.remove([f"{folder}/{n}" for n in self.sizes(folder)])


def build_partition_into_store(plan: Any, partition: Any, build: Callable[[Any], Any]) -> Any:
    """Build one partition for a URL output: ``build(local_plan)`` writes it into a scratch
    folder of this task; its files are uploaded, the completion record last."""
    store = OutputStore(plan.options.output)
    with tempfile.TemporaryDirectory(prefix=f"shardcache-{partition.id}-") as scratch:
        for sub in (SHARD_DIR, PARTS_DIR):
            os.makedirs(os.path.join(scratch, sub))
        options = dataclasses.replace(plan.options, output=scratch)
        result = build(dataclasses.replace(plan, options=options))
        files = [f"{SHARD_DIR}/{s.name}" for s in result.shards]
        files += [f"{PARTS_DIR}/{partition.id}.lengths.npy"]
        files += [f"{PARTS_DIR}/{partition.id}.quarantine.jsonl"]
        files += [f"{PARTS_DIR}/{partition.id}.json"]  # last: the completion record
        store.put([(os.path.join(scratch, name), name) for name in files])
    return result
